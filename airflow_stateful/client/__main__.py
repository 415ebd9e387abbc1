"""``python -m airflow_stateful.client restore DIR | save DIR | run --dir DIR --every 5m -- CMD ARGS...``."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from airflow_stateful.client.pod import EXIT_CONFIG, EXIT_FENCED, restore, run, save
from airflow_stateful.client.settings import PodSettings
from airflow_stateful.core.errors import FencedError, StatefulError

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


def parse_duration(text: str) -> float:
    """``"90"``, ``"30s"``, ``"5m"``, ``"1h"`` -> seconds."""
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (use e.g. 30s, 5m, 1h)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m airflow_stateful.client", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("restore", help="restore the latest checkpoint into DIR").add_argument("dir", type=Path)
    sub.add_parser("save", help="commit DIR as a checkpoint").add_argument("dir", type=Path)
    run_p = sub.add_parser("run", help="restore, run a command, save periodically and on exit")
    run_p.add_argument("--dir", type=Path, required=True)
    run_p.add_argument("--every", type=parse_duration, default=parse_duration("5m"))
    run_p.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        settings = PodSettings.from_env()
        if args.verb == "restore":
            restore(settings, args.dir)
            return 0
        if args.verb == "save":
            save(settings, args.dir)
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            print("run needs a command after --", file=sys.stderr)
            return EXIT_CONFIG
        return run(settings, args.dir, command, every=args.every)
    except FencedError as exc:
        logging.getLogger("airflow_stateful.client").error("FENCED: %s", exc)
        return EXIT_FENCED
    except StatefulError as exc:
        logging.getLogger("airflow_stateful.client").error("%s", exc)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
