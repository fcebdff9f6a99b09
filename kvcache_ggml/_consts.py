"""Constants shared by every layer, the ones that import no ggml (cells, batches, bookkeeping) included."""

#: the largest number of sequences a cache can track (llama.cpp's LLAMA_MAX_SEQ)
LLAMA_MAX_SEQ = 256

#: 64-bit words in a per-cell sequence bitset
SEQ_WORDS = LLAMA_MAX_SEQ // 64

#: the largest llama_pos (int32); also the "to the end" bound of a position range
INT32_MAX = 2**31 - 1
