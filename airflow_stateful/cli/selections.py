"""Selecting many identities for the fleet verbs (``ls``, ``stuck``, ``du``, ``gc``) by their Airflow ids:
a DAG (``--dag-id``), one task of it (``--task-id``), one run or name (``--run-id`` / ``--name``), one map index.

Why the verbs need more than a prefix: keys hold the run id percent-encoded (``manual__2026-12-02T16:58:04+00:00``
is ``manual__2026-12-02T16%3A58%3A04%2B00%3A00``), so a run id pasted from the Airflow UI into a raw prefix
matched nothing, silently; and a key is ``dag/task/run=RUN/map=N``, so a whole run (``--dag-id --run-id``) is not
one prefix but one per task of the DAG. A :class:`Selection` holds what can be checked before the store is
opened; :meth:`Selection.prefixes` lists the DAG's tasks when a whole run is asked for.

Every prefix built here ends at a segment boundary (``etl/``, ``etl/crunch/``, ``.../run=R/map=``,
``.../map=N/~``), so DAG ``etl`` never selects DAG ``etl2``, run ``r1`` never run ``r10``, ``map=1`` never
``map=10``. A raw prefix still works; one holding a character that no key can hold is refused with the
selector form of what it looks like it meant.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass

from airflow_stateful.core.errors import IdentityError
from airflow_stateful.core.records.identity import NAMED_SCOPE, RUN_SCOPE, Identity
from airflow_stateful.core.stores.base import CommonPrefix, ObjectStore

_PREFIX_CHARS = re.compile(r"[A-Za-z0-9._%=+\-/~]")
"""What a key can hold: identity segments hold letters, digits and ``._%=+-``; ``/`` separates them; the
library's own names below an identity start with ``~``."""
_MAP = "map="


@dataclass(frozen=True)
class Selection:
    """The identities a fleet verb covers: every key under ``prefix``, or, when ``tail`` is set (a run or name
    selected without a task), every key under ``<prefix><task>/<tail>`` for each task folder under ``prefix``.

    :param prefix: a key prefix, or with ``tail`` the DAG's folder (``etl/``).
    :param tail: what follows a task segment for a DAG-wide run or name (``run=R/map=`` or ``run=R/map=N/~``).
    :param shown: how the selection is named in reports (the prefix, or a pattern with ``*`` for any task).
    """

    prefix: str
    tail: str | None = None
    shown: str = ""

    def prefixes(self, store: ObjectStore) -> list[str]:
        """The key prefixes to list: ``prefix`` itself, or one per task folder of the DAG (one delimited
        listing of the DAG's folder), in key order so the verbs' rows stay in key order on every store."""
        if self.tail is None:
            return [self.prefix]
        tasks = {
            entry.prefix
            for entry in store.list_delimited(self.prefix, "/")
            if isinstance(entry, CommonPrefix) and "~" not in entry.prefix
        }
        return [f"{task}{self.tail}" for task in sorted(tasks)]


def add_selection_arguments(p: argparse.ArgumentParser, *, also: str = "") -> None:
    """The positional ``PREFIX`` and the selector options that can stand for it.

    The verb is marked ``identity_required=False, select_many=True``: ``main`` resolves what every verb with
    ``identity_required`` names before it opens the store, and :func:`resolve_selection` does it for these, so a
    bad selection is refused (exit 2) at the same point and with the same error as a bad identity."""
    p.add_argument(
        "prefix",
        nargs="?",
        metavar="PREFIX",
        help=f"only identities whose key starts with this, e.g. etl/ or etl/crunch/ {also}(or select them "
        "with --dag-id, --task-id, --run-id or --name and --map-index, which encode the key for you)",
    )
    group = p.add_argument_group("identity selectors (instead of PREFIX)")
    group.add_argument(
        "--dag-id", metavar="DAG_ID", help="only this DAG's identities, as Airflow shows its id"
    )
    group.add_argument("--task-id", metavar="TASK_ID", help="only this task's (needs --dag-id)")
    group.add_argument(
        "--run-id",
        metavar="RUN_ID",
        help="only this DAG run's, as Airflow shows its id (e.g. 'manual__2026-12-02T16:58:04.561219+00:00'); "
        "with --dag-id alone: every task of that run",
    )
    group.add_argument(
        "--name",
        metavar="NAME",
        help="only the state named NAME with identity= (state that lives across runs), instead of --run-id",
    )
    group.add_argument(
        "--map-index",
        type=int,
        metavar="N",
        help="only this mapped task instance (-1: a task that is not mapped; default: every map index); needs "
        "--run-id or --name",
    )
    p.set_defaults(identity_required=False, select_many=True)


def resolve_selection(args: argparse.Namespace) -> None:
    """Set ``args.selection`` (and ``args.prefix``, for what reads only that) from the selectors or the raw
    prefix, checked; raise :class:`~airflow_stateful.core.errors.IdentityError` (exit 2) naming the bad value."""
    raw = [p for p in (args.prefix, getattr(args, "prefix_option", None)) if p]
    if len(set(raw)) > 1:
        raise IdentityError(f"two different prefixes: {raw[0]!r} and --prefix {raw[1]!r}; give one")
    given = {
        dest: getattr(args, dest)
        for dest in ("dag_id", "task_id", "run_id", "name", "map_index")
        if getattr(args, dest, None) is not None
    }
    if not given:
        prefix = checked_prefix(raw[0]) if raw else ""
        args.selection = Selection(prefix=prefix, shown=prefix)
    elif raw:
        raise IdentityError(
            f"select by a prefix ({raw[0]!r}) or by --dag-id/--task-id/--run-id/--name, not both"
        )
    else:
        args.selection = select(
            dag_id=given.get("dag_id"),
            task_id=given.get("task_id"),
            run_id=given.get("run_id"),
            name=given.get("name"),
            map_index=given.get("map_index"),
        )
    args.prefix = args.selection.shown


def select(
    *,
    dag_id: str | None,
    task_id: str | None = None,
    run_id: str | None = None,
    name: str | None = None,
    map_index: int | None = None,
) -> Selection:
    """The selection the Airflow ids name, each part encoded and checked as :meth:`Identity.for_task` does."""
    if dag_id is None:
        raise IdentityError("the identity selectors need --dag-id (the other selectors narrow a DAG down)")
    if run_id is not None and name is not None:
        raise IdentityError("give at most one of --run-id and --name")
    if map_index is not None and run_id is None and name is None:
        raise IdentityError("--map-index needs --run-id or --name (the map index follows the run in a key)")
    # A probe identity checks and encodes every part given; the placeholders for the others are never used.
    probe = Identity.for_task(
        dag_id=dag_id,
        task_id=task_id if task_id is not None else "x",
        map_index=map_index if map_index is not None else -1,
        run_id=run_id,
        name=name if name is not None or run_id is not None else "x",
    )
    dag, task, scope, _ = probe.key.split("/")
    if run_id is None and name is None:
        prefix = f"{dag}/" if task_id is None else f"{dag}/{task}/"
        return Selection(prefix=prefix, shown=prefix)
    tail = f"{scope}/{_MAP}" if map_index is None else f"{scope}/{_MAP}{map_index}/~"
    if task_id is None:
        return Selection(prefix=f"{dag}/", tail=tail, shown=f"{dag}/*/{tail}")
    prefix = f"{dag}/{task}/{tail}"
    return Selection(prefix=prefix, shown=prefix)


def checked_prefix(prefix: str) -> str:
    """``prefix`` unchanged if a key could start with it; else an error naming what no key holds and, when the
    text reads as ``dag/task/run=RUN/map=N`` (or a start of it), the selectors that say it."""
    bad = sorted({ch for ch in prefix if not _PREFIX_CHARS.fullmatch(ch)})
    identity_part = prefix.split("~", 1)[0]
    if bad:
        problem = f"holds {', '.join(map(repr, bad))}, which no key holds (keys percent-encode it)"
    elif prefix.startswith("/") or "//" in identity_part:
        problem = "has an empty segment (a leading or doubled '/'), which no key has"
    elif "~" in prefix and not (identity_part == "" or identity_part.endswith("/")):
        problem = "has '~' inside a segment, where no key has it"
    else:
        return prefix
    hint = prefix_hint(prefix)
    raise IdentityError(f"prefix {prefix!r} {problem}. {hint}" if hint else f"prefix {prefix!r} {problem}.")


def prefix_hint(prefix: str) -> str | None:
    """The selector options for a prefix written as ``dag/``, ``dag/task/``, ``dag/task/run=RUN/`` or
    ``dag/task/run=RUN/map=N/~`` with the parts not encoded, and the prefix they select; ``None`` when the text
    does not read like that."""
    parts = prefix.split("/~", 1)[0].split("/")
    if parts and parts[-1] == "":
        parts.pop()
    if not 1 <= len(parts) <= 4:
        return None
    words = ["--dag-id", parts[0]]
    ids: dict[str, str | None] = {"dag_id": parts[0], "task_id": None, "run_id": None, "name": None}
    map_index: int | None = None
    if len(parts) > 1:
        words += ["--task-id", parts[1]]
        ids["task_id"] = parts[1]
    if len(parts) > 2:
        kind, _, scope = parts[2].partition("=")
        if kind not in (RUN_SCOPE, NAMED_SCOPE) or not scope:
            return None
        words += ["--run-id" if kind == RUN_SCOPE else "--name", scope]
        ids["run_id" if kind == RUN_SCOPE else "name"] = scope
    if len(parts) > 3:
        if not parts[3].startswith(_MAP):
            return None
        try:
            map_index = int(parts[3][len(_MAP) :])
        except ValueError:
            return None
        words += ["--map-index", str(map_index)]
    try:
        selection = select(map_index=map_index, **ids)
    except IdentityError:
        return None
    return (
        f"To select by Airflow ids, use: {shlex.join(words)} (the selectors encode them for you; that selects "
        f"the prefix {selection.shown})."
    )


def selected_prefixes(args: argparse.Namespace, store: ObjectStore) -> list[str]:
    """The key prefixes a fleet verb lists for ``args``: its resolved :class:`Selection`'s, or, for arguments
    built without ``main`` (a caller's own ``Namespace``), the raw ``prefix`` as given."""
    selection: Selection | None = getattr(args, "selection", None)
    if selection is None:
        return [getattr(args, "prefix", None) or getattr(args, "prefix_option", None) or ""]
    return selection.prefixes(store)
