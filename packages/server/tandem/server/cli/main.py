"""Entry point of the ``tandem`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.core import TandemError
from tandem.server.cli import bench, doctor, generate, make_demo_model, quantize, serve


def build_parser() -> argparse.ArgumentParser:
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving engine")
    parser.add_argument("--log-level", default="INFO", choices=levels)
    # Also accepted after the subcommand, where users tend to put it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default=argparse.SUPPRESS, choices=levels)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, generate, make_demo_model, quantize, bench, doctor):
        module.add_parser(sub, [common])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.func(args)
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
