"""Command line: ``python -m kvcache_ggml COMMAND [args...]``.

Each command lives in its own module as ``main(argv) -> int`` (imported only when the command runs); ``--help``
after a command shows its own options.
"""
from __future__ import annotations

import sys
from importlib import import_module

# command -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "info": ("kvcache_ggml.__main__", "info", "ggml version, backends and devices"),
    "demo": ("kvcache_ggml.demo", "main", "the main job: a tiny model decoding several sequences on the cache"),
    "generate": ("kvcache_ggml.generate", "main", "text in, text out: continue a prompt with a GGUF model"),
    "serve": ("kvcache_ggml.serve.cli", "main", "an OpenAI-compatible HTTP server (completions, chat, streaming)"),
    "inspect": ("kvcache_ggml.cache.state.cli", "main_inspect", "print a state file's streams, cells and layers"),
    "make-model": ("kvcache_ggml.runtime.modelmaker", "main", "write a tiny random-weight llama GGUF"),
    "rpc-server": ("kvcache_ggml.backends", "main_rpc_server", "serve a ggml RPC backend"),
    "parity": ("kvcache_ggml.parity", "main", "replay one trace on every backend and compare with the CPU"),
    "runtime-parity": ("kvcache_ggml.parity.runtime_check", "main_parity",
                       "the runtime on a backend against the CPU: logits and greedy tokens"),
    "step-times": ("kvcache_ggml.parity.runtime_check", "main_step_times",
                   "host time per decode step beside the backend's compute time"),
}


def info(argv: list[str]) -> int:
    """Print the ggml version, backends and devices."""
    from . import ggml as G
    for line in G.summary_lines():
        print(line)
    return 0


def usage() -> str:
    lines = ["usage: python -m kvcache_ggml COMMAND [args...]", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[cmd]
    try:
        fn = getattr(import_module(module), func)
    except (ImportError, AttributeError) as e:
        print(f"command {cmd!r} is not available in this build: {e}", file=sys.stderr)
        return 2
    return int(fn(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
