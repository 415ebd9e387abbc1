"""The ``airflow-stateful`` parser: every verb, option, help text and default, and the function that runs each.

Apart from the commands (the layout of cncf.kubernetes' ``cli/definition.py``) so that the whole command line
can be read in one place, and so that parsing it (``--help``, a usage error) imports no command module: each
verb names its function by path (:func:`lazy_command`), imported when that verb runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from airflow_stateful.cli.exit_codes import EXIT_USAGE
from airflow_stateful.cli.output import hms
from airflow_stateful.cli.selections import add_selection_arguments
from airflow_stateful.cli.selectors import add_identity_arguments
from airflow_stateful.core.data.restore_modes import EMPTY, MODES
from airflow_stateful.core.durations import parse_duration
from airflow_stateful.core.fleet.status import STATUSES
from airflow_stateful.core.fleet.usage import DEFAULT_PRICE_PER_GB_MONTH
from airflow_stateful.core.settings import EXPECTED_CHECKPOINT_INTERVAL, KEEP_FAILED_FOR
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.version import __version__

Command = Callable[[argparse.Namespace, ObjectStore], int]
"""A verb: the parsed arguments and the open store in, the exit code out."""

# What ``airflow-stateful --help`` says: the contract every verb shares (exit codes, where the backend comes from).
DESCRIPTION = """airflow-stateful: inspect, verify, roll back, unlock and clean checkpointed state.

Name an identity by its key (etl/crunch/run=manual__1/map=-1) or by its Airflow ids: --dag-id, --task-id,
--run-id (or --name for state that lives across runs) and --map-index, which encode the key for you. ls, stuck,
du and gc select many the same way: --dag-id alone (a DAG), with --task-id (a task), with --run-id (a run, every
task of it), or take a raw key prefix.

Exit codes scripts can rely on: 0 success; 1 a problem was found (verify saw corruption, ls/du a head they
could not read, outputs --get a download that does not match its recorded SHA-256); 2 bad usage or
configuration (a mistyped option, identity or connection; missing or refused credentials; a store that does
not exist or cannot be reached: a missing file:// directory or S3 bucket, an endpoint that does not answer or
does not speak S3), or a restore (cat --files, outputs --get)
refused because its destination is not empty (the default --mode empty; choose --mode exact or --mode merge);
3 refused because of a lease (a live writer holds the identity; --force overrides); 4 no such identity,
checkpoint or output.

stuck is made for cron and monitoring: 0 nothing is stuck; 1 at least one identity is stuck (alive, renewing
its lease, but committing nothing for longer than its expected checkpoint interval); 2 the check could not be
made or is incomplete (bad usage or configuration, the store could not be listed, a head could not be read) and
nothing was found stuck. Dead identities (lease expired: the writer is gone) are never stuck: they are named on
stderr but do not change the exit code.

check tries the configuration before a task does (store, conditional writes, signing, Airflow API): 0
every check passed, 2 one failed.

Output: stdout carries only the command's result (a table, or JSON with --json); progress, warnings and logs,
Airflow's included, go to stderr. Tables show sizes for people (2.2 KiB); --bytes shows exact byte counts, and
JSON always has them.

The backend is --backend URL, else AIRFLOW__STATEFUL__BACKEND_URL, else [stateful] backend_url of the Airflow
installation. S3 credentials and endpoint come from the Airflow connection (--conn-id, else [stateful] conn_id)
or, without one, boto3's standard chain; --endpoint-url (or STATEFUL_S3_ENDPOINT_URL) overrides the endpoint.
Commands that only read the store start without importing Airflow when everything they need is in the
environment or airflow.cfg (see docs/ui-and-metrics.md); otherwise they read it through Airflow.
"""


def lazy_command(path: str) -> Command:
    """The function at ``path`` (``package.module.function``), imported only when it is called, like
    cncf.kubernetes' ``lazy_load_command``: building the parser imports no command module."""
    module, name = path.rsplit(".", 1)

    def command(args: argparse.Namespace, store: ObjectStore) -> int:
        func: Command = getattr(importlib.import_module(module), name)
        return func(args, store)

    command.__name__ = command.__qualname__ = name
    return command


def _duration(text: str) -> timedelta:
    """argparse type for ``--min-age`` / ``--idle-for``: ``30m``, ``12h``, ``30d``, seconds."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interval(text: str) -> timedelta:
    """argparse type for ``--default-interval``: a duration of at least a second."""
    interval = _duration(text)
    if interval < timedelta(seconds=1):
        raise argparse.ArgumentTypeError(f"must be at least 1 second, not {text!r}")
    return interval


def _statuses(text: str) -> list[str]:
    """argparse type for ``--status``: one status or a comma list (the option may also be repeated)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in STATUSES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(STATUSES)} (several: a comma list or --status again)"
        )
    return names


def _add_default_interval(p: argparse.ArgumentParser) -> None:
    default = hms(EXPECTED_CHECKPOINT_INTERVAL.total_seconds())
    p.add_argument(
        "--default-interval",
        type=_interval,
        metavar="DURATION",
        help="how long a live lease may go without a commit before it is stuck, for leases that record no "
        "expected_checkpoint_interval of their own (default: [stateful] expected_checkpoint_interval, "
        f"{default} unless configured)",
    )


def _add_lifetimes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--release-after-success",
        type=_duration,
        metavar="DURATION",
        help="delete per-run state this long after its task succeeded (default: [stateful] "
        "release_after_success, unset: by --idle-for)",
    )
    p.add_argument(
        "--keep-failed-for",
        type=_duration,
        metavar="DURATION",
        help="keep per-run state of a task that failed for good at least this long, so a cleared task resumes "
        f"(default: [stateful] keep_failed_for, {hms(KEEP_FAILED_FOR.total_seconds())}; 0: no minimum)",
    )


def _add_restore_mode(p: argparse.ArgumentParser, dest: str) -> None:
    p.add_argument(
        "--mode",
        choices=MODES,
        default=EMPTY,
        help=f"what the restore does with what {dest} already holds: empty (default: refuse unless {dest} is "
        f"missing or empty, so your files are never deleted unasked), exact ({dest} ends holding exactly the "
        "checkpoint's files: the others are removed), merge (replace same-named files, keep the others)",
    )
    p.add_argument(
        "--shared-dest",
        action="store_true",
        help=f"restore even if {dest} is another user's or others may write it (refused by default: they could "
        "have planted links or a fake interrupted restore there)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb; a parsed command line holds ``func`` (the verb's :data:`Command`) and, for a
    verb whose exit 1 is a finding (``stuck``), ``error_exit``: the code its failures take instead."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--backend", help="s3://bucket/prefix or file:///path (default: [stateful] backend_url)"
    )
    common.add_argument("--endpoint-url", help="S3-compatible endpoint (default: STATEFUL_S3_ENDPOINT_URL)")
    common.add_argument(
        "--conn-id", help="Airflow connection with S3 credentials (default: [stateful] conn_id)"
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.set_defaults(out=None)  # where a verb prints its result: main() sets it; None is sys.stdout
    common.add_argument(
        "--bytes",
        action="store_true",
        dest="exact_sizes",
        help="show sizes in tables as exact byte counts (default: 2.2 KiB, 1.4 GiB; JSON always has bytes)",
    )
    parser = argparse.ArgumentParser(
        prog="airflow-stateful", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"airflow-stateful {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser(
        "ls", parents=[common], help="list identities with their status (active, stuck, dead, idle)"
    )
    add_selection_arguments(p)
    p.add_argument(
        "--status",
        type=_statuses,
        action="extend",
        metavar="STATUS",
        help=f"only identities with this status: {', '.join(STATUSES)}; a comma list or repeated for several",
    )
    _add_default_interval(p)
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.fleet.cmd_ls"))
    p = sub.add_parser(
        "stuck",
        parents=[common],
        help="list stuck identities (live lease, no commit for too long); exit 0 none, 1 some, 2 error",
        description="List identities whose writer is alive (its lease is renewed) but has committed nothing "
        "for longer than its expected checkpoint interval. Dead identities (lease expired) are not stuck: "
        "they are named on stderr and do not change the exit code. Exit codes: 0 nothing stuck; 1 at least "
        "one identity stuck; 2 the check could not be made or is incomplete (bad usage or configuration, the "
        "store could not be listed, a head could not be read) and nothing was found stuck.",
    )
    add_selection_arguments(p, also="(or --prefix) ")
    p.add_argument(
        "--prefix", dest="prefix_option", metavar="PREFIX", help="the same as the positional prefix"
    )
    _add_default_interval(p)
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.fleet.cmd_stuck"), error_exit=EXIT_USAGE)
    p = sub.add_parser(
        "outputs",
        parents=[common],
        help="list the outputs committed with a checkpoint, or download one (--get NAME --to DIR)",
    )
    add_identity_arguments(p)
    p.add_argument("--seq", type=int, metavar="SEQ", help="a kept checkpoint (default: the newest)")
    p.add_argument(
        "--get", metavar="NAME", help="download this output (verified) to DIR/NAME; print the path"
    )
    p.add_argument("--to", type=Path, metavar="DIR", help="where --get puts the output")
    _add_restore_mode(p, "DIR/NAME")
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.inspect.cmd_outputs"))
    for name, fn, text in (
        (
            "show",
            lazy_command("airflow_stateful.cli.commands.inspect.cmd_show"),
            "an identity's head and latest checkpoint",
        ),
        ("history", lazy_command("airflow_stateful.cli.commands.inspect.cmd_history"), "kept checkpoints"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        add_identity_arguments(p)
        p.set_defaults(func=fn)
    p = sub.add_parser(
        "cat",
        parents=[common],
        help="print a checkpoint's value (and restore its files)",
        description="Print a checkpoint's value as JSON; with --files DEST also restore its files into DEST "
        '(verified, all or nothing). With --json and --files the JSON is {"value": ..., "restore": '
        "{files, removed, mode, ...}}.",
    )
    add_identity_arguments(p)
    p.add_argument("--seq", type=int, metavar="SEQ", help="print this kept checkpoint (default: the newest)")
    p.add_argument(
        "--files",
        type=Path,
        metavar="DEST",
        help="also restore the checkpoint's files into DEST (each verified; all or nothing)",
    )
    _add_restore_mode(p, "DEST")
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.inspect.cmd_cat"))
    p = sub.add_parser(
        "rollback", parents=[common], help="commit a copy of an older checkpoint as the newest"
    )
    add_identity_arguments(p)
    p.add_argument(
        "--to",
        type=int,
        required=True,
        metavar="SEQ",
        help="the kept checkpoint to commit again as the newest",
    )
    p.add_argument("--force", action="store_true", help="take the lease from a live writer (fencing it)")
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.maintain.cmd_rollback"))
    p = sub.add_parser("unlock", parents=[common], help="break an identity's lease (fences its holder)")
    add_identity_arguments(p)
    p.add_argument("--force", action="store_true", help="break a lease that has not expired")
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.maintain.cmd_unlock"))
    p = sub.add_parser("verify", parents=[common], help="re-check every checksum (report, never repair)")
    add_identity_arguments(p, required=False)
    p.add_argument("--all", action="store_true", help="verify every identity in the store (instead of one)")
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.maintain.cmd_verify"))
    p = sub.add_parser(
        "gc", parents=[common], help="apply retention and delete idle, orphaned and crash-left objects"
    )
    add_selection_arguments(p)
    p.add_argument(
        "--min-age", type=_duration, default=timedelta(hours=1), help="leave younger objects (default 1h)"
    )
    p.add_argument(
        "--idle-for", type=_duration, metavar="DURATION", help="delete identities not updated for this long"
    )
    p.add_argument("--keep-last", type=int, metavar="N", help="keep at most N checkpoints per identity")
    _add_lifetimes(p)
    p.add_argument(
        "--airflow",
        choices=("auto", "db", "no"),
        default="auto",
        help="ask Airflow's metadata database whether a run is finished before deleting its state: auto (if this "
        "installation's database can be read), db (it must be), no (the heads' recorded outcomes decide)",
    )
    p.add_argument(
        "--airflow-conn-id",
        metavar="CONN_ID",
        help="ask Airflow's REST API instead, through this connection (type http: the API server URL, a user)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list every identity and why it is kept or deleted; change nothing",
    )
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.maintain.cmd_gc"))
    p = sub.add_parser(
        "du", parents=[common], help="bytes, checkpoints, idle age and monthly cost per identity"
    )
    add_selection_arguments(p)
    p.add_argument(
        "--price-per-gb-month",
        type=float,
        default=DEFAULT_PRICE_PER_GB_MONTH,
        help=f"storage price in USD (default {DEFAULT_PRICE_PER_GB_MONTH}, S3 Standard)",
    )
    p.add_argument(
        "--idle-for",
        type=_duration,
        metavar="DURATION",
        help="judge the lifetime column as `gc --idle-for` would (default: no age limit)",
    )
    p.add_argument(
        "--packs",
        action="store_true",
        help="also read each identity's kept trees for its dead pack bytes: bytes in kept packs that no kept "
        "checkpoint needs, which GC cannot free yet (one read per kept tree)",
    )
    _add_lifetimes(p)
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.fleet.cmd_du"))
    p = sub.add_parser(
        "check",
        parents=[common],
        help="try the configuration as a worker reads it: probe the store, its conditional writes, signing, API",
        description="Read [stateful] and the connections as a worker does, then write, read back, list and "
        "delete a probe object under ~check/ in the store, check that it refuses PutObject with If-None-Match: * "
        "on an existing key and with a stale If-Match ETag (an endpoint that ignores them makes fencing unsafe), "
        "check the head signing connection and, when [stateful] airflow_conn_id is set, Airflow's REST API. One "
        "line per check: ok, FAIL (with what to fix, naming the setting), warn or skip. Exit codes: 0 nothing "
        "failed; 2 a check failed (configuration, credentials, reachability, conditional writes).",
    )
    p.set_defaults(func=lazy_command("airflow_stateful.cli.commands.check.cmd_check"), opens_store=True)
    return parser
