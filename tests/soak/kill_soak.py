"""kill -9 soak: SIGKILL a writer (and a restore) at random moments; nothing acknowledged is lost, nothing
half-written is ever read, and a killed restore leaves its destination as before or complete.

Each writer round starts ``tests/soak/writer.py write`` (a WriterSession that steals the lease, as an Airflow
retry does, and commits in a loop, fsync-logging every acknowledged commit), kills it with SIGKILL at a
moment drawn from ``--seed`` (anywhere, or aimed at a step of the commit: chunk uploads, the tree or manifest
write, the head compare-and-swap, the ack), and then checks with a fresh reader:

* the latest checkpoint reads and verifies completely: its value is intact (it carries its own digest) and
  every file restored from it has the SHA-256 the value lists (corrupt/partial reads: must be 0);
* it is not older than the last commit in the writer's fsync'd ack log, and every acknowledged commit the
  head still keeps is the very commit that was acknowledged (acknowledged commits lost: must be 0);
* no object a kept checkpoint needs is missing (``tests/maintenance.py:missing_references``).

Each restore round fills a destination with a different complete earlier state (an older checkpoint plus a
file no checkpoint holds), starts ``writer.py restore`` of the latest checkpoint into it in mode ``"exact"``,
SIGKILLs it at a random moment (or just as its last chunk arrived, when it starts putting files in place), calls
``airflow_stateful.core.data.restore.recover_interrupted(dest)`` and checks that the destination is then, byte for
byte, exactly the earlier state (the extra file included) or exactly what an uninterrupted restore makes of it
(exactly the checkpoint's files: the extra file gone), with no staging left.

Usage::

    .venv/bin/python tests/soak/kill_soak.py --store local --kills 300 --restore-kills 100 --seed 1
    .venv/bin/python tests/soak/kill_soak.py --store s3 --kills 200 --restore-kills 50 --seed 2

``--store s3`` runs on the endpoint the test suite would use (tests/s3_endpoint.py): a serialized moto server
on 127.0.0.1 by default (conditional writes atomic, as on S3), SeaweedFS with ``STATEFUL_TEST_S3_ENDPOINT=seaweedfs``
or ``--s3-server seaweedfs``, or a given endpoint; a server it starts is stopped at the end. Prints a summary table; ``--json-out`` writes it as JSON. Exits 1 on any violation (the run
directory is then kept as evidence and its path printed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from maintenance import missing_references  # noqa: E402

from airflow_stateful.core import CheckpointEntry, CheckpointStore, Identity, Manifest  # noqa: E402
from airflow_stateful.core.data import restore as restore_module  # noqa: E402
from airflow_stateful.core.errors import StatefulError  # noqa: E402
from airflow_stateful.core.stores.base import ObjectStore  # noqa: E402
from soak.writer import (  # noqa: E402
    USER_FILE,
    open_store,
    read_phase,
    tree_digests,
    value_problem,
)

WRITER = HERE / "writer.py"
IDENTITY = "soak/writer/run=kill-soak/map=-1"
KEEP_LAST = 3
LEASE_TTL = 5.0
"""Short enough that the heartbeat renews the lease (about every 1.5 s) within a round: kills land there too."""
STAGING_PREFIX = ".stateful-restore-"
S3_SERVERS = ("env", "moto", "seaweedfs")
"""``--s3-server``: ``env`` is the test suite's choice (``STATEFUL_TEST_S3_ENDPOINT``, moto by default)."""
REGION = "us-east-1"

# Where a writer kill is aimed (the phase record the writer shows, and the weight of each aim).
TARGETS: dict[str, tuple[str, int]] = {
    "chunk upload": ("commit:chunk-put in", 3),
    "tree write": ("commit:tree-put in", 2),
    "manifest write": ("commit:manifest-put in", 2),
    "head CAS": ("commit:head-put in", 3),
    "after head CAS": ("commit:head-put done", 2),
    "ack write": ("ack in", 1),
    "lease acquire": ("open:head-put in", 1),
}


def fault_kind(phase: str) -> str:
    """A readable name for where a killed process was, from its phase record (``<label> <in|done>``)."""
    label, _, state = phase.rpartition(" ")
    context, _, call = label.partition(":")
    if not phase or context == "start":
        return "process start"
    calls = {
        "chunk-put": "chunk upload",
        "tree-put": "tree write",
        "manifest-put": "manifest write",
        "head-put": "head CAS",
        "head-get": "head read",
        "tree-get": "tree read",
        "manifest-get": "manifest read",
        "chunk-get": "chunk download",
    }
    what = calls.get(call, call or "")
    if context == "commit":
        if call == "head-put" and state == "done":
            return "commit: after head CAS, before ack"
        if call == "chunk-put" and state == "done":
            return "commit: chunk upload (between requests)"
        if not call:
            return "commit: chunking/hashing"
        return f"commit: {what}" + ("" if state == "in" else " (done)")
    named = {
        "open": "session open / lease acquire",
        "restore-work": "writer restoring its work dir",
        "ready": "writer opened",
        "prepare": "writing the work tree",
        "ack": "ack log write",
        "acked": "after ack",
        "lease": "lease renewal",
        "sweep": "sweep of dropped checkpoints",
        "restore-read": "restore: reading manifest/tree",
        "restore": "restore: downloading chunks",
        "restore-place": "restore: putting files in place",
        "restored": "restore: returned",
    }
    return named.get(context, context)


# -- child processes -------------------------------------------------------------------------------------
class Children:
    """Every child process this driver started; :meth:`kill_all` ends the ones still running (by pid)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], *, env: dict[str, str], stderr: Path) -> subprocess.Popen[bytes]:
        with open(stderr, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=dict(env, KILL_SOAK_PARENT=str(os.getpid())),
            )
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.procs = [p for p in self.procs if p is not proc]

    def kill_all(self) -> None:
        for proc in list(self.procs):
            self.kill(proc)


def wait_for_phase(
    proc: subprocess.Popen[bytes], path: Path, matches: Callable[[str], bool], timeout: float
) -> bool:
    """Poll the child's phase record until ``matches`` it; False if the child exited or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if matches(read_phase(path)):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.0003)
    return False


def opened(phase: str) -> bool:
    """The writer's session is open (it took the lease and restored its work directory)."""
    return phase.split(":")[0].split(" ")[0] not in ("", "start", "open", "restore-work")


# -- the run ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """What one run saw; ``violations`` must be empty."""

    store: str
    seed: int
    kills: int = 0
    commits_acknowledged: int = 0
    reads_checked: int = 0
    reads_empty: int = 0
    corrupt_or_partial_reads: int = 0
    acknowledged_lost: int = 0
    missing_references: int = 0
    unexpected_exits: int = 0
    torn_ack_lines: int = 0
    latest_not_yet_acknowledged: int = 0
    aims_missed: int = 0
    restore_kills: int = 0
    restore_finished_first: int = 0
    restore_recovered: int = 0
    outcome_before: int = 0
    outcome_complete: int = 0
    outcome_mixed: int = 0
    leftover_staging: int = 0
    restore_kills_skipped: str = ""
    faults: Counter[str] = field(default_factory=Counter)
    restore_faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        return {f.name: copy.copy(getattr(self, f.name)) for f in fields(self)} | {"ok": self.ok}


@dataclass
class Estimates:
    """Running estimates of how long things take, so random kill moments cover whole operations."""

    cycle: float = 0.05  # one commit of the writer
    ready: float = 0.5  # spawn -> session open
    restore: float = 0.2  # a restore of the whole tree
    place: float = 0.005  # last chunk in -> restore returned

    @staticmethod
    def blend(old: float, new: float) -> float:
        return 0.7 * old + 0.3 * new


class Soak:
    def __init__(self, *, store: str, seed: int, run_dir: Path, s3: dict[str, Any] | None = None) -> None:
        self.kind = store
        self.rng = random.Random(seed)
        self.run_dir = run_dir
        label = f"s3 ({s3['server']})" if store == "s3" and s3 and s3.get("server") else store
        self.tally = Tally(store=label, seed=seed, run_dir=str(run_dir))
        self.est = Estimates()
        self.children = Children()
        self.identity = Identity.parse(IDENTITY)
        self.ack_log = run_dir / "acks.jsonl"
        self.phase = run_dir / "phase"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        if store == "local":
            self.store_spec: dict[str, Any] = {"kind": "local", "root": str(run_dir / "state")}
        else:
            assert s3 is not None
            self.store_spec = {"kind": "s3", **{k: v for k, v in s3.items() if k != "credentials"}}
            self.credentials: dict[str, str] = s3["credentials"]
            self.env.update(
                AWS_ACCESS_KEY_ID=self.credentials["aws_access_key_id"],
                AWS_SECRET_ACCESS_KEY=self.credentials["aws_secret_access_key"],
                AWS_DEFAULT_REGION=spec_region(s3),
            )
        (run_dir / "work").mkdir(parents=True, exist_ok=True)

    # -- helpers -----------------------------------------------------------------------------------------
    def open_store(self) -> ObjectStore:
        """A fresh store client (a reader shares nothing with any writer)."""
        if self.kind == "local":
            return open_store(self.store_spec)
        from airflow_stateful.core.stores.s3 import S3ObjectStore

        spec = self.store_spec
        return S3ObjectStore(
            bucket=spec["bucket"],
            prefix=spec["prefix"],
            endpoint_url=spec["endpoint_url"],
            region_name=spec["region"],
            **self.credentials,
        )

    def spawn(self, mode: str, spec: dict[str, Any], name: str) -> subprocess.Popen[bytes]:
        self.phase.unlink(missing_ok=True)
        full = {"store": self.store_spec, "identity": IDENTITY, "phase": str(self.phase), **spec}
        return self.children.start(
            [str(WRITER), mode, "--spec", json.dumps(full)], env=self.env, stderr=self.run_dir / f"{name}.err"
        )

    def violation(self, text: str) -> None:
        self.tally.violations.append(text)
        print(f"VIOLATION: {text}", file=sys.stderr, flush=True)

    def read_acks(self, *, repair: bool = True) -> list[dict[str, Any]]:
        """The acknowledged commits: every complete line of the ack log. A torn last line (the writer died
        inside the write, before its fsync returned: not acknowledged) is cut off with ``repair`` (only once
        the writer is dead), so the next writer's lines start clean."""
        if not self.ack_log.exists():
            return []
        raw = self.ack_log.read_bytes()
        complete, _, torn = raw.rpartition(b"\n")
        if torn and repair:
            self.tally.torn_ack_lines += 1
            with open(self.ack_log, "r+b") as f:
                f.truncate(len(complete) + (1 if complete else 0))
                os.fsync(f.fileno())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    # -- writer rounds -----------------------------------------------------------------------------------
    def writer_round(self, n: int) -> None:
        rng = self.rng
        spec = {
            "round": n,
            "seed": rng.getrandbits(32),
            "work_root": str(self.run_dir / "work"),
            "ack_log": str(self.ack_log),
            "keep_last": KEEP_LAST,
            "lease_ttl": LEASE_TTL,
        }
        aim = rng.choices(["anytime", "long", "startup", "aimed"], weights=[30, 8, 7, 55])[0]
        target = rng.choices(list(TARGETS), weights=[w for _, w in TARGETS.values()])[0]
        jitter = rng.choice([0.0, rng.uniform(0, 0.002)])
        started = time.monotonic()
        acks_before = len(self.read_acks())
        if acks_before == 0 and aim == "startup":
            aim = "anytime"  # the identity's first checkpoint goes in before the first kill
        proc = self.spawn("write", spec, "writer")
        how = aim
        ready_at = None
        if aim == "startup":
            time.sleep(rng.uniform(0, self.est.ready * 1.2))
        elif aim == "aimed" and target == "lease acquire":
            how = f"aimed at {target}"
            if not wait_for_phase(proc, self.phase, lambda p: p == TARGETS[target][0], timeout=60):
                self.tally.aims_missed += 1
                how += " (missed)"
        else:
            if wait_for_phase(proc, self.phase, opened, timeout=120):
                ready_at = time.monotonic()
                self.est.ready = self.est.blend(self.est.ready, ready_at - started)
            if acks_before == 0:  # the identity's first checkpoint goes in before the first kill
                deadline = time.monotonic() + 120
                while (
                    not self.read_acks(repair=False) and proc.poll() is None and time.monotonic() < deadline
                ):
                    time.sleep(0.005)
            if aim == "anytime":
                time.sleep(rng.uniform(0, 4 * self.est.cycle))
            elif aim == "long":
                time.sleep(rng.uniform(0, max(2.5, 4 * self.est.cycle)))  # lease renewals, sweeps
            else:
                time.sleep(rng.uniform(0, 3 * self.est.cycle))  # a few commits first, sometimes
                label = TARGETS[target][0]
                how = f"aimed at {target}"
                if not wait_for_phase(proc, self.phase, lambda p: p == label, timeout=30):
                    self.tally.aims_missed += 1
                    how += " (missed)"
                if jitter:
                    time.sleep(jitter)
        exited = proc.poll()
        self.children.kill(proc)
        phase = read_phase(self.phase)
        shutil.rmtree(self.run_dir / "work", ignore_errors=True)  # the dead writer's work tree
        (self.run_dir / "work").mkdir()
        self.tally.kills += 1
        self.tally.faults[fault_kind(phase)] += 1
        where = f"writer round {n} (seed {self.tally.seed}, {how}, killed at {phase!r})"
        if exited is not None:
            self.tally.unexpected_exits += 1
            err = (self.run_dir / "writer.err").read_text(errors="replace")[-2000:]
            self.violation(f"{where}: the writer exited by itself with code {exited}: {err}")
        acks = self.read_acks()
        mine = [a for a in acks[acks_before:] if a["pid"] == proc.pid]
        if ready_at is not None:
            # Wall-clock ack times against the monotonic clock: shift by the offset between the two now.
            ran = time.monotonic() - ready_at
            since = ran if not mine else mine[-1]["time"] - (time.time() - ran)
            # Nothing acknowledged yet: a commit takes at least as long as this round ran.
            cycle = since / len(mine) if mine else 1.5 * ran
            self.est.cycle = self.est.blend(self.est.cycle, min(cycle, 10.0))
        checked = time.monotonic()
        self.check_store(where, acks)
        if os.environ.get("KILL_SOAK_VERBOSE"):
            print(
                f"round {n}: {how}, {len(mine)} acks, killed at {phase!r} after {checked - started:.2f} s, "
                f"check {time.monotonic() - checked:.2f} s, est {self.est}",
                flush=True,
            )

    def check_store(self, where: str, acks: list[dict[str, Any]]) -> None:
        """A fresh reader: the latest checkpoint is whole and verified, no acknowledged commit is lost, no
        reference is missing."""
        tally = self.tally
        corrupt: list[str] = []
        lost: list[str] = []
        for a, b in itertools.pairwise(acks):
            if b["seq"] <= a["seq"] or b["counter"] != b["seq"]:
                corrupt.append(f"ack log out of order or off count: {a} then {b}")
        with self.open_store() as store:
            checkpoints = CheckpointStore(store=store, identity=self.identity)
            last = acks[-1] if acks else None
            try:
                head = checkpoints.head()
                latest = checkpoints.latest()
            except StatefulError as exc:
                corrupt.append(f"the latest checkpoint cannot be read: {type(exc).__name__}: {exc}")
                head, latest = None, None
            if latest is not None:
                tally.reads_checked += 1
            elif head is None or not head.checkpoints:
                tally.reads_empty += 1
            if latest is None:
                if last is not None and not corrupt:
                    lost.append(f"no checkpoint, but seq {last['seq']} was acknowledged")
            else:
                corrupt += self.verify(checkpoints, latest)
                if last is not None:
                    kept = {e.seq: e for e in (head.checkpoints if head else ())}
                    lost += self.acks_kept(acks, latest, kept)
                    if latest.seq == last["seq"]:
                        corrupt += self.matches_ack(latest, last)
                    else:
                        tally.latest_not_yet_acknowledged += 1
                        corrupt += self.unacknowledged(checkpoints, last, kept)
            missing = missing_references(store, self.identity)
        if missing:
            tally.missing_references += 1
            self.violation(f"{where}: objects missing for kept checkpoints: {missing[:5]}")
        if corrupt:
            tally.corrupt_or_partial_reads += 1
            self.violation(f"{where}: corrupt or partial read: {'; '.join(corrupt)}")
        if lost:
            tally.acknowledged_lost += 1
            self.violation(f"{where}: acknowledged commit lost: {'; '.join(lost)}")

    @staticmethod
    def acks_kept(
        acks: list[dict[str, Any]], latest: Manifest, kept: dict[int, CheckpointEntry]
    ) -> list[str]:
        """Acknowledged commits lost: the latest is older than the last one, or a seq the head keeps (or
        should keep, being newer than the oldest kept) is not the commit acknowledged for it."""
        last = acks[-1]
        lost = []
        if latest.seq < last["seq"]:
            lost.append(f"latest is seq {latest.seq}, older than acknowledged seq {last['seq']}")
        for ack in acks:
            entry = kept.get(ack["seq"])
            if entry is None and kept and ack["seq"] > min(kept):
                lost.append(f"acknowledged seq {ack['seq']} is missing between kept {sorted(kept)}")
            elif entry is not None and entry.commit_id != ack["commit_id"]:
                lost.append(
                    f"acknowledged seq {ack['seq']} was commit {ack['commit_id']}, the head keeps commit "
                    f"{entry.commit_id} there"
                )
        return lost

    def unacknowledged(
        self, checkpoints: CheckpointStore, last: dict[str, Any], kept: dict[int, CheckpointEntry]
    ) -> list[str]:
        """The latest is newer than the last acknowledged commit: each writer killed since then may have left
        one commit that landed but was never acknowledged (killed after the head CAS, before its ack), and no
        more than one. Those, and the last acknowledged one if still kept, must read back whole."""
        problems = []
        by_writer: Counter[int | None] = Counter()
        for seq in sorted(kept):
            if seq < last["seq"]:
                continue
            try:
                manifest = checkpoints.get(seq)
            except StatefulError as exc:
                problems.append(f"kept seq {seq} cannot be read: {type(exc).__name__}: {exc}")
                continue
            if seq == last["seq"]:
                problems += self.verify(checkpoints, manifest) + self.matches_ack(manifest, last)
                continue
            by_writer[manifest.writer.pid] += 1
            problem = value_problem(manifest.value)
            if problem:
                problems.append(f"seq {seq}: {problem}")
        twice = [pid for pid, count in by_writer.items() if count > 1]
        if twice:
            problems.append(
                f"writer pid(s) {twice} left more than one unacknowledged commit: {dict(by_writer)}"
            )
        return problems

    @staticmethod
    def matches_ack(manifest: Manifest, ack: dict[str, Any]) -> list[str]:
        value = manifest.value
        if manifest.commit_id != ack["commit_id"]:
            return [f"seq {manifest.seq} is commit {manifest.commit_id}, acknowledged was {ack['commit_id']}"]
        if value.get("digest") != ack["value_digest"] or value.get("files_digest") != ack["files_digest"]:
            return [f"seq {manifest.seq} holds another value or file list than the one acknowledged"]
        return []

    def verify(self, checkpoints: CheckpointStore, manifest: Manifest) -> list[str]:
        """Every byte of the checkpoint, against the digests its own value lists."""
        started = time.monotonic()
        problem = value_problem(manifest.value)
        if problem:
            return [f"seq {manifest.seq}: {problem}"]
        value = manifest.value
        if value["counter"] != manifest.seq:
            return [f"seq {manifest.seq} holds the value of commit {value['counter']}"]
        scratch = Path(tempfile.mkdtemp(prefix="read-", dir=self.run_dir))
        try:
            try:
                checkpoints.restore_files(manifest, scratch)
            except StatefulError as exc:
                return [f"seq {manifest.seq}: restore failed: {type(exc).__name__}: {exc}"]
            got = tree_digests(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.est.restore = self.est.blend(self.est.restore, time.monotonic() - started)
        if got != value["files"]:
            differ = sorted(k for k in set(got) | set(value["files"]) if got.get(k) != value["files"].get(k))
            return [f"seq {manifest.seq}: restored files differ from its value's list: {differ[:6]}"]
        return []

    # -- restore rounds ----------------------------------------------------------------------------------
    def restore_round(self, n: int) -> None:
        rng = self.rng
        tally = self.tally
        recover = getattr(restore_module, "recover_interrupted", None)
        began = time.monotonic()
        violations = len(tally.violations)
        dest = self.run_dir / f"restore-{n}"
        expected = self.run_dir / "restore-expected"
        for path in (dest, expected):
            shutil.rmtree(path, ignore_errors=True)
        with self.open_store() as store:
            checkpoints = CheckpointStore(store=store, identity=self.identity)
            latest = checkpoints.latest()
            assert latest is not None
            earlier = self.earlier_state(checkpoints, latest, dest)
            before = tree_digests(dest)
            shutil.copytree(dest, expected)
            checkpoints.restore_files(latest, expected, mode="exact")  # what an uninterrupted restore makes
            complete = tree_digests(expected)
            shutil.rmtree(expected)
        # Complete (exact): every file of the checkpoint as its value lists it, and no other path.
        files = latest.value["files"]
        wrong = [k for k, v in files.items() if complete.get(k) != v]
        wrong += [k for k in complete if k not in files]
        if USER_FILE not in before:
            self.violation(f"restore round {n}: the earlier state lacks {USER_FILE} (soak set-up bug)")
        if wrong:
            self.violation(
                f"restore round {n}: an uninterrupted restore of seq {latest.seq} got {wrong} wrong"
            )
        if before == complete:
            self.violation(f"restore round {n}: the earlier state equals the restored one (soak set-up bug)")
        aim = rng.choices(["anytime", "placing", "startup"], weights=[45, 45, 10])[0]
        proc = self.spawn("restore", {"seq": latest.seq, "dest": str(dest)}, "restore")
        if aim == "startup":
            time.sleep(rng.uniform(0, self.est.ready))
        elif aim == "anytime":
            if wait_for_phase(proc, self.phase, lambda p: p.startswith("restore"), timeout=60):
                time.sleep(rng.uniform(0, self.est.restore * 1.3))
        elif wait_for_phase(proc, self.phase, lambda p: p.startswith(("restore-place", "restored")), 120):
            # Just as the last chunk arrived: the journal, the moves, the clean-up. The window learns how long
            # that takes: a restore that got through it says how long; one killed inside it widens it a bit.
            placed_at = time.monotonic()
            delay = rng.choice([0.0, rng.uniform(0, self.est.place * 1.5)])
            if wait_for_phase(proc, self.phase, lambda p: p.startswith("restored"), delay):
                self.est.place = self.est.blend(self.est.place, time.monotonic() - placed_at)
            elif delay:
                self.est.place = self.est.blend(self.est.place, self.est.place * 1.3)
        finished = proc.poll() == 0
        self.children.kill(proc)
        phase = read_phase(self.phase)
        tally.restore_kills += 1
        tally.restore_finished_first += finished
        tally.restore_faults[fault_kind(phase)] += 1
        where = (
            f"restore round {n} (seed {tally.seed}, {aim}, {earlier} -> seq {latest.seq}, killed at "
            f"{phase!r}{', had finished' if finished else ''})"
        )
        if proc.returncode not in (0, -signal.SIGKILL):
            err = (self.run_dir / "restore.err").read_text(errors="replace")[-2000:]
            self.violation(f"{where}: the restore exited with code {proc.returncode}: {err}")
        if recover is None:
            raise RuntimeError("airflow_stateful.core.data.restore.recover_interrupted does not exist")
        recovered = recover(dest)
        tally.restore_recovered += bool(recovered)
        leftovers = sorted(p.name for p in dest.iterdir() if p.name.startswith(STAGING_PREFIX))
        after = tree_digests(dest)
        if leftovers:
            tally.leftover_staging += 1
            self.violation(f"{where}: staging left in the destination after recovery: {leftovers}")
        if after == complete:
            tally.outcome_complete += 1
        elif after == before:
            tally.outcome_before += 1
            if finished:
                self.violation(
                    f"{where}: a restore that had finished was rolled back (recovered={recovered})"
                )
        else:
            tally.outcome_mixed += 1
            paths = sorted(set(after) | set(before) | set(complete))
            as_before = [k for k in paths if after.get(k) == before.get(k) != complete.get(k)]
            as_complete = [k for k in paths if after.get(k) == complete.get(k) != before.get(k)]
            neither = [k for k in paths if after.get(k) not in (before.get(k), complete.get(k))]
            self.violation(
                f"{where}: the destination is neither as before nor complete (recovered={recovered}): "
                f"as before {as_before}, as complete {as_complete}, neither {neither}"
            )
        if os.environ.get("KILL_SOAK_VERBOSE"):
            print(
                f"{where}: recovered={recovered}, {time.monotonic() - began:.2f} s, est {self.est}",
                flush=True,
            )
        if recover(dest) or tree_digests(dest) != after:
            self.violation(f"{where}: a second recover_interrupted() changed the destination again")
        if len(tally.violations) == violations:
            shutil.rmtree(dest, ignore_errors=True)  # else kept as evidence, with the run directory

    def earlier_state(self, checkpoints: CheckpointStore, latest: Manifest, dest: Path) -> str:
        """Fill ``dest`` with a complete earlier state that differs from ``latest``'s files: an older kept
        checkpoint with other files if there is one (else the latest with one file changed and one gone),
        plus a file no checkpoint holds. Returns what the state is."""
        head = checkpoints.head()
        for entry in reversed(head.checkpoints if head else ()):
            if entry.seq == latest.seq:
                continue
            older = checkpoints.get(entry.seq)
            if older.value.get("files_digest") != latest.value["files_digest"]:
                checkpoints.restore_files(older, dest)
                (dest / USER_FILE).write_text("written by the user, in no checkpoint\n")
                return f"seq {older.seq}"
        checkpoints.restore_files(latest, dest)
        (dest / "meta/step.txt").write_bytes(b"an earlier state\n")
        (dest / "meta/config.json").unlink()
        (dest / USER_FILE).write_text("written by the user, in no checkpoint\n")
        return f"seq {latest.seq} altered"

    def ensure_history(self, rounds: int) -> int:
        """Writer rounds until the identity keeps two checkpoints (a restore round needs an earlier state)."""
        while True:
            with self.open_store() as store:
                head = CheckpointStore(store=store, identity=self.identity).head()
            if head is not None and len(head.checkpoints) >= 2:
                return rounds
            self.writer_round(rounds)
            rounds += 1


def spec_region(s3: dict[str, Any]) -> str:
    return str(s3.get("region") or REGION)


@contextlib.contextmanager
def s3_server(server: str = "env") -> Iterator[dict[str, Any]]:
    """The S3 endpoint to soak, with a fresh bucket (tests/s3_endpoint.py): ``moto`` (serialized) or
    ``seaweedfs`` started here and stopped on the way out, or ``env``: what the test suite would use."""
    from s3_endpoint import s3_endpoint_from_env, started_endpoint

    if server not in S3_SERVERS:
        raise ValueError(f"--s3-server must be one of {', '.join(S3_SERVERS)}, not {server!r}")
    with s3_endpoint_from_env() if server == "env" else started_endpoint(server) as endpoint:
        if not endpoint.credentials:
            raise RuntimeError(
                "the soak needs the endpoint's credentials (STATEFUL_TEST_S3_ACCESS_KEY_ID/...)"
            )
        yield {
            "bucket": endpoint.bucket,
            "prefix": f"soak-{uuid.uuid4().hex[:8]}",
            "endpoint_url": endpoint.endpoint_url,
            "region": endpoint.region,
            "credentials": endpoint.credentials,
            "server": endpoint.kind,
        }


def run(
    *,
    store: str,
    kills: int,
    restore_kills: int,
    seed: int,
    keep: bool = False,
    base: Path | None = None,
    s3_server_kind: str = "env",
) -> Tally:
    """One soak on one store; every child process and the S3 server are stopped on the way out.

    :param base: where the run directory goes (the local store, work trees, restore destinations); default:
        the system's temp dir.
    """
    run_dir = Path(tempfile.mkdtemp(prefix=f"stateful-kill-soak-{store}-", dir=base))
    started = time.monotonic()
    soak: Soak | None = None
    try:
        with contextlib.ExitStack() as stack:
            s3 = stack.enter_context(s3_server(s3_server_kind)) if store == "s3" else None
            soak = Soak(store=store, seed=seed, run_dir=run_dir, s3=s3)
            stack.callback(soak.children.kill_all)
            for n in range(kills):
                soak.writer_round(n)
            if restore_kills:
                if getattr(restore_module, "recover_interrupted", None) is None:
                    soak.tally.restore_kills_skipped = "recover_interrupted() does not exist yet"
                else:
                    soak.ensure_history(kills)
                    for n in range(restore_kills):
                        soak.restore_round(n)
            soak.tally.commits_acknowledged = len(soak.read_acks())
    finally:
        if soak is not None:
            soak.tally.seconds = round(time.monotonic() - started, 1)
        if soak is not None and soak.tally.ok and not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    assert soak is not None
    return soak.tally


def summary(tallies: list[Tally]) -> str:
    rows = [
        ("store", "store"),
        ("seed", "seed"),
        ("writer kills", "kills"),
        ("commits acknowledged", "commits_acknowledged"),
        ("reads checked", "reads_checked"),
        ("reads before 1st commit", "reads_empty"),
        ("corrupt/partial reads", "corrupt_or_partial_reads"),
        ("acknowledged lost", "acknowledged_lost"),
        ("missing references", "missing_references"),
        ("unexpected writer exits", "unexpected_exits"),
        ("latest not yet acked", "latest_not_yet_acknowledged"),
        ("torn ack lines", "torn_ack_lines"),
        ("aims missed", "aims_missed"),
        ("restore kills", "restore_kills"),
        ("  finished before kill", "restore_finished_first"),
        ("  recover found a staging dir", "restore_recovered"),
        ("  outcome: before", "outcome_before"),
        ("  outcome: complete", "outcome_complete"),
        ("  outcome: mixed", "outcome_mixed"),
        ("  leftover staging", "leftover_staging"),
        ("seconds", "seconds"),
        ("violations", None),
    ]
    width = 44
    lines = ["kill -9 soak".ljust(width) + "".join(str(t.store).rjust(12) for t in tallies)]
    for title, attr in rows[1:]:
        cells = [len(t.violations) if attr is None else getattr(t, attr) for t in tallies]
        lines.append(title.ljust(width) + "".join(str(c).rjust(12) for c in cells))
    for title, attr in (("writer killed during", "faults"), ("restore killed during", "restore_faults")):
        kinds = sorted({k for t in tallies for k in getattr(t, attr)})
        if kinds:
            lines.append(title)
            for kind in kinds:
                lines.append(
                    f"  {kind}"[:width].ljust(width)
                    + "".join(str(getattr(t, attr)[kind]).rjust(12) for t in tallies)
                )
    for t in tallies:
        if t.restore_kills_skipped:
            lines.append(f"{t.store}: restore kills skipped: {t.restore_kills_skipped}")
        if t.violations:
            lines.append(f"{t.store}: {len(t.violations)} violation(s); evidence kept in {t.run_dir}")
            lines += [f"  - {v[:600]}" for v in t.violations[:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("local", "s3", "both"), default="local")
    parser.add_argument("--kills", type=int, default=20, help="writer kills (per store)")
    parser.add_argument(
        "--s3-kills", type=int, help="writer kills on S3 with --store both (default: --kills)"
    )
    parser.add_argument("--restore-kills", type=int, default=0, help="restore kills (per store)")
    parser.add_argument("--s3-restore-kills", type=int, help="restore kills on S3 with --store both")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-out", type=Path, help="write the summary as JSON here")
    parser.add_argument(
        "--dir", type=Path, help="put the run directory here (e.g. /dev/shm for tmpfs); default: temp dir"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directory even without violations")
    parser.add_argument(
        "--s3-server",
        choices=S3_SERVERS,
        default="env",
        help="the S3 endpoint: env (the test suite's STATEFUL_TEST_S3_ENDPOINT settings, moto by default), "
        "moto or seaweedfs (started here)",
    )
    args = parser.parse_args(argv)
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # run the clean-up (children, the server) on SIGTERM
    # The library warns about every interrupted restore it undoes: expected here, hundreds of times.
    logging.getLogger("airflow_stateful").setLevel(logging.ERROR)
    stores = ["local", "s3"] if args.store == "both" else [args.store]
    tallies = []
    for i, store in enumerate(stores):
        kills, restores = args.kills, args.restore_kills
        if store == "s3" and args.store == "both":
            kills = args.kills if args.s3_kills is None else args.s3_kills
            restores = args.restore_kills if args.s3_restore_kills is None else args.s3_restore_kills
        tally = run(
            store=store,
            kills=kills,
            restore_kills=restores,
            seed=args.seed + i,
            keep=args.keep,
            base=args.dir,
            s3_server_kind=args.s3_server,
        )
        tallies.append(tally)
        print(summary([tally]), flush=True)
    if len(tallies) > 1:
        print(summary(tallies), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps([t.to_json() for t in tallies], indent=2) + "\n")
    return 0 if all(t.ok for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
