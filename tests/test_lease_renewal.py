"""Writer sessions on both stores: a lease that lives as long as the work, and maintenance that never fences it.

Every test runs on the local directory and on S3 over HTTP (moto's server by default). Time is real: the
lease ttl is shortened to a second or two (what ``[stateful] lease_ttl`` does) so "hours between two saves"
become seconds; nothing here asserts a duration, only what the store and the writer saw.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from long_tests import LONG_TESTS
from maintenance import GcLoop, OutageStore, keys, missing_references, read_tree, tree
from netproxy import TcpProxy
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
from airflow_stateful.core.errors import FencedError, LeaseHeldError, StoreError
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.s3 import S3ObjectStore
from airflow_stateful.core.timestamps import parse_iso

REPO = Path(__file__).resolve().parent.parent
TTL = 1.5
GRACE = 0.5
IDENTITY = Identity.for_task(dag_id="train", task_id="fit", run_id="manual__1")


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A store, plus what a subprocess needs to open the same one (URL and environment)."""
    if request.param == "local":
        root = tmp_path / "state"
        with LocalObjectStore(root=root) as store:
            yield {"store": store, "url": root.as_uri(), "env": {}, "kind": "local", "atomic": True}
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    prefix: str = request.getfixturevalue("s3_prefix")
    env = {"AWS_DEFAULT_REGION": endpoint.region, "STATEFUL_S3_ENDPOINT_URL": str(endpoint.endpoint_url)}
    for name, option in (
        ("AWS_ACCESS_KEY_ID", "aws_access_key_id"),
        ("AWS_SECRET_ACCESS_KEY", "aws_secret_access_key"),
    ):
        if endpoint.credentials.get(option):
            env[name] = endpoint.credentials[option]
    with endpoint.store(prefix) as store:
        yield {
            "store": store,
            "url": f"s3://{endpoint.bucket}/{prefix}",
            "env": env,
            "kind": "s3",
            "atomic": endpoint.atomic_cas,
            "endpoint": endpoint,
            "prefix": prefix,
        }


def checkpoints(store: ObjectStore, **kwargs: Any) -> CheckpointStore:
    kwargs.setdefault("lease_ttl", TTL)
    kwargs.setdefault("keep_last", 2)
    return CheckpointStore(store=store, identity=kwargs.pop("identity", IDENTITY), **kwargs)


# -- a long computation between two saves ------------------------------------------------------------------
def test_a_try_computing_4x_the_ttl_keeps_its_lease_while_gc_runs(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    store: ObjectStore = backend["store"]
    writer = WriterSession(checkpoints=checkpoints(store), writer=WriterInfo(try_number=1))
    with GcLoop(store, keep_last=1, grace=GRACE) as gc, writer as session:
        for step in range(3):
            files = tree(tmp_path / f"epoch{step}", {"weights.bin": os.urandom(4096), "step": b"%d" % step})
            session.commit({"epoch": step}, files=files)
        time.sleep(4 * TTL)  # one long epoch: no save, only the heartbeat
        final = session.commit({"epoch": 3})  # keeps epoch 2's files by reference
    cs = checkpoints(store)
    head = cs.head()
    assert head is not None and head.epoch == 1, "nobody fenced the writer"
    assert head.lease is None, "the session released its lease at the end"
    assert gc.passes > 10 and gc.deletion_errors() == []
    assert len(gc.renewals) >= 3, f"the lease was renewed while the writer computed: {sorted(gc.renewals)}"
    latest = cs.latest()
    assert latest is not None and latest.seq == final.seq and latest.value == {"epoch": 3}
    restored = tmp_path / "restored"
    cs.restore_files(latest, restored)
    assert read_tree(restored) == read_tree(tmp_path / "epoch2"), "GC deleted nothing the checkpoint needs"
    assert missing_references(store, IDENTITY) == []


def test_without_renewals_gc_breaks_the_dead_lease_and_the_late_save_is_fenced(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    """The control: the same computation with nobody renewing is fenced by GC (so the test above has teeth)."""
    store: ObjectStore = backend["store"]
    cs = checkpoints(store)
    lease = cs.acquire()
    cs.commit(lease, {"epoch": 0}, files=tree(tmp_path / "e0", {"w": b"weights"}))
    upload = f"{IDENTITY.key}/~chunks/{'ca' * 32}"
    store.put(upload, b"an upload of this writer that never got committed")
    with GcLoop(store, keep_last=1, grace=GRACE) as gc:
        time.sleep(TTL + GRACE + 1.5)
    assert gc.deletion_errors() == []
    with pytest.raises(FencedError, match="broken"):
        cs.commit(lease, {"epoch": 1})
    assert upload not in keys(store), "a dead holder's uploads are garbage"
    assert cs.latest().value == {"epoch": 0}  # type: ignore[union-attr]


# -- a writer killed with SIGKILL ------------------------------------------------------------------------------
KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
    from airflow_stateful.core.stores.registry import store_from_url

    url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL")
    store = store_from_url(url, **({"endpoint_url": endpoint} if url.startswith("s3://") else {}))
    cs = CheckpointStore(store=store, identity=Identity.parse(key), lease_ttl=ttl)
    with WriterSession(checkpoints=cs, writer=WriterInfo.current(try_number=1)) as session:
        session.commit({"done": 10})
        print("committed", flush=True)
        while True:  # computing, forever: only SIGKILL ends this
            time.sleep(0.05)
    """
)


def start_killable_writer(backend: dict[str, Any], identity: Identity, ttl: float) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STATEFUL_", "AWS_"))}
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, backend["url"], identity.key, str(ttl)],
        env={**clean, **backend["env"], "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.strip() == "committed", process.stderr.read() if process.stderr else line
    return process


def test_a_sigkilled_writer_is_breakable_one_ttl_after_its_last_renewal_and_the_retry_resumes(
    backend: dict[str, Any],
) -> None:
    store: ObjectStore = backend["store"]
    cs = checkpoints(store)
    writer = start_killable_writer(backend, IDENTITY, TTL)
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:  # the writer's heartbeat, seen from outside
            head = cs.head()
            if head is not None and head.lease is not None and head.lease.renewed_at:
                seen.add(head.lease.renewed_at)
            time.sleep(0.1)
        assert len(seen) >= 3, "the writer renewed its lease while it computed"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    time.sleep(0.3)  # a renewal request sent just before the kill has landed by now
    head = cs.head()
    assert head is not None and head.lease is not None
    expires = parse_iso(head.lease.expires_at)
    assert expires - parse_iso(head.lease.last_renewed) == pytest.approx(TTL, abs=0.01)

    taken_at = None
    while taken_at is None:
        try:
            lease = checkpoints(store).acquire(holder=WriterInfo(try_number=99), steal=False)
        except LeaseHeldError:
            assert time.time() < expires + 2, "the dead writer's lease never expired"
            time.sleep(0.05)
            continue
        taken_at = time.time()
    assert taken_at >= expires, "a held lease was taken without stealing before it expired"
    assert taken_at - expires < 1.5, "the lease expired one ttl after the last renewal, not later"
    checkpoints(store).release(lease)

    # The retry (it steals, as every Airflow retry does) resumes from what the killed writer committed.
    with WriterSession(checkpoints=checkpoints(store), writer=WriterInfo(try_number=2)) as retry:
        assert retry.value == {"done": 10} and retry.start is not None and retry.start.writer.try_number == 1


# -- renewal failing for longer than the ttl -----------------------------------------------------------------
@pytest.fixture
def flaky(backend: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The same store behind a switch: a TCP proxy in front of S3, or :class:`OutageStore` for a directory."""
    if backend["kind"] == "local":
        outage = OutageStore(backend["store"])

        def down() -> None:
            outage.down.set()

        yield {"store": outage, "down": down, "up": outage.down.clear}
        return
    endpoint: S3Endpoint = backend["endpoint"]
    with TcpProxy(str(endpoint.endpoint_url)) as proxy:
        options = {**endpoint.options(), "endpoint_url": proxy.url}
        with S3ObjectStore(bucket=endpoint.bucket, prefix=backend["prefix"], **options) as through_proxy:
            yield {"store": through_proxy, "down": proxy.down, "up": proxy.up}


def test_renewal_failing_past_the_ttl_fails_the_next_save_before_any_upload(
    backend: dict[str, Any], flaky: dict[str, Any], tmp_path: Path, library_log: list[str]
) -> None:
    direct: ObjectStore = backend["store"]
    good = tree(tmp_path / "good", {"model.bin": os.urandom(2048)})
    session = WriterSession(checkpoints=checkpoints(flaky["store"]), writer=WriterInfo(try_number=1)).open()
    try:
        session.commit({"epoch": 1}, files=good)
        flaky["down"]()  # the store is unreachable from this writer, for longer than the ttl
        deadline = time.monotonic() + 10 * TTL
        while not session.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session.lost, "a lease that could not be renewed within its ttl is lost"
        before = keys(direct)
        big = tree(tmp_path / "next", {f"shard{i}": os.urandom(64 * 1024) for i in range(8)})
        with pytest.raises(FencedError, match=r"lost its lease .*not renewed within its ttl") as raised:
            session.commit({"epoch": 2}, files=big)
        assert "Nothing was uploaded" in str(raised.value)
        assert keys(direct) == before, "not a byte was uploaded by the writer that lost its lease"
        assert any("LEASE LOST" in m for m in library_log), "the loss is logged loudly"
    finally:
        flaky["up"]()
        session.close()
    latest = checkpoints(direct).latest()
    assert latest is not None and latest.value == {"epoch": 1}, "the last good checkpoint is intact"
    restored = tmp_path / "restored"
    checkpoints(direct).restore_files(latest, restored)
    assert read_tree(restored) == read_tree(good)


def test_a_failed_renewal_that_recovers_within_the_ttl_keeps_the_lease(tmp_path: Path) -> None:
    """A short outage (shorter than the ttl) is retried, not mistaken for a lost lease. (Local directory only:
    on S3, botocore's own retries of a reset connection outlast a ttl this short.)"""
    outage = OutageStore(LocalObjectStore(root=tmp_path / "state"))
    session = WriterSession(
        checkpoints=checkpoints(outage, lease_ttl=3.0), writer=WriterInfo(try_number=1)
    ).open()
    try:
        session.commit({"epoch": 1})
        outage.down.set()
        time.sleep(1.2)  # the heartbeat (every ~1 s) fails at least once
        outage.down.clear()
        time.sleep(1.5)  # ... and is retried within the ttl
        assert not session.lost
        assert session.commit({"epoch": 2}).seq == 2
    finally:
        session.close()


# -- a failed save changes nothing the writer sees ------------------------------------------------------------
def test_a_refused_or_failed_commit_leaves_the_session_as_it_was(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    outage = OutageStore(backend["store"])
    with WriterSession(
        checkpoints=checkpoints(outage), writer=WriterInfo(try_number=1), heartbeat=False
    ) as s:
        first = s.commit({"n": 1}, files=tree(tmp_path / "a", {"f": b"one"}))
        for bad in ({"bad": object()}, {"nan": float("nan")}):
            with pytest.raises(ValueError):
                s.commit(bad)
            assert (s.latest, s.value) == (first, {"n": 1})
        outage.down.set()
        with pytest.raises(StoreError):
            s.commit({"n": 2})
        outage.down.clear()
        assert (s.latest, s.value) == (first, {"n": 1})
        assert s.commit({"n": 3}).seq == 2, "nothing of the failed commits was recorded"


# -- gc racing commits ------------------------------------------------------------------------------------------
def test_gc_racing_commits_never_deletes_what_a_committed_checkpoint_references(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    """Up to hundreds of rounds of tries that commit (with and without files), crash, leave dead leases, hand over;
    GC applies keep-last 1 and collects garbage without pause. No checkpoint ever loses an object."""
    if not backend["atomic"]:
        pytest.skip(
            "this moto server checks If-Match without a lock; the race needs atomic conditional writes"
        )
    store: ObjectStore = backend["store"]
    # `make soak` (STATEFUL_LONG_TESTS=1) runs 300 + 200 rounds; `make test` 120 + 80, inside its 15 minutes.
    long = LONG_TESTS
    rounds = (300 if long else 120) if backend["kind"] == "local" else (200 if long else 80)
    problems: list[str] = []
    with GcLoop(store, keep_last=1, grace=0.2) as gc:
        for n in range(rounds):
            try_number = n + 1
            if n % 20 == 19:
                # A try killed mid-commit: it uploaded data and holds a short lease nobody renews, which
                # dies (0.3 s ttl + 0.2 s grace) before the next try starts, so GC breaks it.
                checkpoints(store, lease_ttl=0.3).acquire(
                    holder=WriterInfo(try_number=try_number), steal=True
                )
                store.put(f"{IDENTITY.key}/~chunks/{n:064x}", b"uploaded by a killed try")
                time.sleep(0.6)
                continue
            with WriterSession(
                checkpoints=checkpoints(store, lease_ttl=5.0, keep_last=1),
                writer=WriterInfo(try_number=try_number),
            ) as session:
                files = tree(tmp_path / f"r{n}", {"data.bin": b"%d" % n * 100})
                session.commit({"round": n}, files=files if n % 3 == 0 else None)
                manifest = session.commit({"round": n, "again": True})  # keeps the files by reference
                missing = missing_references(store, IDENTITY)
                if missing:
                    problems.append(f"round {n}: {missing}")
                if manifest.has_files:
                    checkpoints(store).restore_files(manifest, tmp_path / f"out{n}")
    assert gc.passes > 20 and gc.applied > 0, "GC really ran and deleted things meanwhile"
    assert problems == [] and gc.deletion_errors() == []
    latest = checkpoints(store).latest()
    assert latest is not None and latest.value["again"] is True
    out = tmp_path / "final"
    checkpoints(store).restore_files(latest, out)
    assert [p.name for p in out.iterdir()] == ["data.bin"]


# -- many writers taking one lease in turns -----------------------------------------------------------------
TURN_TAKER = textwrap.dedent(
    """
    import os, sys
    from airflow_stateful.core import CheckpointStore, Identity, WriterInfo
    from airflow_stateful.core.errors import FencedError
    from airflow_stateful.core.stores.registry import store_from_url

    url, key, name, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL")
    store = store_from_url(url, **({"endpoint_url": endpoint} if url.startswith("s3://") else {}))
    cs = CheckpointStore(store=store, identity=Identity.parse(key), keep_last=50)
    fenced = 0
    for turn in range(turns):
        lease = cs.acquire(holder=WriterInfo(pod=name), steal=True)
        try:
            cs.commit(lease, {"writer": name, "turn": turn})
        except FencedError:
            fenced += 1
        cs.release(lease)
    print(f"{name} done, {fenced} fenced")
    """
)


def test_three_processes_taking_the_lease_in_turns_never_give_up(backend: dict[str, Any]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("STATEFUL_", "AWS_"))}
    env = {**clean, **backend["env"], "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TURN_TAKER, backend["url"], IDENTITY.key, f"p{i}", "25"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert "done" in out
    head = checkpoints(backend["store"]).head()
    assert head is not None and head.lease is None
    if backend["atomic"]:
        assert head.epoch == 75, "every one of the 75 acquisitions landed exactly once"


# -- the renewal thread itself ---------------------------------------------------------------------------------
def test_a_retry_stealing_the_lease_makes_the_zombie_stop_before_its_next_upload(
    backend: dict[str, Any], tmp_path: Path
) -> None:
    store: ObjectStore = backend["store"]
    zombie = WriterSession(checkpoints=checkpoints(store), writer=WriterInfo(try_number=1)).open()
    try:
        zombie.commit({"epoch": 1})
        with WriterSession(checkpoints=checkpoints(store), writer=WriterInfo(try_number=2)) as retry:
            deadline = time.monotonic() + 10 * TTL
            while not zombie.lost and time.monotonic() < deadline:
                time.sleep(0.05)
            assert zombie.lost, "the zombie's heartbeat found the lease taken over"
            before = keys(store)
            with pytest.raises(FencedError, match="taken by try 2"):
                zombie.commit({"epoch": 99}, files=tree(tmp_path / "z", {"f": os.urandom(1024)}))
            assert keys(store) == before
            retry.commit({"epoch": 2})
    finally:
        zombie.close()
    head = checkpoints(store).head()
    assert head is not None and head.lease is None, "the retry released; the zombie did not release it"


def test_the_heartbeat_thread_ends_with_the_session(backend: dict[str, Any]) -> None:
    before = {t.name for t in threading.enumerate()}
    with WriterSession(checkpoints=checkpoints(backend["store"]), writer=WriterInfo()):
        assert any(t.name.startswith("stateful-lease-") for t in threading.enumerate())
    assert {t.name for t in threading.enumerate() if t.name.startswith("stateful-lease-")} <= before
