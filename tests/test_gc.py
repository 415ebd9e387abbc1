"""Store-wide retention and GC: hundreds of identities on the real S3 endpoint, the CLI, and the maintenance DAG.

The promise under test: a dry run changes nothing, a real run deletes exactly what the dry run listed, and
nothing under a live lease or still referenced by a head is ever deleted.
"""

from __future__ import annotations

import json
import os
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from dag_helpers import load_dag_module
from s3_endpoint import S3Endpoint
from test_cli import backend, cli, open_cs  # noqa: F401 - `backend` is a fixture used by the CLI tests

from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.core.fleet.gc import (
    EXPIRED,
    EXPIRED_STATE,
    GARBAGE,
    IDLE,
    ORPHAN,
    RETENTION,
    apply_gc,
    plan_gc,
)
from airflow_stateful.core.fleet.walk_progress import ItemProgress
from airflow_stateful.core.protocol.state_documents import KeyValueStore, object_key, task_prefix
from airflow_stateful.core.stores.base import ObjectStore

DAY = 86400.0
BALLAST = ["x" * 100] * 100
IDLE_FOR = timedelta(days=30)


def old_clock(days: float) -> Callable[[], float]:
    """A writer clock ``days`` in the past, so its head's ``updated_at`` looks that old."""
    return lambda: time.time() - days * DAY


def all_keys(store: ObjectStore) -> set[str]:
    return {info.key for info in store.list_objects("")}


@dataclass
class Fleet:
    """The identities written, by the role each plays."""

    fresh: list[str] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    leased: list[str] = field(default_factory=list)
    long_history: list[str] = field(default_factory=list)
    garbage: dict[str, list[str]] = field(default_factory=dict)
    orphans: dict[str, list[str]] = field(default_factory=dict)
    expired_docs: list[str] = field(default_factory=list)
    live_docs: list[str] = field(default_factory=list)


def _ident(role: str, n: int) -> Identity:
    return Identity.for_task(dag_id=f"dag_{n % 7}", task_id=f"{role}_{n}", run_id=f"run_{n}")


def _write(
    store: ObjectStore,
    identity: Identity,
    *,
    commits: int,
    clock: Callable[[], float],
    release: bool = True,
    files: Path | None = None,
) -> CheckpointStore:
    cs = CheckpointStore(store=store, identity=identity, keep_last=10, clock=clock)
    lease = cs.acquire()
    for i in range(commits):
        # Too big to ride inline in the head: every checkpoint has a manifest object for retention to delete.
        cs.commit(lease, {"i": i, "ledger": BALLAST}, files=files if i == 0 else None)
    if release:
        cs.release(lease)
    return cs


def _crash_garbage(store: ObjectStore, key: str) -> list[str]:
    commit = uuid.uuid4().hex
    keys = [f"{key}/~chunks/{commit * 2}", f"{key}/~manifests/000000000999-{commit}.json"]
    for k in keys:
        store.put(k, b"left by a crashed commit")
    return keys


def build_fleet(store: ObjectStore, files: Path, scale: int = 20) -> Fleet:
    """``10 * scale`` identities: fresh, idle, leased, long history (some with files), crash garbage, orphans."""
    fleet = Fleet()
    now_clock = time.time
    jobs: list[Callable[[], None]] = []

    def add(role: str, count: int, fn: Callable[[Identity], None]) -> None:
        for n in range(count):
            identity = _ident(role, n)
            jobs.append(lambda identity=identity: fn(identity))  # type: ignore[misc]

    def fresh(i: Identity) -> None:
        _write(store, i, commits=2, clock=now_clock)
        fleet.fresh.append(i.key)

    def idle(i: Identity) -> None:
        # Half of them were left with an (expired) lease, as a killed worker would.
        _write(store, i, commits=2, clock=old_clock(40), release=zlib.crc32(i.key.encode()) % 2 == 0)
        fleet.idle.append(i.key)

    def leased(i: Identity) -> None:
        # Under a live lease: long history, crash garbage and an old head must all be left alone.
        _write(store, i, commits=6, clock=now_clock, release=False)
        _crash_garbage(store, i.key)
        fleet.leased.append(i.key)

    def long_history(i: Identity) -> None:
        _write(
            store, i, commits=6, clock=now_clock, files=files if zlib.crc32(i.key.encode()) % 3 == 0 else None
        )
        fleet.long_history.append(i.key)

    def garbage(i: Identity) -> None:
        _write(store, i, commits=1, clock=now_clock)
        fleet.garbage[i.key] = _crash_garbage(store, i.key)

    def orphan(i: Identity) -> None:
        cs = _write(store, i, commits=2, clock=now_clock, files=files)
        store.delete(cs.heads.key)  # a purge that crashed right after deleting the head
        fleet.orphans[i.key] = sorted(k for k in all_keys_under(store, i.key))

    add("fresh", 4 * scale, fresh)
    add("idle", 2 * scale, idle)
    add("leased", scale, leased)
    add("history", scale, long_history)
    add("garbage", scale, garbage)
    add("orphan", scale, orphan)
    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()

    kv = KeyValueStore(store=store)
    past = datetime.now(tz=timezone.utc) - timedelta(days=1)
    for n in range(3):
        prefix = task_prefix(dag_id="d", run_id=f"r{n}", task_id="t", map_index=-1)
        expired, live = object_key(prefix, "expired"), object_key(prefix, "live")
        kv.write(expired, '"x"', expires_at=past)
        kv.write(live, '"y"', expires_at=past + timedelta(days=30))
        fleet.expired_docs.append(expired)
        fleet.live_docs.append(live)
    return fleet


def all_keys_under(store: ObjectStore, key: str) -> set[str]:
    return {info.key for info in store.list_objects(f"{key}/")}


@pytest.fixture
def small_files(tmp_path: Path) -> Path:
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.bin").write_bytes(os.urandom(2048))
    return files


@pytest.mark.s3
def test_many_identities_dry_run_changes_nothing_and_real_run_deletes_exactly_its_list(
    s3_endpoint: S3Endpoint, s3_prefix: str, small_files: Path
) -> None:
    store = s3_endpoint.store(s3_prefix)
    fleet = build_fleet(store, small_files, scale=20)  # 200 identities
    before = all_keys(store)

    dry = plan_gc(store, idle_for=IDLE_FOR, keep_last=3, min_age=timedelta(0))
    assert all_keys(store) == before, "planning (a dry run) must change nothing"
    by_id = {p.identity: p for p in dry.identities}

    # Every policy found exactly its identities, and only them.
    assert {k for k, p in by_id.items() if IDLE in p.reasons} == set(fleet.idle)
    assert {k for k, p in by_id.items() if RETENTION in p.reasons} == set(fleet.long_history)
    assert {k for k, p in by_id.items() if GARBAGE in p.reasons} == set(fleet.garbage)
    assert {k for k, p in by_id.items() if ORPHAN in p.reasons} == set(fleet.orphans)
    assert sorted(by_id[EXPIRED_STATE].reasons[EXPIRED]) == sorted(fleet.expired_docs)
    for key, keys in fleet.garbage.items():
        assert sorted(by_id[key].reasons[GARBAGE]) == sorted(keys)
    for key, keys in fleet.orphans.items():
        assert sorted(by_id[key].reasons[ORPHAN]) == keys
    for key in fleet.idle:
        assert sorted(by_id[key].reasons[IDLE]) == sorted(all_keys_under(store, key))
    for key in fleet.leased:
        assert by_id[key].keys == [] and by_id[key].skipped and "live lease" in by_id[key].skipped
    assert not set(fleet.fresh) & set(by_id)

    result = apply_gc(dry)
    after = all_keys(store)
    assert result.skipped == {}
    assert sorted(result.deleted) == dry.keys
    assert before - after == set(dry.keys), "the real run deleted exactly what the dry run listed"
    assert after <= before

    # Leased identities are untouched, object for object.
    for key in fleet.leased:
        assert all_keys_under(store, key) == {k for k in before if k.startswith(f"{key}/")}
    # Everything still referenced is intact and readable; history is pruned to 3.
    for key in fleet.fresh + fleet.long_history + list(fleet.garbage):
        cs = CheckpointStore(store=store, identity=Identity.parse(key))
        head = cs.head()
        assert head is not None and len(head.checkpoints) <= 3
        for entry in head.checkpoints:
            manifest = cs.get(entry.seq)
            for f in cs.files(manifest):
                for key in f.keys:
                    assert any(info.key == key for info in store.list_objects(key))
        latest = cs.latest()
        assert latest is not None and latest.value["i"] == latest.seq - 1
    for key in fleet.long_history:
        cs = CheckpointStore(store=store, identity=Identity.parse(key))
        assert [e.seq for e in cs.history()] == [6, 5, 4]
        assert len(all_keys_under(store, f"{key}/~manifests")) == 3
    for key in fleet.idle + list(fleet.orphans):
        assert all_keys_under(store, key) == set()
    assert set(fleet.live_docs) <= after

    # A second pass finds nothing more to delete.
    again = plan_gc(store, idle_for=IDLE_FOR, keep_last=3, min_age=timedelta(0))
    assert again.keys == []


@pytest.mark.s3
def test_an_identity_that_changed_after_the_plan_is_skipped_not_pruned(
    s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    store = s3_endpoint.store(s3_prefix)
    moved, still = _ident("moved", 1), _ident("still", 2)
    for identity in (moved, still):
        _write(store, identity, commits=5, clock=time.time)
    plan = plan_gc(store, keep_last=2, min_age=timedelta(0))
    assert {p.identity for p in plan.identities} == {moved.key, still.key}
    cs = CheckpointStore(store=store, identity=moved, keep_last=10)
    lease = cs.acquire()
    cs.commit(lease, {"i": 99})  # a writer committed between plan and apply
    cs.release(lease)
    before = all_keys_under(store, moved.key)

    result = apply_gc(plan)
    assert set(result.skipped) == {moved.key} and "changed since the plan" in result.skipped[moved.key]
    assert all_keys_under(store, moved.key) == before
    assert [e.seq for e in CheckpointStore(store=store, identity=still).history()] == [5, 4]


def test_an_idle_identity_leased_after_the_plan_is_not_deleted(tmp_path: Path) -> None:
    store = store_from_url((tmp_path / "state").as_uri())
    identity = _ident("idle", 1)
    _write(store, identity, commits=1, clock=old_clock(40))
    plan = plan_gc(store, idle_for=IDLE_FOR, min_age=timedelta(0))
    assert plan.keys
    CheckpointStore(store=store, identity=identity).acquire()  # a new run took it meanwhile
    result = apply_gc(plan)
    assert identity.key in result.skipped and result.deleted == []
    assert CheckpointStore(store=store, identity=identity).latest() is not None


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    class Tty:
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    ticks = iter(range(0, 1000, 10))
    tty = Tty()
    bar = ItemProgress(label="gc", total=4, stream=tty, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    for _ in range(4):
        bar()
    bar.finish()
    assert "\rgc [" in tty.text and tty.text.endswith("4/4\n")

    class Pipe(Tty):
        def isatty(self) -> bool:
            return False

    pipe = Pipe()
    ticks = iter(range(0, 1000, 10))
    caplog.set_level("INFO", logger="airflow_stateful")
    lines = ItemProgress(label="du", total=2, stream=pipe, clock=lambda: float(next(ticks)))  # type: ignore[arg-type]
    lines()
    lines()
    lines.finish()
    assert pipe.text == ""
    assert "du: 2/2 done" in caplog.text


# -- CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.s3
def test_cli_gc_idle_for_keep_last_dry_run_then_real_run(
    capsys: pytest.CaptureFixture[str],
    backend: str,  # noqa: F811
) -> None:
    hist, idle, held = _ident("hist", 1), _ident("idle", 2), _ident("held", 3)
    store = open_cs(backend, hist).store
    _write(store, hist, commits=5, clock=time.time)
    _write(store, idle, commits=1, clock=old_clock(40))
    _write(store, held, commits=4, clock=time.time, release=False)
    before = all_keys(store)
    args = ["gc", "--idle-for", "30d", "--keep-last", "2", "--min-age", "0s", "--json"]

    code, out, _ = cli(capsys, backend, *args, "--dry-run")
    assert code == 0
    dry = {r["identity"]: r for r in json.loads(out)}
    assert all_keys(store) == before
    assert dry[hist.key]["reasons"] == RETENTION and dry[hist.key]["action"] == "would delete"
    assert dry[hist.key]["objects"] == 3
    assert dry[idle.key]["reasons"] == IDLE and dry[idle.key]["objects"] == 2  # head + one manifest
    assert dry[held.key]["action"].startswith("skipped: live lease") and dry[held.key]["objects"] == 0

    code, out, _ = cli(capsys, backend, *args)
    real = {r["identity"]: r for r in json.loads(out)}
    assert code == 0 and real[hist.key]["action"] == "deleted"
    listed = {k for r in dry.values() for k in r["keys"]}
    assert {k for r in real.values() for k in r["keys"]} == listed
    assert before - all_keys(store) == listed
    assert [e.seq for e in CheckpointStore(store=store, identity=hist).history()] == [5, 4]


@pytest.mark.s3
def test_cli_du_reports_bytes_checkpoints_idle_age_and_cost(
    capsys: pytest.CaptureFixture[str],
    backend: str,  # noqa: F811
) -> None:
    recent, idle = _ident("recent", 1), _ident("idle", 2)
    store = open_cs(backend, recent).store
    _write(store, recent, commits=3, clock=time.time)
    _write(store, idle, commits=1, clock=old_clock(40))
    garbage = _crash_garbage(store, recent.key)
    listing = list(store.list_objects(""))

    code, out, _ = cli(capsys, backend, "du", "--price-per-gb-month", "1000", "--json")
    assert code == 0
    rows = {r["identity"]: r for r in json.loads(out)}
    assert set(rows) == {recent.key, idle.key, "TOTAL"}
    sizes = {i.key: i.size for i in listing}
    assert rows[recent.key]["bytes"] == sum(v for k, v in sizes.items() if k.startswith(recent.key + "/"))
    assert rows[recent.key]["garbage_bytes"] == sum(sizes[k] for k in garbage)
    assert (rows[recent.key]["checkpoints"], rows[idle.key]["checkpoints"]) == (3, 1)
    assert rows[idle.key]["idle_seconds"] >= 39 * DAY and rows[recent.key]["idle_seconds"] < DAY
    assert rows[idle.key]["idle"].startswith("40d")
    assert rows["TOTAL"]["bytes"] == sum(sizes.values())
    assert rows["TOTAL"]["usd_per_month"] == pytest.approx(sum(sizes.values()) / 1024**3 * 1000, rel=1e-3)
    code, out, _ = cli(capsys, backend, "du")
    assert out.splitlines()[0].split()[:3] == ["IDENTITY", "CHECKPOINTS", "OBJECTS"]
    assert out.splitlines()[-1].startswith("TOTAL")


# -- Airflow ---------------------------------------------------------------------------------------------
def _returned(run: Any, task_id: str = "gc") -> Any:
    from airflow import settings
    from airflow.models.xcom import XComModel

    with settings.Session() as session:
        query = XComModel.get_many(
            run_id=run.run_id, dag_ids=run.dag_id, task_ids=task_id, key="return_value"
        )
        return XComModel.deserialize_value(session.scalars(query).one())


@pytest.mark.airflow
def test_maintenance_dag_deletes_idle_identities_on_the_local_default(
    dags_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    store = store_from_url(url)
    idle, fresh = _ident("idle", 1), _ident("fresh", 2)
    _write(store, idle, commits=1, clock=old_clock(40))
    _write(store, fresh, commits=7, clock=time.time)
    young_garbage = _crash_garbage(store, fresh.key)

    module = load_dag_module(dags_folder / "stateful_maintenance.py")
    run = module.dag_object.test()
    assert str(run.state) == "success"
    report = _returned(run)
    assert report["dry_run"] is False
    rows = {r["identity"]: r for r in report["identities"]}
    assert rows[idle.key]["reasons"] == {IDLE: 2} and rows[idle.key]["action"] == "deleted"
    assert rows[fresh.key]["reasons"] == {RETENTION: 2}, (
        "keep_last=5 drops 2; young garbage stays (min_age 1h)"
    )
    assert all_keys_under(store, idle.key) == set()
    assert set(young_garbage) <= all_keys_under(store, fresh.key)
    assert [e.seq for e in CheckpointStore(store=store, identity=fresh).history()] == [7, 6, 5, 4, 3]


def test_an_orphan_that_got_a_head_after_the_plan_is_skipped(tmp_path: Path) -> None:
    store = store_from_url((tmp_path / "state").as_uri())
    identity = _ident("orphan", 1)
    cs = _write(store, identity, commits=2, clock=time.time)
    store.delete(cs.heads.key)
    plan = plan_gc(store, min_age=timedelta(0))
    assert [p.reasons.keys() for p in plan.identities] == [{ORPHAN: []}.keys()]
    _write(store, identity, commits=1, clock=time.time)  # the identity was used again meanwhile
    before = all_keys(store)
    result = apply_gc(plan)
    assert identity.key in result.skipped and result.deleted == [] and all_keys(store) == before


def test_an_unreadable_tree_of_a_released_identity_leaves_its_chunks_and_says_why(tmp_path: Path) -> None:
    """Found by the S3 fault tests: a tree GET failing (here: the tree gone) while the lease is released made
    the plan crash with a bare AssertionError, stopping GC for the whole store. Now the identity's chunks are
    left alone and the plan says why."""
    from airflow_stateful.core import WriterInfo, WriterSession
    from airflow_stateful.core.stores.local import LocalObjectStore

    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("a")
    with LocalObjectStore(root=tmp_path / "store") as store:
        cs = CheckpointStore(store=store, identity=Identity.parse("d/t/run=r/map=-1"))
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
            manifest = session.commit({"n": 1}, files=work)
        assert manifest.tree is not None
        store.delete(manifest.tree.key)
        chunks = {
            info.key
            for info in store.list_objects("d/t/")
            if "/~chunks/" in info.key or "/~packs/" in info.key
        }
        plan = plan_gc(store, min_age=timedelta(0))
        [item] = plan.identities
        assert item.skipped and "its chunks are left alone" in item.skipped
        assert "live lease" not in item.skipped
        assert chunks and not chunks & set(item.keys)


def _as_format_1(store: ObjectStore, identity: Identity, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``identity``'s head the way a pre-release build left it (``change``), with a valid checksum,
    and give it format-1 data objects (``~data/<commit>/<n>``) that only such a head references."""
    from airflow_stateful.core.records.canonical import canonical_json, sha256_hex

    key = f"{identity.key}/~head.json"
    body = json.loads(store.get(key).data)
    body.pop("checksum")
    change(body)
    body["checksum"] = sha256_hex(canonical_json(body))
    store.put(key, canonical_json(body))
    commit = body["checkpoints"][0]["commit_id"]
    for n in range(2):
        store.put(f"{identity.key}/~data/{commit}/{n}", b"a format-1 file")


def test_gc_keeps_every_object_of_an_identity_whose_head_is_format_1_and_collects_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Format 1 is no longer read, so GC cannot see which ``~data/`` objects such a head references: the
    identity is kept whole and reported, not deleted and not pruned, while the rest of the store is collected
    as usual (a dry run and a real one, the CLI's report too). Stray ``~data/`` objects under a head this
    version reads are never taken for garbage; they go only with their whole identity."""
    store = store_from_url((tmp_path / "state").as_uri())
    in_format_1 = _write(store, _ident("format1", 1), commits=3, clock=old_clock(40)).identity
    _as_format_1(store, in_format_1, lambda b: b.update(format=1))
    with_refs = _write(store, _ident("format1", 2), commits=3, clock=old_clock(40)).identity
    _as_format_1(
        store, with_refs, lambda b: b["checkpoints"][0].update(data_refs=[b["checkpoints"][0]["commit_id"]])
    )
    plain = _write(store, _ident("plain", 1), commits=3, clock=time.time).identity
    garbage = _crash_garbage(store, plain.key)
    stray = f"{plain.key}/~data/{'0' * 32}/0"
    store.put(stray, b"left by a pre-release build")
    refused = {
        in_format_1.key: all_keys_under(store, in_format_1.key),
        with_refs.key: all_keys_under(store, with_refs.key),
    }

    plan = plan_gc(store, idle_for=IDLE_FOR, keep_last=1, min_age=timedelta(0))
    by_id = {p.identity: p for p in plan.identities}
    for key in refused:
        assert by_id[key].reasons == {} and by_id[key].skipped, by_id[key]
        assert "format 1" in by_id[key].skipped and "kept whole" in by_id[key].skipped
    assert set(garbage) <= set(by_id[plain.key].reasons[GARBAGE]) and stray not in by_id[plain.key].keys
    deleted = set(apply_gc(plan).deleted)
    assert set(garbage) <= deleted and not deleted & {k for keys in refused.values() for k in keys}
    assert stray in all_keys(store), "a ~data/ object is never garbage on its own"
    for key, keys in refused.items():
        assert all_keys_under(store, key) == keys, "nothing of a refused identity is deleted"

    # The CLI says so, row by row, and deletes nothing of them either.
    code, out, _ = cli(
        capsys, store.url, "gc", "--min-age", "0s", "--keep-last", "1", "--json", "--airflow", "no"
    )
    rows = {r["identity"]: r for r in json.loads(out)}
    assert code == 0
    for key, keys in refused.items():
        assert rows[key]["action"].startswith("skipped: kept whole") and rows[key]["objects"] == 0
        assert all_keys_under(store, key) == keys

    # Deleted whole (idle), an identity this version reads takes its stray ~data/ objects with it.
    idle = plan_gc(store, idle_for=timedelta(0), keep_failed_for=None, min_age=timedelta(0))
    assert stray in {k for p in idle.identities for k in p.reasons.get(IDLE, [])}
    apply_gc(idle)
    assert all_keys_under(store, plain.key) == set()
    for key, keys in refused.items():
        assert all_keys_under(store, key) == keys
