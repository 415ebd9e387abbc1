"""``airflow-stateful``'s entry point: parse the command line, run the verb, turn a failure into an exit code.

The parser and its help (the exit codes included) are :mod:`airflow_stateful.cli.definition`, the verbs
:mod:`airflow_stateful.cli.commands`. What stays here is the one place an exception becomes an exit code, so
every verb fails the same way and a script can tell a finding from a broken check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from airflow_stateful.cli.common import open_store
from airflow_stateful.cli.definition import Command, build_parser
from airflow_stateful.cli.exit_codes import EXIT_LEASE, EXIT_NOT_FOUND, EXIT_PROBLEM, EXIT_USAGE
from airflow_stateful.core.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    FencedError,
    LeaseHeldError,
    StatefulError,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb on ``argv`` (default: ``sys.argv[1:]``) and return its exit code; argparse exits 2 itself on
    bad usage. The store is opened here, not by the verbs, so each is closed whatever the verb does."""
    args = build_parser().parse_args(argv)
    func: Command = args.func
    # A command whose exit 1 means a finding (``stuck``) turns every failure into this code instead, so a
    # monitor never takes a broken check for a finding.
    error_exit: int | None = getattr(args, "error_exit", None)
    try:
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
    except (ConfigurationError, ValueError) as exc:
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
