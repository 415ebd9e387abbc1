"""``make demo-kill``: a task SIGKILLed on a real scheduler resumes from its last checkpoint on retry.

Run from a clone (it needs ``dags/killable_batch.py``)::

    python -m airflow_stateful.testing.kill_demo [--kill-at-item 37] [--item-seconds 0.1] [--home DIR]

It makes a temporary AIRFLOW_HOME (kept for inspection; its path is printed) with a SQLite database and the
embedded default state directory (``file://$AIRFLOW_HOME/stateful``), starts api-server, scheduler
(LocalExecutor) and dag-processor on 127.0.0.1, triggers ``killable_batch`` with ``kill_at_item``: try 1 SIGKILLs
its own process at that item, as an OOM kill or a lost node would. It then prints what happened: the try that
died and how we know (the pid, the supervisor's log line, the try's state), the retry starting at the last
checkpoint, the ledger of items per try, the result. Every process it started is stopped at the end.

``airflow dags test`` cannot show this: the task runs inside the test command, so the SIGKILL kills the command
(see docs/stateful-tasks.md).

Exit codes: 0 the story held; 1 it did not (what differed is printed); 2 the stack failed (a component died,
a timeout, a process left after the stop; the tails of the logs are printed); 130 Ctrl-C, 143 SIGTERM (the
stack is stopped either way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from airflow_stateful.testing.local_stack import (
    Stack,
    StackError,
    base_env,
    start_stack,
    stop_stack,
    unpause_when_parsed,
    wait_for,
)
from airflow_stateful.testing.s3_server import free_port

DAG_ID = "killable_batch"
TASK_ID = "crunch"
ITEMS = 100  # as in dags/killable_batch.py
CHECKPOINT_EVERY = 10  # as in dags/killable_batch.py
LEDGER = "killable_batch.ledger"  # the DAG's defaults, in AIRFLOW_HOME
PIDFILE = "killable_batch.pid"
REPO_DAG = Path(__file__).resolve().parents[2] / "dags" / f"{DAG_ID}.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m airflow_stateful.testing.kill_demo",
        description="SIGKILL a stateful task on a real scheduler (LocalExecutor) and watch its retry resume.",
    )
    parser.add_argument(
        "--kill-at-item", type=int, default=37, help="try 1 SIGKILLs itself here (default 37)"
    )
    parser.add_argument("--item-seconds", type=float, default=0.1, help="time per item (default 0.1)")
    parser.add_argument(
        "--home", type=Path, help="AIRFLOW_HOME to use (created; default: a new temporary one)"
    )
    parser.add_argument("--dag-file", type=Path, default=REPO_DAG, help=f"the DAG (default {REPO_DAG})")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds to wait for the run (default 300)"
    )
    args = parser.parse_args(argv)
    if not CHECKPOINT_EVERY <= args.kill_at_item < ITEMS:
        parser.error(
            f"--kill-at-item must be in {CHECKPOINT_EVERY}..{ITEMS - 1} (after the first checkpoint)"
        )
    if not args.dag_file.is_file():
        parser.error(f"{args.dag_file} not found: run from a clone of the repository, or pass --dag-file")
    if args.home is not None and args.home.exists() and any(args.home.iterdir()):
        parser.error(f"--home {args.home} is not empty: the demo reads the ledger it leaves there")
    home = args.home or Path(tempfile.mkdtemp(prefix="stateful-kill-demo-"))
    demo = Demo(home=home.resolve(), kill_at=args.kill_at_item, item_seconds=args.item_seconds)
    try:
        with _sigterm_as_exit():
            return demo.run(args.dag_file, timeout=args.timeout)
    except KeyboardInterrupt:  # the stack was stopped on the way out
        return 130


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (a CI timeout, ``kill``) unwinds like Ctrl-C does, so the stack is stopped on the way out."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Demo:
    home: Path
    kill_at: int
    item_seconds: float
    t0: float = field(default_factory=time.monotonic)
    # What the watch saw: the scheduler, try 1's task process and its parents, and when it was gone.
    scheduler_pid: int | None = None
    task_pid: int | None = None
    task_parents: list[int] = field(default_factory=list)
    task_gone_at: float | None = None

    # -- output ----------------------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] {message}", flush=True)

    # -- the run ---------------------------------------------------------------------------------------------
    def run(self, dag_file: Path, *, timeout: float) -> int:
        dags, logs = self.home / "dags", self.home / "component-logs"
        for d in (dags, logs):
            d.mkdir(parents=True, exist_ok=True)
        shutil.copy(dag_file, dags)
        port = free_port()
        env = base_env(self.home, dags, port)
        # No backend_url: the state goes to the embedded default, file://$AIRFLOW_HOME/stateful. Every checkpoint
        # of the run stays listed (the default keeps 3), so the history shows try 1's beside try 2's. The restore
        # cache is kept in the home too (its default is shared by every run on the machine).
        env["AIRFLOW__STATEFUL__KEEP_LAST"] = "20"
        env["AIRFLOW__STATEFUL__RESTORE_CACHE_DIR"] = str(self.home / "restore-cache")
        stack = Stack(home=self.home, env=env, port=port, logs=logs, diagnostic_files=(LEDGER, PIDFILE))
        print(f"AIRFLOW_HOME={self.home}")
        print(f"  SQLite metadata DB, state in {self.home / 'stateful'}, component logs in {logs}")
        code = 2
        try:
            self.say("migrating the database, starting api-server, scheduler (LocalExecutor), dag-processor")
            start_stack(stack, triggerer=False)
            self.scheduler_pid = next(c.process.pid for c in stack.components if c.name == "scheduler")
            story = self.watch(stack, timeout=timeout)
            code = self.tell(story)
        except StackError as exc:
            print(f"kill-demo: the stack failed: {exc}", file=sys.stderr)
        finally:
            self.say("stopping every process of the stack")
            try:
                stop_stack(stack)
                self.say("stopped: no process of the stack is left")
            except StackError as exc:
                print(f"kill-demo: {exc}", file=sys.stderr)
                code = max(code, 2)
            print(f"(the AIRFLOW_HOME {self.home} is kept for inspection: rm -rf {self.home})")
        return code

    def watch(self, stack: Stack, *, timeout: float) -> Story:
        wait_for(
            "the api-server to answer", lambda: stack.request("GET", "/version"), timeout=120, stack=stack
        )
        self.say(f"api-server up on http://127.0.0.1:{stack.port}; waiting for the dag-processor")
        unpause_when_parsed(stack, DAG_ID)
        conf = {"kill_at_item": self.kill_at, "item_seconds": self.item_seconds}
        run = stack.request("POST", f"/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
        run_id = str(run["dag_run_id"])
        self.say(f"triggered {DAG_ID} run {run_id} with {json.dumps(conf)}")
        self.say(
            f"try 1 will SIGKILL its own process at item {self.kill_at} (as an OOM kill or a lost node would); "
            f"a checkpoint every {CHECKPOINT_EVERY} items; retries=2, retry_delay=0"
        )
        run_path = f"/dags/{DAG_ID}/dagRuns/{run_id}"
        checkpoints = self.checkpoints(run_id)
        seen: dict[str, Any] = {"ti": None, "seq": None}

        def progress() -> str | None:
            ti = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}")
            ti_now = (ti["try_number"], ti["state"])
            if ti_now != seen["ti"]:
                seen["ti"] = ti_now
                self.say(f"task {TASK_ID}: try {ti_now[0]}, {ti_now[1] or 'not scheduled yet'}")
            self.watch_task_process(stack)
            latest = checkpoints.latest()
            if latest is not None and latest.seq != seen["seq"]:
                seen["seq"] = latest.seq
                cursor = self.cursor(latest)
                self.say(
                    f"checkpoint {latest.seq} committed by try {latest.writer.try_number} at item {cursor}"
                )
            state = stack.request("GET", run_path)["state"]
            return str(state) if state in ("success", "failed") else None

        final = wait_for("the run to finish", progress, timeout=timeout, stack=stack, interval=0.5)
        self.say(f"run {run_id}: {final}")
        return self.collect(stack, run_id, final, checkpoints)

    def checkpoints(self, run_id: str) -> Any:
        from airflow_stateful.core import CheckpointStore, Identity, store_from_url

        identity = Identity.for_task(dag_id=DAG_ID, task_id=TASK_ID, run_id=run_id)
        store = store_from_url((self.home / "stateful").as_uri())
        return CheckpointStore(store=store, identity=identity, signer=None)  # the demo signs nothing

    @staticmethod
    def cursor(manifest: Any) -> int | None:
        from airflow_stateful.core.records.cursors import cursor_position

        return cursor_position(manifest, "items")

    def watch_task_process(self, stack: Stack) -> None:
        """Find try 1's task process (the pid it wrote) while it runs, and notice the moment it is gone."""
        stack.remember_descendants()
        if self.task_pid is None:
            pid = dict(ledger_rows(self.home / PIDFILE)).get(1)
            if pid is None:
                return
            self.task_pid = pid
            with contextlib.suppress(psutil.Error):
                self.task_parents = [p.pid for p in psutil.Process(pid).parents()]
            self.say(f"try 1 runs in process {pid}")
        if self.task_gone_at is None and not _alive(self.task_pid):
            self.task_gone_at = time.monotonic()
            rows = [item for n, item in ledger_rows(self.home / LEDGER) if n == 1]
            self.say(
                f"process {self.task_pid} is gone; try 1's last item in the ledger: {rows[-1] if rows else '-'}"
            )

    def collect(self, stack: Stack, run_id: str, final: str, checkpoints: Any) -> Story:
        run_path = f"/dags/{DAG_ID}/dagRuns/{run_id}"
        ti = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}")
        tries = {}
        for n in range(1, int(ti["try_number"]) + 1):
            with contextlib.suppress(Exception):
                tries[n] = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}/tries/{n}")["state"]
        result = None
        with contextlib.suppress(Exception):
            value = stack.request("GET", f"{run_path}/taskInstances/{TASK_ID}/xcomEntries/return_value")[
                "value"
            ]
            result = json.loads(value) if isinstance(value, str) else value
        kept = [checkpoints.get(entry.seq) for entry in reversed(checkpoints.history())]  # oldest first
        return Story(
            run_id=run_id,
            run_state=final,
            ti_state=ti["state"],
            ti_try=int(ti["try_number"]),
            try_states=tries,
            ledger=ledger_rows(self.home / LEDGER),
            kill_log=kill_records(log_records(task_log(self.home, run_id, 1))),
            resume_log=resume_records(log_records(task_log(self.home, run_id, 2))),
            result=result,
            checkpoints=[(m.seq, m.writer.try_number, self.cursor(m)) for m in kept],
            identity=checkpoints.identity.key,
        )

    # -- the story -------------------------------------------------------------------------------------------
    def tell(self, story: Story) -> int:
        by_try: dict[int, list[int]] = {}
        for try_number, item in story.ledger:
            by_try.setdefault(try_number, []).append(item)
        resume_at = (self.kill_at // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
        expected_total = sum(i * i for i in range(ITEMS))
        first, second = by_try.get(1, []), by_try.get(2, [])
        pid = self.task_pid
        last_of_try_1 = next(((seq, cur) for seq, n, cur in reversed(story.checkpoints) if n == 1), None)
        final = story.checkpoints[-1] if story.checkpoints else None
        checks = [
            (f"try 1 handled items 0..{self.kill_at - 1}", first == list(range(self.kill_at)), _span(first)),
            (
                "try 1 ran under the scheduler (LocalExecutor), not in this process",
                self.scheduler_pid is not None and self.scheduler_pid in self.task_parents,
                f"process {pid}, parents {self.task_parents}, scheduler {self.scheduler_pid}",
            ),
            (
                f"try 1's process {pid} died of SIGKILL at item {self.kill_at} (its supervisor logged signal -9)",
                pid is not None
                and self.task_gone_at is not None
                and any(r.get("signal") == -9 for r in story.kill_log),
                "; ".join(map(_log_line, story.kill_log)) or "no SIGKILL line in try 1's task log",
            ),
            (
                "Airflow counted try 1 as failed",
                story.try_states.get(1) == "failed",
                f"tries: {story.try_states}",
            ),
            (
                f"try 1's last checkpoint was at item {resume_at}",
                last_of_try_1 is not None and last_of_try_1[1] == resume_at,
                f"checkpoints (seq, try, item): {story.checkpoints}",
            ),
            (
                f"try 2 resumed at item {resume_at} and handled it to the end",
                second == list(range(resume_at, ITEMS)),
                _span(second),
            ),
            (
                "the run and the task succeeded on try 2",
                (story.run_state, story.ti_state, story.ti_try) == ("success", "success", 2),
                f"run {story.run_state}, task {story.ti_state} on try {story.ti_try}",
            ),
            (
                f"the result counts every item once: total {expected_total}, in the final checkpoint too",
                story.result == {"total": expected_total} and final is not None and final[1:] == (2, ITEMS),
                f"result {story.result}, final checkpoint (seq, try, item) {final}",
            ),
        ]
        print()
        print(f"What happened to {DAG_ID}.{TASK_ID} in run {story.run_id}:")
        if pid is not None:
            under = "under" if self.scheduler_pid in self.task_parents else "NOT under"
            print(
                f"  try 1 ran in process {pid} ({under} the scheduler {self.scheduler_pid}) and handled items "
                f"{_span(first)}"
            )
        for record in story.kill_log:
            print(f"  try 1's task log: {_log_line(record)}")
        print(f"  try states (REST API, tries/N): {story.try_states}")
        for n in sorted({n for _, n, _ in story.checkpoints}):
            mine = [f"{seq} at item {cur}" for seq, by, cur in story.checkpoints if by == n]
            print(f"  checkpoints of try {n}: " + ", ".join(mine))
        for record in story.resume_log:
            print(f"  try 2's task log: {_log_line(record)}")
        print(
            f"  try 2 resumed at item {second[0]} and handled {_span(second)}" if second else "  no try 2 ran"
        )
        redone = sorted(set(first) & set(second))
        if redone:
            print(
                f"  items {_span(redone)} ran twice (after the last checkpoint, before the kill); the result counts"
                " them once: try 2 started from the checkpoint's state"
            )
        print(f"  run {story.run_state}; task {story.ti_state} on try {story.ti_try}; result {story.result}")
        print(
            f"  ledger {self.home / LEDGER}: "
            + ", ".join(f"try {t}: {_span(i)}" for t, i in sorted(by_try.items()))
        )
        print(
            f"  every checkpoint: AIRFLOW_HOME={self.home} {_cli()} history --backend "
            f"{(self.home / 'stateful').as_uri()} --dag-id {DAG_ID} --task-id {TASK_ID} "
            f"--run-id {shlex.quote(story.run_id)}"
        )
        print()
        failed = [(what, detail) for what, ok, detail in checks if not ok]
        for what, ok, detail in checks:
            print(f"  {'ok' if ok else 'NOT'}: {what}" + ("" if ok else f" ({detail})"))
        if failed:
            print(f"kill-demo: the story did NOT hold ({len(failed)} of {len(checks)} checks failed)")
            return 1
        print(
            f"kill-demo: the story held: SIGKILL at item {self.kill_at}, resumed at {resume_at}, run succeeded"
        )
        return 0


@dataclass
class Story:
    run_id: str
    run_state: str
    ti_state: str
    ti_try: int
    try_states: dict[int, str]
    ledger: list[tuple[int, int]]
    kill_log: list[dict[str, Any]]
    resume_log: list[dict[str, Any]]
    result: Any
    checkpoints: list[tuple[int, int, int | None]]  # seq, try, cursor; oldest first
    identity: str


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cli() -> str:
    """The ``airflow-stateful`` command beside this Python (a clone's .venv is rarely on PATH), else the name."""
    beside = Path(sys.executable).parent / "airflow-stateful"
    return str(beside) if beside.is_file() else "airflow-stateful"


def _span(items: list[int]) -> str:
    if not items:
        return "none"
    if items == list(range(items[0], items[-1] + 1)):
        return f"{items[0]}..{items[-1]} ({len(items)} items)"
    return f"{len(items)} items, not in order: {items[:5]}..."


def ledger_rows(path: Path) -> list[tuple[int, int]]:
    """``a,b`` rows of the DAG's ledger or pid file (a last, partly written row is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            a, b = line.split(",")
            rows.append((int(a), int(b)))
    return rows


def task_log(home: Path, run_id: str, try_number: int) -> Path | None:
    found = sorted((home / "logs").rglob(f"attempt={try_number}.log"))
    return next((p for p in found if f"run_id={run_id}" in str(p) and f"task_id={TASK_ID}" in str(p)), None)


def log_records(path: Path | None) -> list[dict[str, Any]]:
    """The records of a task log (JSON lines, one per record)."""
    if path is None:
        return []
    records = []
    for raw in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(raw)
            if isinstance(record, dict):
                records.append(record)
    return records


def kill_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What tells of the SIGKILL: the task's own warning, its supervisor's "Process terminated by signal"."""
    return [
        r
        for r in records
        if r.get("signal_name") == "SIGKILL" or "SIGKILL to my own process" in str(r.get("event"))
    ]


def resume_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What tells of the resume: the library's lease, checkpoint and skip lines before the first item."""
    starts = ("took the lease", "resuming from checkpoint", "skipping ")
    return [
        r for r in records if r.get("logger") == "airflow_stateful" and str(r.get("event")).startswith(starts)
    ]


def _log_line(record: dict[str, Any]) -> str:
    event = str(record.get("event", "")).split(" For more information")[0]
    signal_part = f" (signal {record['signal']}, {record.get('signal_name')})" if "signal" in record else ""
    return f"{record.get('level', '?')}: {event}{signal_part}"


if __name__ == "__main__":
    sys.exit(main())
