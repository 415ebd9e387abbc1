"""``airflow-stateful``'s entry point: parse the command line, run the verb, turn a failure into an exit code.

The parser and its help (the exit codes included) are :mod:`airflow_stateful.cli.definition`, the verbs
:mod:`airflow_stateful.cli.commands`. What stays here is the one place an exception becomes an exit code, so
every verb fails the same way and a script can tell a finding from a broken check, and the one place stdout is
kept for results (:func:`run`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from airflow_stateful.cli.definition import Command, build_parser
from airflow_stateful.cli.exit_codes import EXIT_LEASE, EXIT_NOT_FOUND, EXIT_PROBLEM, EXIT_USAGE
from airflow_stateful.cli.opening import open_store
from airflow_stateful.cli.selectors import resolve_identity
from airflow_stateful.core.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    FencedError,
    LeaseHeldError,
    StatefulError,
    StoreUnavailableError,
)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run one verb on ``argv`` (default: ``sys.argv[1:]``) and return its exit code; argparse exits 2 itself on
    bad usage. The verb writes its result to ``out`` (default: ``sys.stdout``) and nothing else does. The store
    is opened here, not by the verbs, so each is closed whatever the verb does."""
    out = out or sys.stdout
    parser = build_parser()
    with contextlib.redirect_stdout(out):  # --help and --version are results too
        args = parser.parse_args(argv)
    args.out = out
    func: Command = args.func
    # A command whose exit 1 means a finding (``stuck``) turns every failure into this code instead, so a
    # monitor never takes a broken check for a finding.
    error_exit: int | None = getattr(args, "error_exit", None)
    try:
        if hasattr(args, "identity_required"):
            resolve_identity(args)  # a bad identity is refused before anything is opened
        if getattr(args, "opens_store", False):
            return int(args.func(args, None))  # `check` opens the store itself, reporting each step
        store = open_store(args)
        try:
            return func(args, store)
        finally:
            store.close()
    except CheckpointNotFoundError as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (LeaseHeldError, FencedError) as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_LEASE
    except (ConfigurationError, StoreUnavailableError, ValueError) as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except StatefulError as exc:
        print(f"airflow-stateful: {exc}", file=sys.stderr)
        return EXIT_PROBLEM if error_exit is None else error_exit
    except Exception as exc:
        if error_exit is None:
            raise
        print(f"airflow-stateful: {type(exc).__name__}: {exc}", file=sys.stderr)
        return error_exit


def run() -> None:
    """The ``airflow-stateful`` console script: :func:`main` with stdout kept for its result.

    File descriptor 1 is pointed at stderr for the whole process and the result goes to a copy of the original
    stdout, so that whatever else writes to stdout (Airflow's logging, configured to print there when it is
    imported; a library's warning) lands on stderr and ``--json`` output always parses.
    """
    try:
        sys.stdout.flush()
        result_fd = os.dup(sys.stdout.fileno())
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real file descriptors (embedded): nothing to separate
        sys.exit(main())
    with os.fdopen(result_fd, "w", encoding=sys.stdout.encoding or "utf-8", errors="replace") as results:
        try:
            code = main(out=results)
            results.flush()
        except BrokenPipeError:  # `airflow-stateful ls | head`: the reader has what it wanted
            code = 0
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), result_fd)
    sys.exit(code)
