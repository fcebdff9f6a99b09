"""The prefix benchmark's workload on llama-cpp-python (run under the oracle's interpreter by bench_prefix.py).

Reads JSON on stdin: ``{"model", "n_ctx", "n_batch", "threads", "flash_attn", "type_kv", "cache_bytes" (0: no
LlamaRAMCache), "requests": [{"tokens", "forced"}]}``.  Each request goes through ``Llama.create_completion`` --
llama-cpp-python's own path: the LlamaRAMCache lookup (longest-prefix key; the state loaded when it beats the
context's current prefix), the context's prefix match, prompt evaluation, then the reply, here forced token by
token by a logits processor (greedy sampling of a one-hot distribution), and the state saved into the cache at the
end.  Time to first token is the time to the first streamed chunk; prompt tokens decoded are the tokens
``Llama.eval`` received before it.  Prints one JSON line.  Imports nothing from kvcache_ggml.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np


def main() -> int:  # pragma: no cover - runs under the oracle's interpreter
    import llama_cpp
    from llama_cpp.llama_cache import LlamaRAMCache

    spec = json.loads(sys.stdin.read())
    ggml_type = {"f32": 0, "f16": 1, "q8_0": 8}
    llm = llama_cpp.Llama(spec["model"], n_ctx=spec["n_ctx"], n_batch=spec["n_batch"], n_ubatch=spec["n_batch"],
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], n_gpu_layers=0,
                          flash_attn=spec["flash_attn"], type_k=ggml_type[spec["type_kv"]],
                          type_v=ggml_type[spec["type_kv"]], verbose=False, seed=0)
    cache = None
    if spec["cache_bytes"]:
        cache = LlamaRAMCache(capacity_bytes=spec["cache_bytes"])
        llm.set_cache(cache)
    evaluated = [0]
    eval_orig = llm.eval

    def counting_eval(tokens):
        evaluated[0] += len(tokens)
        return eval_orig(tokens)

    llm.eval = counting_eval
    out = []
    peak_entries = peak_bytes = peak_real = 0
    for req in spec["requests"]:
        forced = req["forced"]
        prompt = req["tokens"]

        def force(input_ids, scores, forced=forced, n0=len(prompt)):
            k = len(input_ids) - n0
            keep = scores[forced[k]]
            scores[:] = -np.inf
            scores[forced[k]] = keep
            return scores

        evaluated[0] = 0
        t0 = time.perf_counter()
        ttft = n_prompt_eval = None
        n_out = 0
        for _ in llm.create_completion(prompt, max_tokens=len(forced), temperature=0.0, stream=True,
                                       logits_processor=llama_cpp.LogitsProcessorList([force])):
            if ttft is None:
                ttft = time.perf_counter() - t0
                n_prompt_eval = evaluated[0]
            n_out += 1
        total = time.perf_counter() - t0
        item = {"ttft": ttft, "seconds": total, "decoded": n_prompt_eval, "chunks": n_out}
        if cache is not None:
            states = list(cache.cache_state.values())
            peak_entries = max(peak_entries, len(states))
            peak_bytes = max(peak_bytes, cache.cache_size)
            real = sum(s.llama_state_size + s.scores.nbytes + s.input_ids.nbytes for s in states)
            peak_real = max(peak_real, real)
        out.append(item)
    print(json.dumps({"requests": out, "cache_entries_peak": peak_entries, "cache_size_peak": peak_bytes,
                      "cache_real_bytes_peak": peak_real}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
