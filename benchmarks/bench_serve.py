"""Serving, side by side: ``python -m kvcache_ggml serve`` against llama.cpp's own ``llama-server``.

    python benchmarks/bench_serve.py [--users 1 4 8] [--turns 3] [--runs 3] [--system 300] [--reply 32]

Both servers run the same GGUF -- a 4-layer llama (n_embd 256) with GPT-2's vocabulary, Q8_0 matrices and a ChatML
template, made here with the project's model maker -- with the same context, parallel slots, threads, batch sizes,
unified KV cache and flash attention; llama-server keeps its prompt caching at its defaults (``cache_prompt``,
``--cache-ram``), renders the template with ``--jinja`` and returns the reply as plain content
(``--skip-chat-parsing``, as ours: its reasoning and tool-call parser fails on a random model's text); ours has a
1 GiB host tier (``--host-cache-mib``).  llama-server is the one scripts/build_reference.sh
--server builds (from the llama-cpp-python 0.3.17 source package the reference comes from); without it only our
rows are printed.

The workload is a chat through the HTTP API with streaming: U users at once, T turns each, every request carrying
the whole history (a shared system prompt of ``--system`` tokens, the user's messages, the replies so far);
``ignore_eos`` and greedy decoding make every reply ``--reply`` tokens long on both servers, and a ``logit_bias``
bans the tokens that are not UTF-8 text on their own (llama-server's chat parser refuses a reply of invalid UTF-8,
which a random model writes).  Per configuration:

* output tokens/s -- completion tokens of all requests over the wall time of the run;
* TTFT p50/p90 -- from sending a request to its first non-empty content chunk;
* prompt tokens computed -- llama-server's ``timings.prompt_n``, ours ``prompt_tokens - cached_tokens``; beside the
  ideal: each prompt's tokens less its longest common prefix with any earlier prompt of the run (every shared
  prefix reused), token ids from the model's vocabulary.

The median of ``--runs`` runs is printed (each run starts both servers afresh, so caches start empty; one short
request warms each server before the timed part, and ``/health`` is 200 on both only once they have warmed up).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "oracle"))
sys.path.insert(0, str(ROOT / "tests"))
from llama_runner import LLAMA_SERVER  # noqa: E402  (the one place naming the reference)
from serve_helpers import CHATML, GPT2_VOCAB  # noqa: E402

WORDS = ("weather city river mountain forecast rain sun cloud storm wind cold warm north south morning evening "
         "question answer detail report season summer winter spring autumn coast valley forest desert").split()


@dataclass(slots=True)
class Sample:
    """One request of a run."""

    user: int                # who sent it
    turn: int                # which turn
    ttft: float              # seconds to the first non-empty content chunk
    seconds: float           # seconds to the end of the stream
    completion: int          # completion tokens
    prompt: int              # prompt tokens
    computed: int            # prompt tokens the server decoded
    sent: float              # perf_counter when it was sent
    messages: list           # the request's messages (the whole history)


@dataclass(slots=True)
class Run:
    """One run of the workload on one server."""

    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0        # seconds from the first request to the last answer
    errors: list[str] = field(default_factory=list)


def make_bench_model(path: Path) -> Path:
    from kvcache_ggml.runtime.modelmaker import make_model
    if not path.exists():
        make_model(path, layers=4, embd=256, heads=8, heads_kv=4, ff=768, seed=11, type="q8_0",
                   vocab_from=str(GPT2_VOCAB), chat_template=CHATML, ctx=16384)
    return path


def text_of(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(rng.choice(WORDS, n_words))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(kind: str, model: Path, port: int, a: argparse.Namespace, users: int) -> list[str]:
    common = ["-c", str(a.n_ctx), "-np", str(users), "-t", str(a.threads), "-b", str(a.batch), "-ub", str(a.ubatch),
              "-fa", "on", "-kvu", "--host", "127.0.0.1", "--port", str(port)]
    if kind == "ours":
        return [sys.executable, "-m", "kvcache_ggml", "serve", "--model", str(model), "--alias", "bench",
                "--host-cache-mib", "1024", *common]
    # --skip-chat-parsing: the reply is plain content, as ours (no reasoning or tool-call parsing, which fails on a
    # random model's text: "Failed to parse input")
    return [str(LLAMA_SERVER), "-m", str(model), "--alias", "bench", "--jinja", "--skip-chat-parsing", "--no-webui",
            *common]


def partial_utf8_tokens(model: Path) -> dict[str, float]:
    """logit_bias banning the tokens whose bytes are not UTF-8 text on their own (344 of GPT-2's): a random model
    strings them into invalid UTF-8, which llama-server's chat parser refuses ("Failed to parse input") even with
    --skip-chat-parsing; both servers get the same bias."""
    from kvcache_ggml.runtime.tokenizer import Vocab
    vocab = Vocab.from_gguf(model)
    bad = {}
    for t in range(len(vocab.tokens)):
        try:
            vocab.token_to_piece(t).decode("utf-8")
        except UnicodeDecodeError:
            bad[str(t)] = -100.0
    return bad


def warm_request(url: str, bias: dict[str, float]) -> None:
    """One short chat request before the timed run, on both servers: a server's first request pays one-time costs
    (ours: lazy imports and first calls of the HTTP stack, about 15 ms) that a serving benchmark should not count;
    its prompt shares nothing with the workload's."""
    import openai
    cl = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    for _ in cl.chat.completions.create(model="bench", messages=[{"role": "user", "content": "Warm up."}],
                                        max_tokens=2, temperature=0, stream=True, logit_bias=bias):
        pass


def run_workload(url: str, users: int, a: argparse.Namespace, seed: int, bias: dict[str, float]) -> Run:
    import openai

    rng = np.random.default_rng(seed)
    system = text_of(rng, a.system)
    messages = [[text_of(rng, int(rng.integers(15, 40))) for _ in range(a.turns)] for _ in range(users)]
    run = Run()
    lock = threading.Lock()

    def user(u: int) -> None:
        cl = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        history = [{"role": "system", "content": system}]
        for t in range(a.turns):
            history.append({"role": "user", "content": messages[u][t]})
            t0 = time.perf_counter()
            ttft, parts, usage, timings = 0.0, [], None, None
            try:
                stream = cl.chat.completions.create(model="bench", messages=history, max_tokens=a.reply,
                                                    temperature=0, stream=True, logit_bias=bias,
                                                    stream_options={"include_usage": True},
                                                    extra_body={"ignore_eos": True})
                for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        if not ttft:
                            ttft = time.perf_counter() - t0
                        parts.append(ch.choices[0].delta.content)
                    usage = ch.usage or usage
                    timings = (ch.model_extra or {}).get("timings") or timings
            except Exception as e:  # noqa: BLE001 -- reported, the run goes on
                with lock:
                    run.errors.append(f"user {u} turn {t}: {e}")
                return
            seconds = time.perf_counter() - t0
            cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
            computed = int(timings["prompt_n"]) if timings else usage.prompt_tokens - cached
            with lock:
                run.samples.append(Sample(u, t, ttft or seconds, seconds, usage.completion_tokens,
                                          usage.prompt_tokens, computed, t0, list(history)))
            history.append({"role": "assistant", "content": "".join(parts)})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    run.wall = time.perf_counter() - t0
    return run


def ideal_computed(model: Path, run: Run) -> int:
    """Prompt tokens to compute if every prefix shared with an earlier prompt of the run were reused: each prompt's
    tokens less its longest common prefix with any prompt sent before it (at least its last token)."""
    from kvcache_ggml._gguf import GGUFFile
    from kvcache_ggml.runtime.tokenizer import Vocab
    from kvcache_ggml.serve.chat import ChatTemplate

    kv = GGUFFile(model).kv
    vocab = Vocab.from_kv(kv)
    tmpl = ChatTemplate.from_gguf_kv(kv, vocab)
    seen: list[np.ndarray] = []
    total = 0
    for smp in sorted(run.samples, key=lambda x: x.sent):
        toks = np.array(vocab.tokenize(tmpl.render(smp.messages), add_special=True, parse_special=True))
        best = 0
        for prev in seen:
            m = min(prev.size, toks.size)
            neq = np.flatnonzero(prev[:m] != toks[:m])
            best = max(best, int(neq[0]) if neq.size else m)
        total += toks.size - min(best, toks.size - 1)
        seen.append(toks)
    return total


def one(kind: str, model: Path, users: int, a: argparse.Namespace, seed: int, log: Path,
        bias: dict[str, float]) -> Run:
    port = free_port()
    cmd = server_cmd(kind, model, port, a, users)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            warm_request(f"http://127.0.0.1:{port}", bias)
            return run_workload(f"http://127.0.0.1:{port}", users, a, seed, bias)
        finally:
            stop([proc])


def stop(procs) -> None:
    """Terminate the servers (killed after 30 s)."""
    for p in procs:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def summary(runs: list[Run], model: Path) -> dict[str, float]:
    runs = [r for r in runs if r.samples]  # (a run whose every request failed has nothing to count)
    if not runs:
        return {k: float("nan") for k in ("tok/s", "ttft50", "ttft90", "computed", "prompt", "requests", "ideal")}

    def med(f):
        return statistics.median(f(r) for r in runs)
    return {
        "tok/s": med(lambda r: sum(s.completion for s in r.samples) / r.wall),
        "ttft50": med(lambda r: float(np.percentile([s.ttft for s in r.samples], 50))),
        "ttft90": med(lambda r: float(np.percentile([s.ttft for s in r.samples], 90))),
        "computed": med(lambda r: sum(s.computed for s in r.samples)),
        "prompt": med(lambda r: sum(s.prompt for s in r.samples)),
        "requests": med(lambda r: len(r.samples)),
        "ideal": med(lambda r: ideal_computed(model, r)),
    }


# ---------------------------------------------------------------------------------------------- --cache-reuse N

def reuse_prompts(rng: np.random.Generator, a: argparse.Namespace) -> list[str]:
    """A document read through a sliding window, one completion request per step: request k holds paragraphs
    k..k+W-1 and a question, so the paragraphs of the previous request but its first reappear, moved back by one
    paragraph (chunks a cache-reuse server shifts into place; a prefix cache alone matches nothing)."""
    w, n = a.reuse_window, a.reuse_requests
    paras = [text_of(rng, a.reuse_words) for _ in range(w + n - 1)]
    return ["\n\n".join(paras[k:k + w]) + "\n\nQuestion: which season comes next?\nAnswer:" for k in range(n)]


def reuse_run(kind: str, model: Path, n_reuse: int, a: argparse.Namespace, log: Path,
              bias: dict[str, float]) -> dict[str, float]:
    """One server (one slot) with ``--cache-reuse n_reuse``, the sliding-window requests one after the other:
    prompt tokens, of them computed, median and total seconds per request (the first, a cold read, left out)."""
    import openai

    port = free_port()
    cmd = server_cmd(kind, model, port, a, 1) + ["--cache-reuse", str(n_reuse)]
    prompts = reuse_prompts(np.random.default_rng(7), a)
    prompt = computed = 0
    secs = []
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            warm_request(url, bias)
            cl = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            for k, p in enumerate(prompts):
                t0 = time.perf_counter()
                r = cl.completions.create(model="bench", prompt=p, max_tokens=a.reply, temperature=0,
                                          logit_bias=bias, extra_body={"ignore_eos": True})
                dt = time.perf_counter() - t0
                if k == 0:
                    continue
                timings = (r.model_extra or {}).get("timings")
                details = r.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
                prompt += r.usage.prompt_tokens
                computed += int(timings["prompt_n"]) if timings else r.usage.prompt_tokens - cached
                secs.append(dt)
        finally:
            stop([proc])
    return {"prompt": prompt, "computed": computed, "p50": statistics.median(secs), "total": sum(secs)}


def reuse_main(model: Path, a: argparse.Namespace, kinds: list[str], log: Path, bias: dict[str, float]) -> int:
    """The cache-reuse rows: each server without chunk reuse and with ``--cache-reuse N`` (best of ``--runs``)."""
    print(f"cache reuse: {a.reuse_requests} requests, one slot, a window of {a.reuse_window} paragraphs of "
          f"{a.reuse_words} words sliding by one; replies {a.reply} tokens; the first request (cold) not counted")
    for kind in kinds:
        cmd = " ".join(server_cmd(kind, model, 0, a, 1)).replace(" --port 0", "")
        print(f"  {kind:>5}: {cmd} --cache-reuse N")
    print(f"{'server':>6} {'N':>4} {'prompt':>7} {'computed':>9} {'p50 s/req':>10} {'total s':>8}")
    for kind in kinds:
        for n_reuse in (0, a.cache_reuse):
            runs = [reuse_run(kind, model, n_reuse, a, log, bias) for _ in range(a.runs)]
            best = min(runs, key=lambda r: r["total"])
            print(f"{kind:>6} {n_reuse:>4} {best['prompt']:>7.0f} {best['computed']:>9.0f} {best['p50']:>10.3f} "
                  f"{best['total']:>8.2f}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- --restore

def restore_post(url: str, path: str, body: dict) -> tuple[dict, float]:
    """POST ``body`` as JSON; (the answer, seconds it took)."""
    import json
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def restore_run(kind: str, model: Path, a: argparse.Namespace, log: Path, bias: dict[str, float]) -> list[dict]:
    """One server, ``a.runs`` times: a conversation of ``a.restore`` tokens read and saved to a slot file; then the
    next turn (the conversation and 8 tokens more, one token of reply) computed from scratch after the slot is
    erased, and the same turn after the slot is restored from the file.  Per run: (seconds) the restore call, the
    turn's time after it and from scratch; the prompt tokens each computed."""
    rng = np.random.default_rng(5)
    conv = [int(t) for t in rng.integers(1000, 30000, a.restore)]
    turn = conv + [int(t) for t in rng.integers(1000, 30000, 8)]
    body = {"model": "bench", "max_tokens": 1, "temperature": 0, "logit_bias": bias, "id_slot": 0}
    port, rows = free_port(), []
    with tempfile.TemporaryDirectory() as slots, open(log, "ab") as out:
        extra = ["--slot-save-path", slots] + (["--host-cache-mib", "0"] if kind == "ours" else ["--cache-ram", "0"])
        cmd = [x for x in server_cmd(kind, model, port, a, 1) if x not in ("--host-cache-mib", "1024")] + extra
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            restore_post(url, "/v1/completions", dict(body, prompt=[11, 12, 13]))  # warm-up
            for _ in range(a.runs):
                restore_post(url, "/v1/completions", dict(body, prompt=conv))
                restore_post(url, "/slots/0?action=save", {"filename": "conv.bin"})
                restore_post(url, "/slots/0?action=erase", {})
                scratch, t_scratch = restore_post(url, "/v1/completions", dict(body, prompt=turn))
                restore_post(url, "/slots/0?action=erase", {})
                restored, t_restore = restore_post(url, "/slots/0?action=restore", {"filename": "conv.bin"})
                after, t_after = restore_post(url, "/v1/completions", dict(body, prompt=turn))
                restore_post(url, "/slots/0?action=erase", {})
                assert restored["n_restored"] == len(conv), restored
                rows.append({"restore": t_restore, "after": t_after, "scratch": t_scratch,
                             "computed_after": restore_computed(kind, after),
                             "computed_scratch": restore_computed(kind, scratch)})
        finally:
            stop([proc])
    return rows


def restore_computed(kind: str, answer: dict) -> int:
    """Prompt tokens a server computed for a completion (llama-server's timings.prompt_n)."""
    if kind == "llama":
        return int(answer["timings"]["prompt_n"])
    u = answer["usage"]
    return int(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"])


def restore_main(model: Path, a: argparse.Namespace, kinds: list[str], log: Path, bias: dict[str, float]) -> int:
    """``--restore N``: the time to first token of a restored N-token conversation against recomputing it."""
    print(f"restore: a {a.restore}-token conversation saved to a slot file; its next turn (+8 tokens, 1 token of "
          f"reply) after erasing the slot (scratch) and after restoring it (restore call + the turn); -np 1, median "
          f"of {a.runs}")
    for kind in kinds:
        cmd = " ".join(server_cmd(kind, model, 0, a, 1)).replace(" --port 0", "")
        print(f"  {kind:>5}: {cmd.replace(' --host-cache-mib 1024', '')} --slot-save-path DIR "
              f"{'--host-cache-mib 0' if kind == 'ours' else '--cache-ram 0'}")
    print(f"{'server':>6} {'restore':>8} {'turn':>8} {'restore+turn':>13} {'scratch':>8} {'computed':>9} "
          f"{'scratch computed':>17}")
    for kind in kinds:
        rows = restore_run(kind, model, a, log, bias)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{kind:>6} {med['restore'] * 1e3:>6.1f}ms {med['after'] * 1e3:>6.1f}ms "
              f"{(med['restore'] + med['after']) * 1e3:>11.1f}ms {med['scratch'] * 1e3:>6.1f}ms "
              f"{med['computed_after']:>9.0f} {med['computed_scratch']:>17.0f}", flush=True)
    return 0


SPEC_MODES = ("none", "draft", "ngram")


def spec_flags(kind: str, mode: str, draft: Path, a: argparse.Namespace) -> list[str]:
    """The speculative options of one row: none, ``-md`` (both servers the same), or prompt lookup (ours
    ``--spec-ngram``, llama-server ``--spec-type ngram-simple`` with 2-token keys)."""
    if mode == "draft":
        return ["-md", str(draft), "--draft-max", str(a.spec_draft_max), "--draft-p-min", str(a.spec_p_min)]
    if mode == "ngram" and kind == "ours":
        return ["--spec-ngram", "--draft-max", str(a.spec_draft_max)]
    if mode == "ngram":
        return ["--spec-type", "ngram-simple", "--spec-ngram-size-n", "2", "--spec-ngram-size-m",
                str(a.spec_draft_max), "--draft-max", str(a.spec_draft_max)]
    return []


def spec_post(url: str, body: dict) -> dict:
    import json
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": "bench", **body}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


def spec_run(kind: str, mode: str, models: tuple[Path, Path], prompts: list[list[int]], a: argparse.Namespace,
             log: Path, bias: dict[str, float]) -> dict:
    """One server, every user's prompt at once (greedy, ``--spec-reply`` tokens): output tokens/s over the wall
    time, the texts, and the draft tokens verified and accepted (ours: /metrics; llama-server: timings)."""
    port = free_port()
    cmd = server_cmd(kind, models[0], port, a, len(prompts)) + spec_flags(kind, mode, models[1], a)
    texts: list[str] = [""] * len(prompts)
    drafted = accepted = 0
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc)
            spec_post(url, {"prompt": [400, 401, 402], "max_tokens": 4, "temperature": 0})  # (warm-up)
            tok_s, answers = spec_answers(url, prompts, a, bias)
            for u, ans in enumerate(answers):
                texts[u] = ans["choices"][0]["text"]
                tm = ans.get("timings") or {}
                drafted, accepted = drafted + tm.get("draft_n", 0), accepted + tm.get("draft_n_accepted", 0)
            if kind == "ours":
                with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                    m = dict(ln.split() for ln in r.read().decode().splitlines() if ln and ln[0] != "#")
                drafted, accepted = int(m["kvcache_draft_n_total"]), int(m["kvcache_draft_n_accepted_total"])
        finally:
            stop([proc])
    return {"tok/s": tok_s, "texts": texts, "drafted": drafted, "accepted": accepted}


def spec_answers(url: str, prompts: list[list[int]], a: argparse.Namespace, bias: dict[str, float],
                 **extra) -> tuple[float, list[dict]]:
    """Every user's prompt at once (greedy, ``--spec-reply`` tokens; ``extra`` in each body): output tokens/s over
    the wall time, and the answers."""
    answers: list[dict] = [{}] * len(prompts)

    def user(u: int) -> None:
        answers[u] = spec_post(url, {"prompt": prompts[u], "max_tokens": a.spec_reply, "temperature": 0,
                                     "ignore_eos": True, "logit_bias": bias, **extra})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(ans["usage"]["completion_tokens"] for ans in answers) / (time.perf_counter() - t0), answers


def add_spec_args(ap: argparse.ArgumentParser) -> None:
    """The speculative workload's options (here and in bench_serve_ab.py)."""
    ap.add_argument("--spec-draft-max", type=int, default=16, help="speculative: --draft-max (default %(default)s)")
    ap.add_argument("--spec-p-min", type=float, default=0.75,
                    help="speculative: -md --draft-p-min, both servers (default %(default)s, llama-server's)")
    ap.add_argument("--spec-reply", type=int, default=96, help="speculative: reply tokens (default %(default)s)")


def spec_main(a: argparse.Namespace, kinds: list[str], log: Path) -> int:
    """The speculative rows: each server without drafts, with ``-md`` and with prompt lookup, on the code-editing
    workload of benchmarks/_spec_models.py; the speedup is tokens/s over the same server's without drafts."""
    from _spec_models import spec_models, spec_prompts

    tmp = Path(tempfile.gettempdir())
    models = spec_models(tmp / "kvcache_bench_spec_target.gguf", tmp / "kvcache_bench_spec_draft.gguf", GPT2_VOCAB,
                         CHATML)
    bias = partial_utf8_tokens(models[0])
    print(f"target {models[0].name} (16 layers, n_embd 512, Q8_0), draft {models[1].name} (its first layer); "
          f"--draft-max {a.spec_draft_max}, -md --draft-p-min {a.spec_p_min}; replies {a.spec_reply} tokens; "
          f"-t {a.threads}; best of {a.runs} runs; servers' output in {log}")
    print(f"{'users':>5} {'server':>6} {'mode':>6} {'tok/s':>8} {'speedup':>8} {'accepted':>14} {'same text':>9}")
    for users in a.users:
        prompts = spec_prompts(models[0], users, a.spec_reply, [int(t) for t in bias])
        for kind in kinds:
            base = None
            for mode in SPEC_MODES:
                runs = [spec_run(kind, mode, models, prompts, a, log, bias) for _ in range(a.runs)]
                r = max(runs, key=lambda x: x["tok/s"])
                base = base or r
                acc = f"{r['accepted']}/{r['drafted']}" if mode != "none" else "-"
                print(f"{users:>5} {kind:>6} {mode:>6} {r['tok/s']:>8.1f} {r['tok/s'] / base['tok/s']:>7.2f}x "
                      f"{acc:>14} {str(r['texts'] == base['texts']):>9}", flush=True)
    return 0


def add_chat_args(ap: argparse.ArgumentParser) -> None:
    """The chat workload's and the servers' options (here and in bench_serve_ab.py)."""
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system", type=int, default=300, help="words of the shared system prompt (about 1 token each)")
    ap.add_argument("--reply", type=int, default=32, help="tokens per reply")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "kvcache_bench_serve.gguf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--runs", type=int, default=3)
    add_chat_args(ap)
    ap.add_argument("--only", choices=("ours", "llama"), default=None)
    ap.add_argument("--restore", type=int, default=0, metavar="N",
                    help="run the slot-restore scenario instead: TTFT of a restored N-token conversation against "
                         "recomputing it, both servers")
    ap.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                    help="run the cache-reuse scenario instead (a sliding window over a document), both servers "
                         "without and with --cache-reuse N")
    ap.add_argument("--reuse-requests", type=int, default=8, help="cache reuse: requests (default %(default)s)")
    ap.add_argument("--reuse-window", type=int, default=8, help="cache reuse: paragraphs a request holds")
    ap.add_argument("--reuse-words", type=int, default=60, help="cache reuse: words a paragraph (~1 token each)")
    ap.add_argument("--spec", action="store_true",
                    help="run the speculative decoding scenario instead (a reply that repeats its prompt): each "
                         "server without drafts, with -md and with prompt lookup")
    add_spec_args(ap)
    a = ap.parse_args()
    if a.spec:
        kinds = [k for k in ("ours", "llama") if a.only in (None, k) and (k == "ours" or LLAMA_SERVER.exists())]
        return spec_main(a, kinds, Path(tempfile.gettempdir()) / "bench_serve.log")
    model = make_bench_model(a.model)
    kinds = [k for k in ("ours", "llama") if a.only in (None, k)]
    if "llama" in kinds and not LLAMA_SERVER.exists():
        print(f"({LLAMA_SERVER} missing: bash scripts/build_reference.sh --server; our rows only)")
        kinds.remove("llama")
    log = Path(tempfile.gettempdir()) / "bench_serve.log"
    bias = partial_utf8_tokens(model)
    if a.restore > 0:
        return restore_main(model, a, kinds, log, bias)
    if a.cache_reuse > 0:
        return reuse_main(model, a, kinds, log, bias)
    print(f"model {model.name}: 4 layers, n_embd 256, Q8_0, GPT-2 vocabulary; n_ctx {a.n_ctx}, -b {a.batch} "
          f"-ub {a.ubatch} -t {a.threads} -fa on -kvu; {a.turns} turns, system ~{a.system} tokens, replies "
          f"{a.reply} tokens; median of {a.runs} runs; servers' output in {log}")
    for kind in kinds:
        cmd = " ".join(server_cmd(kind, model, 0, a, 0)).replace(" -np 0", " -np U").replace(" --port 0", "")
        print(f"  {kind:>5}: {cmd}")
    print(f"{'users':>5} {'server':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'computed':>9} {'ideal':>7} "
          f"{'prompt':>7} {'req':>4}")
    for users in a.users:
        rows = {}
        for kind in kinds:
            runs = []
            for r in range(a.runs):
                run = one(kind, model, users, a, seed=100 + r, log=log, bias=bias)
                if run.errors:
                    print(f"  {kind}: {len(run.errors)} errors, e.g. {run.errors[0]}")
                runs.append(run)
            rows[kind] = summary(runs, model)
            s = rows[kind]
            print(f"{users:>5} {kind:>6} {s['tok/s']:>8.1f} {s['ttft50'] * 1e3:>7.0f}ms {s['ttft90'] * 1e3:>7.0f}ms "
                  f"{s['computed']:>9.0f} {s['ideal']:>7.0f} {s['prompt']:>7.0f} "
                  f"{s['requests']:>4.0f}", flush=True)
        if len(rows) == 2:
            o, l = rows["ours"], rows["llama"]
            print(f"{users:>5} {'ratio':>6} {o['tok/s'] / l['tok/s']:>7.2f}x {o['ttft50'] / l['ttft50']:>8.2f}x "
                  f"{o['ttft90'] / l['ttft90']:>8.2f}x {o['computed'] / max(l['computed'], 1):>8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
