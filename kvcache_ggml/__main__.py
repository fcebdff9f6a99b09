"""Command line: `python -m kvcache_ggml {info,demo}`."""
from __future__ import annotations

import argparse
import sys


def info(args: argparse.Namespace) -> int:
    """Print the ggml version, backends and devices."""
    from . import _ggml as G
    for line in G.summary_lines():
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcache_ggml", description="llama.cpp's KV cache on ggml")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="ggml version, backends and devices")
    p_demo = sub.add_parser("demo", help="build and run a small ggml graph and check it against numpy")
    p_demo.add_argument("--threads", type=int, default=1, help="CPU backend threads (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info(args)
    from .demo import demo
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
