"""``python -m airflow_stateful.client restore DIR | save DIR | run --dir DIR --every 5m -- CMD ARGS... |
sidecar --dir DIR --every 5m``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from airflow_stateful.client.pod import EXIT_CONFIG, EXIT_FENCED, pod_session, restore, run, save, sidecar
from airflow_stateful.client.settings import PodSettings
from airflow_stateful.core.data.restore_modes import EXACT, MODES
from airflow_stateful.core.durations import positive_duration
from airflow_stateful.core.errors import FencedError, StatefulError


def seconds(text: str) -> float:
    """``"90"``, ``"30s"``, ``"5m"``, ``"1h"`` -> seconds (argparse type)."""
    try:
        return positive_duration(text, what="--every").total_seconds()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=EXACT,
        help="what the restore does with what DIR already holds: exact (default: DIR ends holding exactly the "
        "checkpoint's files, the others removed), merge (replace same-named files, keep the others), empty "
        "(refuse unless DIR is missing or empty)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m airflow_stateful.client", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    restore_p = sub.add_parser("restore", help="restore the latest checkpoint into DIR")
    restore_p.add_argument("dir", type=Path)
    _add_mode(restore_p)
    sub.add_parser("save", help="commit DIR as a checkpoint").add_argument("dir", type=Path)
    run_p = sub.add_parser("run", help="restore, run a command, save periodically and on exit")
    run_p.add_argument("--dir", type=Path, required=True)
    run_p.add_argument("--every", type=seconds, default=seconds("5m"))
    _add_mode(run_p)
    run_p.add_argument("command", nargs=argparse.REMAINDER)
    side = sub.add_parser("sidecar", help="renew the lease and save DIR periodically and on SIGTERM")
    side.add_argument("--dir", type=Path, required=True)
    side.add_argument("--every", type=seconds, default=seconds("5m"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        settings = PodSettings.from_env()
        if args.verb in ("restore", "save"):
            with pod_session(settings, heartbeat=False) as session:
                if args.verb == "restore":
                    restore(session, args.dir, mode=args.mode)
                else:
                    save(session, args.dir)
            return 0
        if args.verb == "sidecar":
            return sidecar(settings, args.dir, every=args.every)
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            print("run needs a command after --", file=sys.stderr)
            return EXIT_CONFIG
        return run(settings, args.dir, command, every=args.every, mode=args.mode)
    except FencedError as exc:
        logging.getLogger("airflow_stateful.client").error("FENCED: %s", exc)
        return EXIT_FENCED
    except StatefulError as exc:
        logging.getLogger("airflow_stateful.client").error("%s", exc)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
