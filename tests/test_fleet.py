"""Fleet operations (``ls``, ``du``, ``verify --all``, GC's plan, the UI list) on both stores: a delimited listing
finds the same identities as walking every object did, heads are read a few at a time, in key order, and the
output streams.

Every store here is real (a local directory; S3 over HTTP on moto's server). :class:`CountingStore` wraps one
to count and time its reads, never to fake them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint
from test_cli import LS_HEADER

from airflow_stateful.cli.commands.fleet import cmd_du, cmd_ls
from airflow_stateful.cli.definition import build_parser
from airflow_stateful.cli.exit_codes import EXIT_OK, EXIT_PROBLEM
from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.fleet.catalog import HEAD_READERS, list_identities, ordered_map, read_heads
from airflow_stateful.core.fleet.gc import plan_gc
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.settings import StatefulSettings
from airflow_stateful.core.stores import local as local_module
from airflow_stateful.core.stores.base import Blob, CommonPrefix, ObjectInfo, ObjectStore, StoredFile
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.s3 import S3ObjectStore
from airflow_stateful.core.stores.s3_listing import entry_key
from airflow_stateful.plugins.view.rows import Bounds, collect

NESTED = [
    Identity.parse("etl/load"),  # an identity that is also the folder of two others
    Identity.parse("etl/load/part-1"),
    Identity.parse("etl/load/part-2"),
    Identity.for_task(dag_id="etl", task_id="crunch", run_id="manual__1"),
    Identity.parse("etl-x/job"),  # sorts before every "etl/..." key
    Identity.parse("z/last"),
]
FREE_FORM = {
    "etl/load/README.txt": b"not an identity's",
    "free/form/object.bin": b"x",
    "orphan/job/~data/c1/f": b"data left behind by a purge that stopped",
    "bad~name/~head.json": b"{}",
    "~task-state/etl/load/doc.json": b"{}",
}


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(root=tmp_path / "state", fsync=False)
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


def build_fleet(store: ObjectStore, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    (files / "model.bin").write_bytes(os.urandom(3000))
    for n, identity in enumerate(NESTED):
        cs = CheckpointStore(store=store, identity=identity)
        lease = cs.acquire()
        cs.commit(lease, {"n": n}, files=files if n % 2 else None)
        if identity.key != "etl/load/part-1":
            cs.release(lease)
    for key, data in FREE_FORM.items():
        store.put(key, data)


def identities_by_walking(store: ObjectStore, prefix: str) -> list[str]:
    """What listing every object found before: keys ending in ``/~head.json`` that are valid identities, in the
    order of their ``<identity>/~`` prefixes (S3's byte order: the catalog's order on S3, on the local store and
    on SeaweedFS, whose own listing order is a directory walk)."""
    found = []
    for info in store.list_objects(prefix):
        if info.key.endswith(f"/{HEAD_NAME}") and not info.key.startswith("~"):
            try:
                found.append(Identity.parse(info.key[: -len(HEAD_NAME) - 1]).key)
            except ValueError:
                continue
    return sorted(found, key=lambda key: f"{key}/~")


def unsigned(args: argparse.Namespace) -> argparse.Namespace:
    """A verb's arguments as :func:`~airflow_stateful.cli.common.open_store` completes them, for a deployment
    that does not sign heads (these tests call the verb on a store of their own)."""
    args.signer = args.marks = None
    return args


def ls(store: ObjectStore, *args: str) -> tuple[int, str]:
    """``airflow-stateful ls ARGS`` on ``store``, in this process: the exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cmd_ls(unsigned(build_parser().parse_args(["ls", *args])), store)
    return code, out.getvalue()


# -- the listing ------------------------------------------------------------------------------------------
@pytest.mark.s3
def test_the_delimited_listing_finds_the_identities_walking_every_object_found(
    store: ObjectStore, tmp_path: Path
) -> None:
    build_fleet(store, tmp_path)
    for prefix in (
        "",
        "e",
        "etl",
        "etl/",
        "etl/load",
        "etl/load/",
        "etl/load/~",
        "etl/load/~head.json",
        "z/",
    ):
        with_heads = [
            i.key for i in list_identities(store, prefix) if store_has(store, f"{i.key}/{HEAD_NAME}")
        ]
        assert with_heads == identities_by_walking(store, prefix), prefix
    # Objects of an identity without a head are listed too (the head read says it has none).
    assert "orphan/job" in [i.key for i in list_identities(store)]
    assert [i.key for i in list_identities(store, "nothing/")] == []


def store_has(store: ObjectStore, key: str) -> bool:
    return any(info.key == key for info in store.list_objects(key))


@pytest.mark.s3
def test_ls_prints_the_same_rows_in_key_order_and_a_corrupt_head_as_its_own_error_row(
    store: ObjectStore, tmp_path: Path
) -> None:
    build_fleet(store, tmp_path)
    code, out = ls(store, "--json")
    assert code == EXIT_OK
    rows = json.loads(out)
    assert [r["identity"] for r in rows] == identities_by_walking(store, "")
    for row in rows:
        head = CheckpointStore(store=store, identity=Identity.parse(row["identity"])).head()
        assert head is not None and head.latest is not None
        assert (row["seq"], row["kept"], row["epoch"], row["updated"]) == (
            head.latest.seq,
            len(head.checkpoints),
            head.epoch,
            head.updated_at,
        )
        # The newest checkpoint's files and its manifest (the value): never 0, even without files.
        assert row["size"] > head.latest.total_size
        assert (row["lease"] is None) == (row["identity"] != "etl/load/part-1")

    store.put(f"etl/load/part-2/{HEAD_NAME}", b"{not json")
    code, out = ls(store, "--json")
    assert code == EXIT_PROBLEM, "a head that cannot be read is a problem found"
    rows = json.loads(out)
    assert [r["identity"] for r in rows] == identities_by_walking(store, "")
    bad = next(r for r in rows if r["identity"] == "etl/load/part-2")
    assert bad["error"].startswith("CheckpointCorruptError: head record 'etl/load/part-2/~head.json'")
    assert bad["seq"] is None and all("error" not in r for r in rows if r is not bad)

    code, table = ls(store, "etl/load/")
    lines = table.splitlines()
    assert lines[0].split() == LS_HEADER
    assert [line.split()[0] for line in lines[1:]] == ["etl/load/part-1", "etl/load/part-2", "etl/load"]
    assert lines[2].split()[1:3] == ["error:", "CheckpointCorruptError:"]
    seq_column = lines[0].index("SEQ")
    assert lines[1][seq_column] == "1" and lines[3][seq_column] == "1", "the table's columns line up"


def test_a_table_streamed_in_pages_keeps_its_columns_and_json_stays_one_array() -> None:
    from airflow_stateful.cli.output import emit

    rows = [{"identity": f"id-{'x' * (n % 3)}", "seq": n} for n in range(7)]
    out = io.StringIO()
    assert emit(iter(rows), ["identity", "seq"], as_json=False, out=out, page=3) == 7
    lines = out.getvalue().splitlines()
    assert len(lines) == 8 and len({line.index(line.split()[1]) for line in lines}) == 1
    out = io.StringIO()
    emit(iter(rows), ["identity", "seq"], as_json=True, out=out)
    assert json.loads(out.getvalue()) == rows
    assert out.getvalue() == json.dumps(rows, indent=2) + "\n", "the same text a whole-list dump writes"
    out = io.StringIO()
    emit(iter([]), ["identity"], as_json=True, out=out)
    assert json.loads(out.getvalue()) == []


# -- reading heads ----------------------------------------------------------------------------------------
class CountingStore(ObjectStore):
    """A real store whose reads are counted; the first ``hold`` reads wait for each other at a barrier (so a
    test proves that many run at once, or times out), and the most reads in flight at once is recorded."""

    def __init__(self, inner: ObjectStore, *, hold: int = 0) -> None:
        self.inner = inner
        self.url = inner.url
        self.gets = 0
        self.most = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._hold = hold
        self._barrier = threading.Barrier(hold) if hold else None

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        with self._lock:
            self.gets += 1
            self._in_flight += 1
            self.most = max(self.most, self._in_flight)
            wait = self._barrier is not None and self.gets <= self._hold
        try:
            if wait:
                assert self._barrier is not None
                self._barrier.wait(timeout=20)
            return self.inner.get(key, max_bytes=max_bytes)
        finally:
            with self._lock:
                self._in_flight -= 1

    def put(self, key: str, data: bytes, **kwargs: Any) -> str:
        return self.inner.put(key, data, **kwargs)

    def upload_file(self, key: str, path: Path, **kwargs: Any) -> StoredFile:
        return self.inner.upload_file(key, path, **kwargs)

    def download_file(self, key: str, dest: Path, **kwargs: Any) -> None:
        self.inner.download_file(key, dest, **kwargs)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list_objects(prefix)

    def list_delimited(self, prefix: str, delimiter: str) -> Iterator[ObjectInfo | CommonPrefix]:
        return self.inner.list_delimited(prefix, delimiter)

    def delete(self, key: str, **kwargs: Any) -> None:
        self.inner.delete(key, **kwargs)


def many(store: ObjectStore, count: int, *, commits: int = 1) -> list[str]:
    keys = []
    for n in range(count):
        cs = CheckpointStore(store=store, identity=Identity.parse(f"fleet/job-{n:04d}"))
        lease = cs.acquire()
        for step in range(commits):
            cs.commit(lease, {"n": n, "step": step})
        cs.release(lease)
        keys.append(cs.identity.key)
    return keys


def test_ls_prints_its_first_row_before_the_last_head_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = many(LocalObjectStore(root=tmp_path / "state", fsync=False), 150)
    store = CountingStore(LocalObjectStore(root=tmp_path / "state", fsync=False))
    reads_at_first_write: list[int] = []

    class Terminal(io.StringIO):
        def write(self, text: str) -> int:
            if not reads_at_first_write:
                reads_at_first_write.append(store.gets)
            return super().write(text)

    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    assert cmd_ls(unsigned(build_parser().parse_args(["ls", "--json"])), store) == EXIT_OK
    assert [r["identity"] for r in json.loads(terminal.getvalue())] == keys
    assert store.gets == len(keys)
    assert 1 <= reads_at_first_write[0] <= 4 * HEAD_READERS + 1 < len(keys)


def test_heads_are_read_at_most_readers_at_once_and_come_back_in_key_order(tmp_path: Path) -> None:
    keys = many(LocalObjectStore(root=tmp_path / "state", fsync=False), 30)
    store = CountingStore(LocalObjectStore(root=tmp_path / "state", fsync=False), hold=3)
    reads = list(read_heads(store, list_identities(store), readers=3))
    assert [r.identity.key for r in reads] == keys
    assert all(r.head is not None and r.error is None for r in reads)
    assert store.most == 3, "three reads waited for each other at the barrier, and never more ran at once"


def test_ordered_map_delivers_what_came_before_a_failure_and_reads_only_a_little_ahead() -> None:
    pulled: list[int] = []

    def source() -> Iterator[int]:
        for n in range(1000):
            pulled.append(n)
            yield n

    results = ordered_map(lambda n: n * 2, source(), workers=2)
    assert next(results) == 0
    assert len(pulled) <= 4 * 2 + 1, "the source is consumed only a few items ahead"
    results.close()

    def failing() -> Iterator[int]:
        yield from range(5)
        raise CheckpointCorruptError("the listing failed")

    got: list[int] = []
    with pytest.raises(CheckpointCorruptError, match="listing failed"):
        for value in ordered_map(lambda n: n, failing(), workers=3):
            got.append(value)
    assert got == [0, 1, 2, 3, 4]

    def boom(n: int) -> int:
        if n == 3:
            raise ValueError(f"item {n}")
        return n

    got = []
    with pytest.raises(ValueError, match="item 3"):
        for value in ordered_map(boom, range(10), workers=4):
            got.append(value)
    assert got == [0, 1, 2]
    with pytest.raises(ValueError, match="at least 1"):
        ordered_map(boom, [], workers=0)


# -- the stores: one request per 1,000 identities -----------------------------------------------------------
def _count_requests(store: S3ObjectStore) -> dict[str, int]:
    counts: dict[str, int] = {}

    def count(model: Any, **_: Any) -> None:
        counts[model.name] = counts.get(model.name, 0) + 1

    store.client.meta.events.register("before-call.s3", count)
    return counts


@pytest.mark.s3
def test_on_s3_a_fleet_costs_one_listing_and_one_get_per_head_however_many_files(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    with s3_endpoint.store(s3_prefix) as s3:
        build_fleet(s3, tmp_path)
        expected = identities_by_walking(s3, "")
        counts = _count_requests(s3)
        reads = list(read_heads(s3, list_identities(s3)))
        assert counts == {"ListObjectsV2": 1, "GetObject": len(reads)}
        counts.clear()
        listing = collect(
            s3, prefixes=[""], may_read=lambda i: True, bounds=Bounds(), now=time.time(), signer=None
        )
        assert counts == {"ListObjectsV2": 1, "GetObject": len(reads)}, "the UI lists no data file either"
        assert [e.row["identity"] for e in listing.entries] == expected


@pytest.mark.s3
def test_s3_pages_of_a_delimited_listing_are_merged_in_key_order(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """Pages of two entries (S3's are 1,000): objects and prefixes of each page merged, none repeated."""
    with s3_endpoint.store(s3_prefix) as s3:
        build_fleet(s3, tmp_path)
        whole = list(s3.list_delimited("", "/~"))

        def small_pages(params: dict[str, Any], **_: Any) -> None:
            params["MaxKeys"] = 2

        s3.client.meta.events.register("before-parameter-build.s3.ListObjectsV2", small_pages)
        counts = _count_requests(s3)
        assert list(s3.list_delimited("", "/~")) == whole
        if s3_endpoint.kind != "seaweedfs":  # which pages such listings wrongly: it lists every key instead
            assert counts["ListObjectsV2"] == (len(whole) + 1) // 2
        assert whole == sorted(ObjectStore.list_delimited(s3, "", "/~"), key=entry_key)


def test_the_local_store_never_walks_a_folder_it_rolls_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = LocalObjectStore(root=tmp_path / "state", fsync=False)
    build_fleet(local, tmp_path)
    (tmp_path / "state" / "empty" / "job" / "~data" / "c1").mkdir(parents=True)  # a folder left with no file
    scanned: list[str] = []
    real_scandir = os.scandir

    def scandir(path: Any) -> Any:
        scanned.append(os.path.relpath(path, tmp_path / "state"))
        return real_scandir(path)

    monkeypatch.setattr(local_module.os, "scandir", scandir)
    found = [i.key for i in list_identities(local)]
    assert "empty/job" not in found, "an empty folder is no object, as on S3"
    # An identity's own folders are never read: its ~head.json beside them says they roll up. Only a folder
    # with no file beside it (the orphan's, the empty one) is read, and only down to its first file.
    walked = [p for p in scanned if any(p.startswith(f"{i.key}/~") for i in NESTED)]
    assert not walked and "orphan/job/~data/c1" in scanned, scanned


# -- du, verify --all and GC's plan ---------------------------------------------------------------------------
@pytest.mark.s3
def test_du_streams_rows_and_reports_a_corrupt_head_with_its_bytes(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_fleet(store, tmp_path)
    store.put(f"etl-x/job/{HEAD_NAME}", b"[]")
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    args = argparse.Namespace(
        prefix="",
        json=True,
        price_per_gb_month=0.023,
        idle_for=None,
        release_after_success=None,
        keep_failed_for=None,
        settings=StatefulSettings(backend_url=store.url),
        lease_grace=60.0,
        signer=None,
        out=None,
        exact_sizes=False,
    )
    assert cmd_du(args, store) == EXIT_PROBLEM
    rows = json.loads(out.getvalue())
    keys = [r["identity"] for r in rows]
    assert keys == [*sorted({*identities_by_walking(store, ""), "orphan/job"}), "TOTAL"]
    bad = rows[keys.index("etl-x/job")]
    assert "CheckpointCorruptError" in bad["error"] and bad["bytes"] > 0
    listed = [i for i in store.list_objects("") if not i.key.startswith("~")]
    library = [i for i in listed if "/~" in i.key and not i.key.startswith("bad~")]
    assert rows[-1]["bytes"] == sum(i.size for i in library)


def test_gc_plans_identities_in_parallel_in_key_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = many(LocalObjectStore(root=tmp_path / "state", fsync=False), 24, commits=3)
    store = CountingStore(LocalObjectStore(root=tmp_path / "state", fsync=False), hold=4)
    plan = plan_gc(store, keep_last=1, now=time.time())
    assert store.most >= 4, "several identities were planned at once"
    assert [p.identity for p in plan.identities] == keys, "every identity keeps too many, in key order"
    monkeypatch.setattr("airflow_stateful.core.fleet.gc_plan.HEAD_READERS", 1)
    serial = plan_gc(store, keep_last=1, now=plan.now)
    assert [(p.identity, p.reasons, p.keep) for p in plan.identities] == [
        (p.identity, p.reasons, p.keep) for p in serial.identities
    ]
