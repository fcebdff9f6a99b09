"""Constants shared by the layers that import no ggml (cells, batches)."""

#: the largest number of sequences a cache can track (llama.cpp's LLAMA_MAX_SEQ)
LLAMA_MAX_SEQ = 256

#: 64-bit words in a per-cell sequence bitset
SEQ_WORDS = LLAMA_MAX_SEQ // 64
