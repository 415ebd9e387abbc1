"""Naming an identity the way Airflow names a task: ``--dag-id``, ``--run-id``, ``--task-id``, ``--map-index``,
``--name``, encoded into the key for the user.

An identity key percent-encodes what a key segment cannot hold (``manual__2026-12-02T16:58:04+00:00`` becomes
``manual__2026-12-02T16%3A58%3A04%2B00%3A00``), so people who copy a run id from the Airflow UI should never have
to encode it by hand. The raw key still works; a key that is not valid gets an error that shows the selector
form of what it looks like it meant.
"""

from __future__ import annotations

import argparse
import shlex

from airflow_stateful.cli.selections import resolve_selection
from airflow_stateful.core.errors import IdentityError
from airflow_stateful.core.records.identity import Identity

SELECTORS = ("dag_id", "run_id", "task_id", "map_index", "name")
"""The ``argparse`` destinations of the selector options."""


def add_identity_arguments(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The positional ``IDENTITY`` key and the selector options that can stand for it."""
    p.add_argument(
        "identity",
        nargs="?",
        metavar="IDENTITY",
        help="the identity's key, e.g. etl/crunch/run=manual__1/map=-1 (or name it with --dag-id, --task-id and "
        "--run-id or --name, which encode it for you)",
    )
    group = p.add_argument_group("identity selectors (instead of IDENTITY)")
    group.add_argument("--dag-id", metavar="DAG_ID", help="the DAG id, as Airflow shows it")
    group.add_argument("--task-id", metavar="TASK_ID", help="the task id, as Airflow shows it")
    group.add_argument(
        "--run-id",
        metavar="RUN_ID",
        help="the DAG run id, as Airflow shows it (e.g. 'manual__2026-12-02T16:58:04.561219+00:00'): state that "
        "belongs to one run",
    )
    group.add_argument(
        "--name",
        metavar="NAME",
        help="the name a task gives its state with identity= (state that lives across runs), instead of --run-id",
    )
    group.add_argument(
        "--map-index",
        type=int,
        metavar="N",
        help="the mapped task instance's index (default: -1, a task that is not mapped)",
    )
    p.set_defaults(identity_required=required)


def resolve_identity(args: argparse.Namespace) -> None:
    """Set ``args.identity`` to the key the selectors or the positional argument name, checked; raise
    :class:`~airflow_stateful.core.errors.IdentityError` (exit 2) naming the bad value, before anything is opened.
    A verb whose identity is optional (``verify``) takes ``--all`` instead: exactly one of the two. A fleet verb
    (``select_many``: ``ls``, ``stuck``, ``du``, ``gc``) names many identities instead:
    :func:`~airflow_stateful.cli.selections.resolve_selection`."""
    if getattr(args, "select_many", False):
        resolve_selection(args)
        return
    given = {dest: getattr(args, dest) for dest in SELECTORS if getattr(args, dest, None) is not None}
    named = bool(given) or args.identity is not None
    if not args.identity_required and getattr(args, "all", False) == named:
        raise IdentityError("name one identity (IDENTITY or the selectors) or pass --all, not both")
    if not named:
        if args.identity_required:
            raise IdentityError(
                "name the identity: its key (IDENTITY) or --dag-id, --task-id and --run-id (or --name)"
            )
        return
    if not given:
        args.identity = _checked_key(args.identity)
        return
    if args.identity is not None:
        raise IdentityError(
            f"give the identity as a key ({args.identity!r}) or with --dag-id/--task-id/--run-id/--name, not both"
        )
    missing = [f"--{dest.replace('_', '-')}" for dest in ("dag_id", "task_id") if dest not in given]
    if ("run_id" in given) == ("name" in given):
        missing.append("exactly one of --run-id and --name")
    if missing:
        raise IdentityError(f"the identity selectors need {' and '.join(missing)}")
    args.identity = Identity.for_task(
        dag_id=given["dag_id"],
        task_id=given["task_id"],
        map_index=given.get("map_index", -1),
        run_id=given.get("run_id"),
        name=given.get("name"),
    ).key


def _checked_key(key: str) -> str:
    try:
        return Identity.parse(key).key
    except IdentityError as exc:
        hint = selector_hint(key)
        raise IdentityError(f"{exc} {hint}" if hint else str(exc)) from None


def selector_hint(key: str) -> str | None:
    """For a key written as ``dag/task/run=RUN/map=N`` (or ``name=NAME``) with the parts not encoded, the
    selector options that name it and the key they encode to; ``None`` when the text does not look like that."""
    parts = key.split("/")
    if len(parts) != 4 or not parts[3].startswith("map="):
        return None
    kind, _, scope = parts[2].partition("=")
    if kind not in ("run", "name") or not scope:
        return None
    try:
        map_index = int(parts[3][4:])
        identity = Identity.for_task(
            dag_id=parts[0],
            task_id=parts[1],
            map_index=map_index,
            **({"run_id": scope} if kind == "run" else {"name": scope}),
        )
    except (ValueError, IdentityError):
        return None
    words = ["--dag-id", parts[0], "--task-id", parts[1], "--run-id" if kind == "run" else "--name", scope]
    if map_index != -1:
        words += ["--map-index", str(map_index)]
    return (
        f"To name it by its Airflow ids, use: {shlex.join(words)} (the selectors encode it for you; its key is "
        f"{identity.key})."
    )
