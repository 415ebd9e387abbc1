"""Packs (format 5): a tree of many small files is a few objects, restored by a few ranged GETs, deduplicated
across saves at chunk level, collected by GC pack by pack, and a damaged byte refuses only the chunk it is in.

Run on the local store and on SeaweedFS (a real S3 server the suite starts from the package index)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from maintenance import read_tree, tree
from test_cli import backend, cli, open_cs  # noqa: F401 - `backend` is a fixture used by the CLI tests

from airflow_stateful.core import CheckpointStore, Identity, collect_garbage
from airflow_stateful.core.data.packs import MAX_GAP, MAX_RANGE, PACK_BELOW, coalesce
from airflow_stateful.core.errors import CheckpointCorruptError, StoreError
from airflow_stateful.core.records.formats import PACKS_FORMAT
from airflow_stateful.core.records.trees import ChunkRef
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="parts", task_id="write", run_id="manual__2026-12-06T10:00:00+00:00")
KIB = 1024


@pytest.fixture(params=["local", "seaweedfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        with LocalObjectStore(root=tmp_path / "state") as local:
            yield local
        return
    endpoint = request.getfixturevalue("seaweedfs_endpoint")
    with endpoint.store(endpoint.new_prefix()) as s3:
        yield s3


class Calls:
    """The requests a store serves, counted by kind (wrapping the instance's own methods)."""

    def __init__(self, store: ObjectStore) -> None:
        self.puts: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []
        self.chunk_gets: list[str] = []
        put, get_range, get_chunk = store.put, store.get_range, store.get_chunk

        def counted_put(key: str, data: bytes, **kwargs: Any) -> str:
            self.puts.append(key)
            return put(key, data, **kwargs)

        def counted_range(key: str, *, offset: int, length: int) -> bytes:
            self.ranges.append((key, offset, length))
            return get_range(key, offset=offset, length=length)

        def counted_chunk(key: str, *, size: int) -> bytes:
            self.chunk_gets.append(key)
            return get_chunk(key, size=size)

        store.put = counted_put  # type: ignore[method-assign]
        store.get_range = counted_range  # type: ignore[method-assign]
        store.get_chunk = counted_chunk  # type: ignore[method-assign]


def small_files(root: Path, count: int, size: int = 4 * KIB) -> Path:
    return tree(root, {f"part={n // 100:03d}/f{n:05d}.bin": os.urandom(size) for n in range(count)})


def objects(store: ObjectStore) -> list[str]:
    return sorted(info.key for info in store.list_objects(f"{IDENTITY.key}/"))


def commit(cs: CheckpointStore, files: Path, value: Any) -> Any:
    lease = cs.acquire(steal=True)
    manifest = cs.commit(lease, value, files=files)
    cs.release(lease)
    return manifest


def test_many_small_files_are_a_few_objects_restored_by_a_few_ranged_gets(
    store: ObjectStore, tmp_path: Path
) -> None:
    src = small_files(tmp_path / "src", 2000)  # 8 MiB in 2,000 files
    calls = Calls(store)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    manifest = commit(cs, src, {"parts": 2000})
    assert manifest.format == PACKS_FORMAT
    packs = [k for k in objects(store) if "/~packs/" in k]
    assert len(packs) == 1, "8 MiB of small chunks fill less than one pack"
    assert len(objects(store)) <= 2000 // 100 + 3, objects(store)  # the pack, the tree, the head
    assert [k for k in calls.puts if "/~packs/" in k or "/~chunks/" in k] == packs, "one PUT for all the data"

    reader = CheckpointStore(store=store, identity=IDENTITY)
    latest = reader.latest()
    assert latest is not None
    calls = Calls(store)
    reader.restore_files(latest, tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(src)
    assert calls.chunk_gets == []
    assert len(calls.ranges) == -(-2000 * 4 * KIB // MAX_RANGE), calls.ranges  # no gaps: ranges of MAX_RANGE


def test_a_re_save_uploads_only_the_changed_files_into_one_new_pack(
    store: ObjectStore, tmp_path: Path
) -> None:
    src = small_files(tmp_path / "src", 300)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    first = commit(cs, src, {"n": 1})
    first_pack = {c.key for f in cs.tree(first).files for c in f.chunks}  # type: ignore[union-attr]
    changed = sorted(src.rglob("*.bin"))[:3]
    for path in changed:
        path.write_bytes(os.urandom(4 * KIB))
    calls = Calls(store)
    second = commit(cs, src, {"n": 2})
    data_puts = [k for k in calls.puts if "/~packs/" in k or "/~chunks/" in k]
    assert data_puts == [f"{IDENTITY.key}/~packs/{second.commit_id}-000000"], data_puts
    by_path = {f.path: f for f in cs.tree(second).files}  # type: ignore[union-attr]
    moved = {p.relative_to(src).as_posix() for p in changed}
    for path, entry in by_path.items():
        [chunk] = entry.chunks
        assert chunk.key == (data_puts[0] if path in moved else next(iter(first_pack))), path
    cs.restore_files(second, tmp_path / "out")
    assert read_tree(tmp_path / "out") == read_tree(src)


def test_gc_deletes_a_dead_pack_and_keeps_one_a_kept_checkpoint_still_needs(
    store: ObjectStore, tmp_path: Path
) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=1)
    src = small_files(tmp_path / "src", 100)
    first = commit(cs, src, {"n": 1})
    for path in src.rglob("*.bin"):  # every file changes: the first pack is needed by nobody once dropped
        path.write_bytes(os.urandom(4 * KIB))
    second = commit(cs, src, {"n": 2})
    for path in sorted(src.rglob("*.bin"))[:50]:  # half the files change: the second pack stays half live
        path.write_bytes(os.urandom(4 * KIB))
    third = commit(cs, src, {"n": 3})
    collect_garbage(cs, min_age=timedelta(0))
    packs = {k.rsplit("/", 1)[1] for k in objects(store) if "/~packs/" in k}
    assert packs == {f"{second.commit_id}-000000", f"{third.commit_id}-000000"}, (first.commit_id, packs)
    restored = tmp_path / "out"
    CheckpointStore(store=store, identity=IDENTITY).restore_files(third, restored)
    assert read_tree(restored) == read_tree(src)


def _flip_byte(store: ObjectStore, key: str, at: int) -> None:
    data = bytearray(store.get(key).data)
    data[at] ^= 0x40
    store.put(key, bytes(data))  # as anyone with write access to the bucket could


def test_a_damaged_byte_in_a_pack_refuses_that_chunk_only(store: ObjectStore, tmp_path: Path) -> None:
    src = small_files(tmp_path / "src", 50)
    cs = CheckpointStore(store=store, identity=IDENTITY)
    first = commit(cs, src, {"n": 1})
    victim = next(f for f in cs.tree(first).files if f.path.endswith("f00017.bin"))  # type: ignore[union-attr]
    [chunk] = victim.chunks
    assert chunk.offset is not None
    _flip_byte(store, chunk.key, chunk.offset + 100)

    reader = CheckpointStore(store=store, identity=IDENTITY)
    out = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError) as caught:
        reader.restore_files(first, out)
    message = str(caught.value)
    assert chunk.sha256 in message and f"offset {chunk.offset} of pack {chunk.key!r}" in message
    assert "Nothing was restored" in message
    assert not out.exists() or list(out.iterdir()) == [], "all or nothing: no file was moved into place"

    # A checkpoint of the same pack without that file restores whole: only the damaged chunk is refused.
    (src / victim.path).unlink()
    second = commit(cs, src, {"n": 2})
    assert {c.key for f in cs.tree(second).files for c in f.chunks} == {chunk.key}  # type: ignore[union-attr]
    reader.restore_files(second, tmp_path / "out2")
    assert read_tree(tmp_path / "out2") == read_tree(src)


def test_du_and_gc_dry_run_report_the_dead_bytes_left_in_kept_packs(
    backend: str,  # noqa: F811 - the fixture imported above
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """A pack half of whose files were rewritten stays (a kept checkpoint needs the other half): GC cannot free
    its dead half before repacking, and says how much that is, as `du --packs` does."""
    cs = open_cs(backend, IDENTITY)
    src = small_files(tmp_path / "src", 100)
    commit(cs, src, {"n": 1})
    for path in sorted(src.rglob("*.bin"))[:40]:
        path.write_bytes(os.urandom(4 * KIB))
    commit(cs, src, {"n": 2})
    packs = {i.key: i.size for i in cs.store.list_objects(f"{IDENTITY.key}/") if "/~packs/" in i.key}
    assert len(packs) == 2 and sorted(packs.values()) == [40 * 4 * KIB, 100 * 4 * KIB]

    code, out, _ = cli(capsys, backend, "gc", "--dry-run", "--keep-last", "1", "--min-age", "0s", "--json")
    assert code == 0, out
    [row] = [r for r in json.loads(out) if r["identity"] == IDENTITY.key]
    # After the pass only the second checkpoint is kept: 60 of the first pack's 100 files live on in it.
    assert (row["packs"], row["pack_bytes"], row["dead_pack_bytes"]) == (2, 140 * 4 * KIB, 40 * 4 * KIB), row
    code, out, _ = cli(capsys, backend, "gc", "--dry-run", "--min-age", "0s", "--json")
    [row] = [r for r in json.loads(out) if r["identity"] == IDENTITY.key]
    assert row["dead_pack_bytes"] == 0, "both checkpoints kept: every byte of both packs is needed"

    code, out, _ = cli(capsys, backend, "du", "--packs", "--json")
    assert code == 0, out
    rows = {r["identity"]: r for r in json.loads(out)}
    assert rows[IDENTITY.key]["dead_pack_bytes"] == 0
    code, out, _ = cli(capsys, backend, "du", "--json")
    assert "dead_pack_bytes" not in json.loads(out)[0], "without --packs no tree is read"
    code, out, _ = cli(capsys, backend, "du", "--packs")
    assert "DEAD_PACK_BYTES" in out.splitlines()[0].split()


def test_large_chunks_stay_objects_of_their_own(store: ObjectStore, tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"big.bin": os.urandom(PACK_BELOW), "small.txt": b"s"})
    cs = CheckpointStore(store=store, identity=IDENTITY)
    manifest = commit(cs, src, {"n": 1})
    chunks = {f.path: f.chunks for f in cs.tree(manifest).files}  # type: ignore[union-attr]
    assert [c.packed for c in chunks["big.bin"]] == [False]
    assert chunks["big.bin"][0].key.endswith(
        f"/~chunks/{hashlib.sha256((src / 'big.bin').read_bytes()).hexdigest()}"
    )
    assert [c.packed for c in chunks["small.txt"]] == [True]


# -- coalescing --------------------------------------------------------------------------------------------------
def _chunk(offset: int, size: int, key: str = "i/~packs/p") -> ChunkRef:
    return ChunkRef(key=key, sha256=f"{offset:064x}", size=size, offset=offset)


def test_neighbours_closer_than_the_gap_share_a_get_and_a_wide_gap_splits() -> None:
    chunks = [_chunk(0, 100), _chunk(100 + MAX_GAP, 100), _chunk(200 + 2 * MAX_GAP + 1, 100)]
    ranges = coalesce([(c, n) for n, c in enumerate(reversed(chunks))])  # any order in, offset order out
    assert [(r.offset, r.length) for r in ranges] == [(0, 200 + MAX_GAP), (200 + 2 * MAX_GAP + 1, 100)]
    assert [sorted(t for _, t in r.members) for r in ranges] == [[1, 2], [0]]


def test_a_get_never_exceeds_the_range_cap_and_packs_never_share_one() -> None:
    size = MAX_RANGE // 4
    chunks = [_chunk(n * size, size) for n in range(9)] + [_chunk(0, 10, key="i/~packs/q")]
    ranges = coalesce([(c, None) for c in chunks])
    assert all(r.length <= MAX_RANGE for r in ranges)
    assert sorted((r.key, r.offset, r.length) for r in ranges) == [
        ("i/~packs/p", 0, MAX_RANGE),
        ("i/~packs/p", MAX_RANGE, MAX_RANGE),
        ("i/~packs/p", 2 * MAX_RANGE, size),
        ("i/~packs/q", 0, 10),
    ]


def test_a_pack_lost_after_the_tree_was_written_leaves_the_last_checkpoint_and_only_garbage(
    tmp_path: Path,
) -> None:
    """The tree is written while the last packs are uploaded (issue 32): a pack whose upload fails after the
    tree landed must leave the head at the previous checkpoint, restore that one exactly, and leave only
    garbage that GC removes."""
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        src = small_files(tmp_path / "src", 200)
        first = commit(cs, src, {"n": 1})
        before = objects(store)
        for path in sorted(src.rglob("*.bin"))[:20]:
            path.write_bytes(os.urandom(4 * KIB))
        tree_written = threading.Event()
        put = store.put

        def failing_put(key: str, data: bytes, **kwargs: Any) -> str:
            if "/~packs/" in key:
                assert tree_written.wait(30), "the tree was not written while the pack was uploading"
                raise StoreError(f"injected: the PUT of {key} failed")
            etag = put(key, data, **kwargs)
            if "/~trees/" in key:
                tree_written.set()
            return etag

        store.put = failing_put  # type: ignore[method-assign]
        lease = cs.acquire(steal=True)
        with pytest.raises(StoreError, match="injected"):
            cs.commit(lease, {"n": 2}, files=src)
        store.put = put  # type: ignore[method-assign]
        cs.release(lease)
        fresh = CheckpointStore(store=store, identity=IDENTITY)
        latest = fresh.latest()
        assert latest is not None and latest.commit_id == first.commit_id
        assert latest.value == {"n": 1}
        assert any("/~trees/" in k for k in set(objects(store)) - set(before)), "the orphan tree is there"
        collect_garbage(fresh, min_age=timedelta(0))
        assert objects(store) == before
