"""``python -m kvcache_ggml serve --model PATH``: an OpenAI-compatible HTTP server on uvicorn.

The context has ``--parallel`` sequences for requests plus ``--parked`` more (default: as many with
``--kv-unified`` and more than one slot, none otherwise) where finished conversations stay cached for the next
request that shares their prefix; the prefix cache evicts them (to the host tier, ``--host-cache-mib``) when room
is needed.  With ``--kv-unified`` all sequences share one cache of ``--n-ctx`` cells, so one request may use all of
it (llama-server's ``-kvu``); without, each sequence has its own stream of ``n_ctx / sequences`` cells.  SIGINT or
SIGTERM stops the server gracefully: it stops taking requests, ends the running ones, and closes the model.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_args", "open_service", "CACHE_TYPES"]

# the K/V cache types llama-server's -ctk/-ctv take (the types set_rows writes)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def parse_args(argv: list[str]) -> argparse.Namespace:
    from ..runtime.arch import supported_archs
    from .speculative import add_spec_args

    ap = argparse.ArgumentParser(prog="python -m kvcache_ggml serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True,
                    help=f"a GGUF with a tokenizer ({', '.join(supported_archs())})")
    ap.add_argument("--alias", default="", help="the model name clients ask for (default: the file's stem)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    ap.add_argument("--port", type=int, default=8080, help="port (default %(default)s; 0: any free port)")
    ap.add_argument("--parallel", "-np", type=int, default=4, help="requests decoding at once (default %(default)s)")
    ap.add_argument("--parked", type=int, default=-1,
                    help="sequences beyond --parallel for cached conversations (default: --parallel with "
                         "--kv-unified and --parallel > 1, else 0)")
    ap.add_argument("--n-ctx", "-c", type=int, default=4096, help="context size, all sequences (default %(default)s)")
    ap.add_argument("--batch", "-b", type=int, default=2048,
                    help="tokens per step, the token budget (default %(default)s)")
    ap.add_argument("--ubatch", "-ub", type=int, default=512, help="tokens per graph (default %(default)s)")
    ap.add_argument("--kv-unified", "-kvu", action="store_true", help="one cache shared by all sequences")
    ap.add_argument("--flash-attn", "-fa", choices=("on", "off"), default="on", help="flash attention (default on)")
    ap.add_argument("--cache-type-k", "-ctk", default="f16", choices=CACHE_TYPES, metavar="TYPE",
                    help=f"ggml type of the K cache: {', '.join(CACHE_TYPES)} (default %(default)s)")
    ap.add_argument("--cache-type-v", "-ctv", default="f16", choices=CACHE_TYPES, metavar="TYPE",
                    help="ggml type of the V cache (default %(default)s)")
    ap.add_argument("--threads", "-t", type=int, default=4, help="CPU threads (default %(default)s)")
    ap.add_argument("--host-cache-mib", type=int, default=0, help="RAM for evicted prefixes, MiB (default 0: none)")
    ap.add_argument("--api-key", default="", help="require Authorization: Bearer KEY")
    ap.add_argument("--slot-save-path", type=Path, default=None,
                    help="directory of POST /slots/{id}?action=save|restore files (default: none, actions off)")
    ap.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                    help="the GET /slots endpoint (default: on)")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the running ones before 503")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default %(default)s)")
    ap.add_argument("--max-body-mib", type=float, default=8.0, help="largest request body, MiB (default %(default)s)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the warm-up decode at start (as llama-server's --no-warmup)")
    ap.add_argument("--prompts-per-step", type=int, default=None, metavar="N",
                    help="prompts read in one step, the fewest tokens left first (0: as many as --batch holds, in "
                         "arrival order; default with --parallel > 4: 1 with split steps, else 2; up to 4: 0)")
    ap.add_argument("--split-steps", action=argparse.BooleanOptionalAction, default=None,
                    help="a step generates or reads prompts, never both: they alternate while both wait, and "
                         "requests arriving during a generating step are read in the next (default: with "
                         "--parallel > 4)")
    ap.add_argument("--fa-tiles", action=argparse.BooleanOptionalAction, default=True,
                    help="steps of 2..63 tokens may take throwaway rows up to 64, where this CPU's flash attention "
                         "computes them faster in tiles (measured at warm-up; default: on)")
    add_spec_args(ap)
    ap.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                    help="reuse chunks of >= N tokens of a cached prompt by K-shift (default 0: off; per request "
                         "n_cache_reuse)")
    ap.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                    help="a request reaching the context drops n_discard tokens after n_keep and goes on (default: "
                         "off, it ends with finish_reason length)")
    a = ap.parse_args(argv)
    _check_args(ap, a)
    return a


def _check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Each option's limit (a usage error naming the option, the value and the limit); --parked resolved."""
    from ..runtime.arch import unsupported_arch
    from .speculative import check_spec_args

    if a.prompts_per_step is not None and a.prompts_per_step < 0:
        ap.error(f"--prompts-per-step must be >= 0 (0: no limit), got {a.prompts_per_step}")
    if a.cache_reuse < 0:
        ap.error(f"--cache-reuse must be >= 0 (0: off), got {a.cache_reuse}")
    for name in ("parallel", "n_ctx", "batch", "ubatch", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("host_cache_mib", "max_queue"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if not a.timeout > 0:  # (NaN too; inf: no limit)
        ap.error(f"--timeout must be a number of seconds > 0, got {a.timeout}")
    if not 0 < a.max_body_mib < math.inf:
        ap.error(f"--max-body-mib must be a finite number > 0, got {a.max_body_mib}")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port must be in [0, 65535], got {a.port}")
    if a.parked < 0:  # (one slot: its own sequence is the cache, as llama-server's; see docs/serving.md)
        a.parked = a.parallel if a.kv_unified and a.parallel > 1 else 0
    if not a.model.is_file():
        ap.error(f"--model {a.model}: no such file")
    why = unsupported_arch(a.model)
    if why:
        ap.error(f"--model {a.model}: {why}")
    check_spec_args(ap, a)
    if a.slot_save_path is not None and not a.slot_save_path.is_dir():
        ap.error(f"--slot-save-path {a.slot_save_path}: not a directory")


def open_service(a: argparse.Namespace):
    """(model, context, Service) for parsed arguments; the caller closes the context and the model."""
    from ..prefix import HostParams, PrefixParams
    from ..runtime.arch import load_model
    from ..runtime.context import Context
    from ..cparams import ContextParams
    from ..runtime.tokenizer import Vocab
    from .app import Service
    from .chat import ChatTemplate
    from .engine import Engine, EngineParams
    from .speculative import close_drafter, open_drafter

    model = load_model(a.model)
    try:
        vocab = Vocab.from_kv(model.gguf_kv, str(a.model))
        params = ContextParams(n_ctx=a.n_ctx, n_batch=a.batch, n_ubatch=min(a.ubatch, a.batch),
                               n_seq_max=a.parallel + a.parked, kv_unified=a.kv_unified,
                               flash_attn=a.flash_attn == "on", n_threads=a.threads, n_threads_batch=a.threads,
                               type_k=a.cache_type_k, type_v=a.cache_type_v)
        ctx = Context(model, params)
    except BaseException:
        model.close()
        raise
    drafter = None
    try:
        drafter = open_drafter(a, ctx)
        prefix = PrefixParams(host=HostParams(budget=a.host_cache_mib << 20))
        engine = Engine(ctx, vocab, EngineParams(n_parallel=a.parallel, max_queue=a.max_queue, timeout=a.timeout,
                                                   warmup=a.warmup, cache_reuse=a.cache_reuse,
                                                   context_shift=a.context_shift, draft_max=a.draft_max,
                                                   draft_min=a.draft_min, fa_tiles=a.fa_tiles,
                                                   prompts_per_step=a.prompts_per_step,
                                                   split_steps=a.split_steps),
                        prefix, drafter)
        svc = Service(engine, vocab, a.alias or a.model.stem, ChatTemplate.from_gguf_kv(model.gguf_kv, vocab),
                      api_key=a.api_key, max_body=int(a.max_body_mib * (1 << 20)), created=int(time.time()),
                      slot_dir=a.slot_save_path, slots_endpoint=a.slots)
    except BaseException:
        close_drafter(drafter)
        ctx.close()
        model.close()
        raise
    return model, ctx, svc


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose SIGINT/SIGTERM stop it gracefully and then let main() return (uvicorn itself
        raises the signal again once stopped, which would end the process before the model is closed)."""

        @contextlib.contextmanager
        def capture_signals(self):
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def uvicorn_config(svc: Any) -> Any:
    """uvicorn's configuration of the server over ``svc``: the app, and h11's protocol registering the connections
    whose streams the engine thread writes to (module :mod:`.direct`)."""
    import uvicorn

    from .app import make_app
    from .direct import Connections

    conns = Connections()
    return uvicorn.Config(make_app(svc, conns), http=conns.protocol(), log_level="warning",
                          timeout_graceful_shutdown=5, lifespan="on")


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening TCP socket, bound and listening (backlog 2048).  Made with proto ``IPPROTO_TCP``, not
    0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP, and without it a response's header
    and body writes wait on a keep-alive client's delayed ACK (Nagle: ~40 ms a request)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def main(argv: list[str]) -> int:
    from .. import ggml as G
    from .speculative import close_drafter

    a = parse_args(argv)
    G.set_log_level(3)
    try:
        model, ctx, svc = open_service(a)
    except ValueError as e:  # (what the model and the options cannot do together: a cache type, a draft model)
        print(f"python -m kvcache_ggml serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = listen_socket(a.host, a.port)  # connections wait in the backlog from here on, while uvicorn starts
        host, port = sock.getsockname()[:2]
        print(f"[{svc.model_name}: {a.parallel} parallel + {a.parked} parked sequences, n_ctx {ctx.n_ctx()} "
              f"({ctx.n_ctx_seq()} per sequence{', unified' if a.kv_unified else ''}), chat template "
              f"{'yes' if svc.template else 'no'}]", file=sys.stderr)
        print(f"listening on http://{host}:{port}", file=sys.stderr, flush=True)
        _Server = _server_class()
        _Server(uvicorn_config(svc)).run(sockets=[sock])
    finally:
        close_drafter(svc.engine.drafter)
        ctx.close()
        model.close()
    return 0
