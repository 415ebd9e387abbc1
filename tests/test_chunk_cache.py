"""The worker's restore cache (``core/data/chunk_cache.py``) on real stores: the local store, moto's S3 server,
real directories, several processes, and an Airflow retry under ``dag.test()``.

What a cache may change is how many chunks are downloaded, never the bytes a restore produces: every test
checks the restored files byte for byte, and counts the chunk GETs the store really received (a botocore
event on S3, a counting subclass of the local store) to show what the cache saved.

Faults are real where the machine allows it: a read-only directory (``chattr +i`` as root, mode 0500
otherwise), a full disk (a 3 MiB tmpfs mounted over the cache directory; root only, skipped otherwise), a
directory owned by another user (``chown``; root only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.data.chunk_cache import LocalChunkCache, restore_cache_for
from airflow_stateful.core.errors import ConfigurationError
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.trees import ChunkRef
from airflow_stateful.core.settings import RESTORE_CACHE_MAX_BYTES, StatefulSettings
from airflow_stateful.core.stores.base import Blob, ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

MIB = 1024 * 1024
IDENTITY = Identity.parse("cache_dag/train/run=r1/map=-1")
IS_ROOT = os.geteuid() == 0


# -- helpers -------------------------------------------------------------------------------------------------
Read = tuple[str, "int | None", "int | None"]
"""A read of chunk data: the key, and for a ranged read of a pack its offset and length."""


class CountingLocalStore(LocalObjectStore):
    """The real local store, counting the chunk reads it serves: whole chunk objects and ranges of packs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chunk_gets: list[Read] = []
        self._count_lock = threading.Lock()

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        if "/~chunks/" in key:
            with self._count_lock:
                self.chunk_gets.append((key, None, None))
        return super().get(key, max_bytes=max_bytes)

    def get_range(self, key: str, *, offset: int, length: int) -> bytes:
        with self._count_lock:
            self.chunk_gets.append((key, offset, length))
        return super().get_range(key, offset=offset, length=length)


def chunks_read(cs: CheckpointStore, manifest: Manifest, reads: list[Read]) -> set[str]:
    """The SHA-256 of every chunk of ``manifest`` whose bytes ``reads`` fetched from the store (a ranged read
    of a pack fetches every chunk inside its range)."""
    tree = cs.tree(manifest)
    assert tree is not None
    found = set()
    for chunk in (c for f in tree.files for c in f.chunks):
        for key, offset, length in reads:
            if key != chunk.key:
                continue
            if chunk.offset is None or (
                offset is not None
                and length is not None
                and offset <= chunk.offset
                and chunk.offset + chunk.size <= offset + length
            ):
                found.add(chunk.sha256)
    return found


@contextmanager
def s3_chunk_gets(store: Any) -> Iterator[list[Read]]:
    """The chunk GetObject requests (whole chunk objects, ranges of packs) ``store``'s boto3 client sends."""
    keys: list[Read] = []
    lock = threading.Lock()

    def record(params: dict[str, Any], **_: Any) -> None:
        key = params.get("Key", "")
        if "/~chunks/" in key or "/~packs/" in key:
            start, _, end = str(params.get("Range", "")).removeprefix("bytes=").partition("-")
            ranged = (
                (int(start), int(end) - int(start) + 1) if start.isdigit() and end.isdigit() else (None, None)
            )
            with lock:
                keys.append((key.removeprefix(f"{store.prefix}/") if store.prefix else key, *ranged))

    events = store.client.meta.events
    events.register("before-parameter-build.s3.GetObject", record)
    try:
        yield keys
    finally:
        events.unregister("before-parameter-build.s3.GetObject", record)


def write_tree(root: Path, *, big: int = 9 * MIB, small: int = 3, seed: int = 0) -> dict[str, str]:
    """A directory of one large file (several chunks) and a few small ones; their SHA-256 by relative path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(os.urandom(big))
    for n in range(small):
        (root / "shards").mkdir(exist_ok=True)
        (root / "shards" / f"s{n}.bin").write_bytes(os.urandom(64 * 1024 + n + seed))
    return digests(root)


def digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def commit(store: ObjectStore, files: Path) -> tuple[CheckpointStore, Manifest]:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    lease = cs.acquire(steal=True)
    manifest = cs.commit(lease, {"step": 1}, files=files)
    cs.release(lease)
    return cs, manifest


def chunk_count(cs: CheckpointStore, manifest: Manifest) -> int:
    tree = cs.tree(manifest)
    assert tree is not None
    return len({c.sha256 for f in tree.files for c in f.chunks})


def all_chunks(cs: CheckpointStore, manifest: Manifest) -> set[str]:
    tree = cs.tree(manifest)
    assert tree is not None
    return {c.sha256 for f in tree.files for c in f.chunks}


def cache_files(directory: Path) -> dict[str, Path]:
    """The chunk files in a cache directory, by name (temporary files and the lock excluded)."""
    return {p.name: p for p in directory.glob("??/*") if not p.name.startswith(".")}


def chunk_of(data: bytes) -> ChunkRef:
    sha = hashlib.sha256(data).hexdigest()
    return ChunkRef(key=f"{IDENTITY.key}/~chunks/{sha}", sha256=sha, size=len(data))


@pytest.fixture
def library_warnings(library_log: list[str]) -> list[str]:
    return library_log  # INFO and up; the cache's warnings are among them


# -- a retry's restore downloads no unchanged chunk -----------------------------------------------------------
def test_second_restore_on_s3_sends_no_chunk_get(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    store = s3_endpoint.store(s3_prefix)
    expected = write_tree(tmp_path / "src")
    cs, manifest = commit(store, tmp_path / "src")
    chunks = chunk_count(cs, manifest)
    assert chunks >= 4, "the test needs a checkpoint of several chunks"

    first = LocalChunkCache(directory=tmp_path / "cache")
    with s3_chunk_gets(store) as gets:
        cs.restore_files(manifest, tmp_path / "out1", cache=first)
    assert chunks_read(cs, manifest, gets) == all_chunks(cs, manifest), "a cold cache downloads every chunk"
    assert digests(tmp_path / "out1") == expected
    first.close()

    # The retry: a new process, so a new store object, a new CheckpointStore and a new cache object.
    retry_store = s3_endpoint.store(s3_prefix)
    retry = CheckpointStore(store=retry_store, identity=IDENTITY)
    cache = LocalChunkCache(directory=tmp_path / "cache")
    with s3_chunk_gets(retry_store) as gets:
        latest = retry.latest()
        assert latest is not None
        retry.restore_files(latest, tmp_path / "out2", cache=cache)
    assert gets == [], "every chunk came from the cache"
    assert cache.stats.hits == sum(len(f.chunks) for f in retry.tree(latest).files)  # type: ignore[union-attr]
    assert digests(tmp_path / "out2") == expected

    # Without the cache the same restore downloads everything (the counter sees GETs when there are any).
    with s3_chunk_gets(retry_store) as gets:
        retry.restore_files(latest, tmp_path / "out3")
    assert chunks_read(retry, latest, gets) == all_chunks(retry, latest)


def test_a_changed_checkpoint_downloads_only_its_new_chunks(tmp_path: Path) -> None:
    store = CountingLocalStore(root=tmp_path / "store")
    write_tree(tmp_path / "src")
    cs, first = commit(store, tmp_path / "src")
    cache = LocalChunkCache(directory=tmp_path / "cache")
    cs.restore_files(first, tmp_path / "out1", cache=cache)

    (tmp_path / "src" / "shards" / "s1.bin").write_bytes(os.urandom(70_000))  # one small file changes
    expected = digests(tmp_path / "src")
    _, second = commit(store, tmp_path / "src")
    store.chunk_gets.clear()
    cs.restore_files(second, tmp_path / "out2", cache=cache)
    assert len(chunks_read(cs, second, store.chunk_gets)) == 1, store.chunk_gets
    assert digests(tmp_path / "out2") == expected


# -- verified, never trusted ----------------------------------------------------------------------------------
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _swap_for_a_link(path: Path) -> None:
    other = next(p for p in path.parent.parent.glob("??/*") if p != path and not p.name.startswith("."))
    path.unlink()
    path.symlink_to(other)


@pytest.mark.parametrize(
    "damage", [_flip, _truncate, _swap_for_a_link], ids=["flipped-byte", "truncated", "link"]
)
def test_a_damaged_cache_file_is_discarded_and_the_chunk_downloaded(
    damage: Any, tmp_path: Path, library_warnings: list[str]
) -> None:
    store = CountingLocalStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src")
    cs, manifest = commit(store, tmp_path / "src")
    cs.restore_files(manifest, tmp_path / "out1", cache=LocalChunkCache(directory=tmp_path / "cache"))
    files = cache_files(tmp_path / "cache")
    victim_name, victim = sorted(files.items())[0]
    damage(victim)

    store.chunk_gets.clear()
    cache = LocalChunkCache(directory=tmp_path / "cache")
    cs.restore_files(manifest, tmp_path / "out2", cache=cache)
    assert digests(tmp_path / "out2") == expected, "restored bytes are always right"
    assert chunks_read(cs, manifest, store.chunk_gets) == {victim_name}, "only the bad chunk downloaded"
    assert cache.stats.discarded == 1
    assert any("is not that chunk" in m for m in library_warnings)
    # The bad file was replaced by the downloaded, verified chunk.
    assert not victim.is_symlink()
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == victim_name


def test_get_never_returns_bytes_that_do_not_match(tmp_path: Path) -> None:
    cache = LocalChunkCache(directory=tmp_path / "cache")
    good = os.urandom(1000)
    chunk = chunk_of(good)
    cache.put(chunk, good)
    assert cache.get(chunk) == good
    # Same name, same size, other bytes (what a tampering process with this user's rights could write).
    path = cache_files(tmp_path / "cache")[chunk.sha256]
    path.write_bytes(os.urandom(1000))
    assert cache.get(chunk) is None
    assert not path.exists()
    # A chunk the cache never saw, and a ChunkRef whose "sha256" is not a hash (never used as a path).
    assert cache.get(chunk_of(b"other")) is None
    assert cache.get(ChunkRef(key="x", sha256="../../etc/passwd", size=3)) is None


# -- size cap, least recently used ----------------------------------------------------------------------------
def test_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = LocalChunkCache(directory=tmp_path / "cache", max_bytes=10 * MIB)
    blobs = [os.urandom(2 * MIB) for _ in range(4)]
    chunks = [chunk_of(b) for b in blobs]
    for chunk, data in zip(chunks, blobs, strict=True):
        cache.put(chunk, data)
        time.sleep(0.02)  # file times have the kernel clock's granularity (a few ms)
    assert cache.get(chunks[0]) == blobs[0], "a hit makes chunk 0 the most recently used"
    time.sleep(0.02)
    more = [os.urandom(2 * MIB) for _ in range(2)]
    for data in more:
        cache.put(chunk_of(data), data)
        time.sleep(0.02)
    kept = cache_files(tmp_path / "cache")
    assert sum(p.stat().st_size for p in kept.values()) <= 10 * MIB
    assert chunks[0].sha256 in kept, "recently used: kept"
    assert chunks[1].sha256 not in kept, "least recently used: evicted first"
    assert all(chunk_of(d).sha256 in kept for d in more), "what was just added stays"
    assert cache.stats.evicted >= 1


def test_restores_larger_than_the_cap_stay_within_it(tmp_path: Path) -> None:
    store = LocalObjectStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src", big=12 * MIB)
    cs, manifest = commit(store, tmp_path / "src")
    cap = 5 * MIB
    for n in range(2):
        cache = LocalChunkCache(directory=tmp_path / "cache", max_bytes=cap)
        cs.restore_files(manifest, tmp_path / f"out{n}", cache=cache)
        assert digests(tmp_path / f"out{n}") == expected
        assert cache.stats.evicted > 0
        total = sum(p.stat().st_size for p in cache_files(tmp_path / "cache").values())
        # Between two scans a process may pass the cap by an eighth of it plus one chunk (4 MiB at most).
        assert 0 < total <= cap + cap // 8 + 4 * MIB
    cache.trim()
    assert 0 < sum(p.stat().st_size for p in cache_files(tmp_path / "cache").values()) <= cap


# -- several processes ----------------------------------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.data.chunk_cache import LocalChunkCache
    from airflow_stateful.core.stores.local import LocalObjectStore

    store_root, cache_dir, cap, out, rounds = sys.argv[1:6]
    cs = CheckpointStore(store=LocalObjectStore(root=store_root), identity=Identity.parse({identity!r}))
    manifest = cs.latest()
    results = []
    cache = LocalChunkCache(directory=cache_dir, max_bytes=int(cap))
    for n in range(int(rounds)):
        dest = Path(out) / str(n)
        cs.restore_files(manifest, dest, cache=cache)
        results.append({{
            p.relative_to(dest).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(dest.rglob("*")) if p.is_file()
        }})
    print(json.dumps({{"results": results, "stats": cache.stats.__dict__}}))
    """
).format(identity=IDENTITY.key)


@pytest.mark.parametrize("cap_mib", [12, 96], ids=["evicting", "roomy"])
def test_two_processes_sharing_the_cache_restore_correctly(cap_mib: int, tmp_path: Path) -> None:
    """Both restore the same checkpoint at once, several times, through one cache directory; with a cap
    below the checkpoint's size they also evict each other's files while the other reads."""
    store = LocalObjectStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src", big=32 * MIB, small=20)
    commit(store, tmp_path / "src")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(tmp_path / "store"),
                str(tmp_path / "cache"),
                str(cap_mib * MIB),
                str(tmp_path / f"p{n}"),
                "6",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    for report in reports:
        assert all(result == expected for result in report["results"])
        # Atomic writes: no process ever read a partial or foreign file.
        assert report["stats"]["discarded"] == 0, report["stats"]
    for name, path in cache_files(tmp_path / "cache").items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == name
    assert not list((tmp_path / "cache").glob("??/.tmp-*")), "no temporary file left behind"
    if cap_mib == 96:
        assert sum(r["stats"]["hits"] for r in reports) > 0


HAMMER = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from airflow_stateful.core.data.chunk_cache import LocalChunkCache
    from airflow_stateful.core.records.trees import ChunkRef

    role, cache_dir, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    blobs = [hashlib.sha256(str(n).encode()).digest() * 32768 for n in range(8)]  # 1 MiB each
    chunks = [ChunkRef(key="k", sha256=hashlib.sha256(b).hexdigest(), size=len(b)) for b in blobs]
    cache = LocalChunkCache(directory=cache_dir, max_bytes=64 * 1024 * 1024)
    ops = wrong = missing = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for chunk, data in zip(chunks, blobs):
            if role == "writer":
                cache.put(chunk, data)
            else:
                got = cache.get(chunk)
                missing += got is None
                wrong += got is not None and got != data
            ops += 1
    print(json.dumps({"ops": ops, "wrong": wrong, "missing": missing, "stats": cache.stats.__dict__}))
    """
)


def test_readers_never_see_a_partial_file_while_another_process_writes(tmp_path: Path) -> None:
    """One process rewrites the same chunks over and over while another reads them: every read finds a whole,
    verified file (temporary file + rename), never a partial one it would have to discard."""
    script = tmp_path / "hammer.py"
    script.write_text(HAMMER)
    warm = subprocess.run(
        [sys.executable, str(script), "writer", str(tmp_path / "cache"), "0.01"],
        capture_output=True,
        text=True,
    )
    assert warm.returncode == 0, warm.stderr
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), role, str(tmp_path / "cache"), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("writer", "reader")
    ]
    writer, reader = (json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs)
    assert writer["ops"] > 100 and reader["ops"] > 100, (writer, reader)
    assert reader["missing"] == 0 and reader["wrong"] == 0, reader
    assert reader["stats"]["discarded"] == 0 and writer["stats"]["discarded"] == 0


# -- a cache that cannot work never fails a restore -----------------------------------------------------------
@contextmanager
def read_only(directories: list[Path]) -> Iterator[None]:
    """Directories nobody can add files to (root included: as root, ``chattr +i``)."""
    names = [str(d) for d in directories]
    if IS_ROOT:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", *names]).returncode:
            pytest.skip("running as root and chattr +i is not available: cannot make a directory read-only")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", *names], check=True)
    else:
        for d in directories:
            d.chmod(0o500)
        try:
            yield
        finally:
            for d in directories:
                d.chmod(0o700)


def test_a_read_only_cache_still_serves_hits_and_never_fails_the_restore(
    tmp_path: Path, library_warnings: list[str]
) -> None:
    store = CountingLocalStore(root=tmp_path / "store")
    write_tree(tmp_path / "src")
    cs, first = commit(store, tmp_path / "src")
    cs.restore_files(first, tmp_path / "out1", cache=LocalChunkCache(directory=tmp_path / "cache"))
    (tmp_path / "src" / "weights.bin").write_bytes(os.urandom(5 * MIB))  # new chunks: the cache lacks them
    expected = digests(tmp_path / "src")
    _, second = commit(store, tmp_path / "src")
    cache_root = tmp_path / "cache"
    store.chunk_gets.clear()
    cache = LocalChunkCache(directory=cache_root)
    with read_only([cache_root, *cache_root.glob("??")]):
        cs.restore_files(second, tmp_path / "out2", cache=cache)
    assert digests(tmp_path / "out2") == expected
    assert cache.stats.hits >= 3, "the unchanged small files still came from the cache"
    assert store.chunk_gets, "the new chunks were downloaded"
    assert any("could not write to it" in m for m in library_warnings), library_warnings
    assert sum("could not write to it" in m for m in library_warnings) == 1, "warned once, not per chunk"


def test_a_full_disk_never_fails_the_restore(tmp_path: Path, library_warnings: list[str]) -> None:
    cache_root = tmp_path / "cache"
    cache_root.mkdir(mode=0o700)
    if (
        not IS_ROOT
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(cache_root)], capture_output=True
        ).returncode
    ):
        pytest.skip("needs root and mount to put the cache on a small tmpfs (a real full disk)")
    try:
        store = CountingLocalStore(root=tmp_path / "store")
        expected = write_tree(tmp_path / "src", big=12 * MIB)
        cs, manifest = commit(store, tmp_path / "src")
        cache = LocalChunkCache(directory=cache_root)  # 2 GiB cap: only the disk limits it
        cs.restore_files(manifest, tmp_path / "out", cache=cache)
        assert digests(tmp_path / "out") == expected
        assert chunks_read(cs, manifest, store.chunk_gets) == all_chunks(cs, manifest)
        assert any("No space left on device" in m for m in library_warnings), library_warnings
        assert not list(cache_root.glob("??/.tmp-*")), "a failed write leaves no temporary file"
    finally:
        subprocess.run(["umount", "-l", str(cache_root)], check=False)


def test_a_cache_dir_that_cannot_be_created_is_skipped(tmp_path: Path, library_warnings: list[str]) -> None:
    store = LocalObjectStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src")
    cs, manifest = commit(store, tmp_path / "src")
    (tmp_path / "a-file").write_text("not a directory")
    cache = LocalChunkCache(directory=tmp_path / "a-file" / "cache")
    cs.restore_files(manifest, tmp_path / "out", cache=cache)
    assert digests(tmp_path / "out") == expected
    assert not cache.usable
    assert any("not used" in m for m in library_warnings)


# -- whose directory ------------------------------------------------------------------------------------------
def test_a_symlinked_cache_dir_is_refused(tmp_path: Path, library_warnings: list[str]) -> None:
    store = CountingLocalStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src")
    cs, manifest = commit(store, tmp_path / "src")
    target = tmp_path / "somewhere-else"
    target.mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(target)
    cache = LocalChunkCache(directory=tmp_path / "cache")
    cs.restore_files(manifest, tmp_path / "out", cache=cache)
    assert digests(tmp_path / "out") == expected, "the restore works, without the cache"
    assert list(target.iterdir()) == [], "nothing was written through the link"
    assert chunks_read(cs, manifest, store.chunk_gets) == all_chunks(cs, manifest)
    assert any("symbolic link" in m and "not used" in m for m in library_warnings), library_warnings


@pytest.mark.skipif(not IS_ROOT, reason="making a directory owned by another user needs root")
def test_a_cache_dir_owned_by_another_user_is_refused(tmp_path: Path, library_warnings: list[str]) -> None:
    store = LocalObjectStore(root=tmp_path / "store")
    expected = write_tree(tmp_path / "src")
    cs, manifest = commit(store, tmp_path / "src")
    planted = tmp_path / "cache"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # "nobody" planted it in a shared temp dir
    cache = LocalChunkCache(directory=planted)
    cs.restore_files(manifest, tmp_path / "out", cache=cache)
    assert digests(tmp_path / "out") == expected
    assert list(planted.iterdir()) == []
    assert any("owned by uid 65534" in m for m in library_warnings), library_warnings


def test_the_cache_dir_is_private(tmp_path: Path) -> None:
    loose = tmp_path / "cache"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    cache = LocalChunkCache(directory=loose)
    data = os.urandom(100)
    cache.put(chunk_of(data), data)
    assert oct(loose.stat().st_mode & 0o777) == oct(0o700), "an existing directory of ours is made 0700"
    [path] = cache_files(loose).values()
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    fresh = LocalChunkCache(directory=tmp_path / "new" / "cache")
    assert fresh.usable
    assert oct((tmp_path / "new" / "cache").stat().st_mode & 0o777) == oct(0o700)


# -- configuration --------------------------------------------------------------------------------------------
def settings(**options: str) -> StatefulSettings:
    return StatefulSettings.from_options(options.get, default_backend_url="file:///tmp/x")


def test_config_defaults_and_turning_it_off(tmp_path: Path) -> None:
    import tempfile

    default = settings()
    assert default.restore_cache_dir == str(
        Path(tempfile.gettempdir()) / f"airflow-stateful-cache-{os.geteuid()}"
    )
    assert default.restore_cache_max_bytes == RESTORE_CACHE_MAX_BYTES == 2 * 1024**3
    cache = restore_cache_for(default)
    assert cache is not None and cache.max_bytes == RESTORE_CACHE_MAX_BYTES
    assert restore_cache_for(settings(restore_cache_dir="")) is None, "an empty value turns it off"
    assert restore_cache_for(settings(restore_cache_max_bytes="0")) is None
    custom = restore_cache_for(settings(restore_cache_dir=str(tmp_path), restore_cache_max_bytes="1048576"))
    assert custom is not None and custom.directory == tmp_path and custom.max_bytes == MIB
    with pytest.raises(ConfigurationError, match="absolute path"):
        settings(restore_cache_dir="relative/cache")
    with pytest.raises(ConfigurationError, match="restore_cache_max_bytes must be an integer"):
        settings(restore_cache_max_bytes="2GiB")


def test_provider_documents_the_options() -> None:
    from airflow_stateful.get_provider_info import get_provider_info

    options = get_provider_info()["config"]["stateful"]["options"]
    assert options["restore_cache_dir"]["default"] is None, (
        "unset must differ from empty (which turns it off)"
    )
    assert options["restore_cache_max_bytes"]["default"] == str(RESTORE_CACHE_MAX_BYTES)


# -- TaskState fills the cache when it saves ------------------------------------------------------------------
def test_task_state_saves_fill_the_cache_and_a_retry_restores_from_it(tmp_path: Path) -> None:
    from airflow_stateful.core import WriterInfo
    from airflow_stateful.core.protocol.session import WriterSession
    from airflow_stateful.task_state import TaskState

    store = CountingLocalStore(root=tmp_path / "store")

    def open_state(try_number: int) -> TaskState:
        session = WriterSession(
            checkpoints=CheckpointStore(store=store, identity=IDENTITY),
            writer=WriterInfo(try_number=try_number),
            heartbeat=False,
            steal=True,
        ).open()
        return TaskState(session=session, restore_cache=LocalChunkCache(directory=tmp_path / "cache"))

    first = open_state(1)
    write_tree(tmp_path / "sync")
    first.save({"epoch": 1}, files=tmp_path / "sync")
    expected = write_tree(tmp_path / "background", seed=1)
    first.save({"epoch": 2}, files=tmp_path / "background", wait=False).wait()

    store.chunk_gets.clear()
    retry = open_state(2)
    retry.restore_files(tmp_path / "out")
    assert digests(tmp_path / "out") == expected
    assert store.chunk_gets == [], "the retry downloaded no chunk: the saves filled the cache"


# -- Airflow: a retry on the same worker ----------------------------------------------------------------------
RETRY_DAG = """\
from __future__ import annotations

import hashlib
import os
import tempfile
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

LEDGER = Path(__LEDGER__)


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(task_id="train", retries=1, retry_delay=timedelta(0))
    def train(state: TaskState):
        try_number = get_current_context()["ti"].try_number
        with tempfile.TemporaryDirectory() as scratch:  # like a new process: nothing local survives the try
            model = Path(scratch) / "model"
            if state.value is None:
                model.mkdir()
                (model / "weights.bin").write_bytes(os.urandom(6 * 1024 * 1024))
                (model / "config.json").write_text("{}")
                state.save({"epoch": 1}, files=model)
                event = "saved"
            else:
                state.restore_files(model)
                event = "restored"
            with open(LEDGER, "a") as ledger:
                for path in sorted(model.rglob("*")):
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                    ledger.write(f"{try_number} {event} {path.name} {digest}\\n")
        if try_number == 1:
            raise RuntimeError("simulated crash after the save")
        return "done"

    train()


dag_object = the_dag()
"""


@pytest.mark.airflow
@pytest.mark.parametrize("cache_on", [True, False], ids=["cache", "no-cache"])
def test_airflow_retry_on_the_same_worker_restores_from_the_cache(
    cache_on: bool,
    dags_folder: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    library_log: list[str],
) -> None:
    from dag_helpers import find_dag, load_dag_module

    cache_dir = tmp_path / "worker-cache"
    monkeypatch.setenv("AIRFLOW__STATEFUL__RESTORE_CACHE_DIR", str(cache_dir) if cache_on else "")
    gets: list[str] = []
    fetched = [0]  # bytes of chunk data read from the store
    real_get, real_get_range = LocalObjectStore.get, LocalObjectStore.get_range

    def counting_get(self: LocalObjectStore, key: str, *, max_bytes: int | None = None) -> Blob:
        blob = real_get(self, key, max_bytes=max_bytes)
        if "/~chunks/" in key:
            gets.append(key)
            fetched[0] += len(blob.data)
        return blob

    def counting_range(self: LocalObjectStore, key: str, *, offset: int, length: int) -> bytes:
        data = real_get_range(self, key, offset=offset, length=length)
        gets.append(key)  # a run of packed chunks
        fetched[0] += len(data)
        return data

    # dag.test() runs every try in this process
    monkeypatch.setattr(LocalObjectStore, "get", counting_get)
    monkeypatch.setattr(LocalObjectStore, "get_range", counting_range)
    dag_id = f"cache_{uuid.uuid4().hex[:10]}"
    ledger = tmp_path / "ledger"
    path = dags_folder / f"{dag_id}.py"
    path.write_text(RETRY_DAG.replace("__LEDGER__", repr(str(ledger))).replace("__DAG_ID__", dag_id))
    run = find_dag(load_dag_module(path)).test()

    assert run.state == "success"
    rows = [line.split() for line in ledger.read_text().splitlines()]
    saved = {name: digest for try_number, event, name, digest in rows if event == "saved"}
    restored = {name: digest for try_number, event, name, digest in rows if event == "restored"}
    assert {r[0] for r in rows if r[1] == "restored"} == {"2"}
    assert restored == saved and len(saved) == 2, "the retry restored the bytes try 1 saved"
    if cache_on:
        assert gets == [], "try 2 took every chunk from the worker's cache"
        assert cache_files(cache_dir), "try 1's save filled the cache"
        assert any("from the restore cache" in m and "0 chunk(s) downloaded" in m for m in library_log)
    else:
        assert fetched[0] >= 6 * 1024 * 1024 + 2, "without the cache try 2 downloads every byte"
        assert not cache_dir.exists()


def test_a_commit_keeps_the_chunks_it_uploads_from_memory_and_skips_what_the_cache_cannot_hold(
    tmp_path: Path,
) -> None:
    """The writer's uploads fill the cache as they go (no second read of the files); a checkpoint larger than
    the cache's cap fills nothing (each chunk would be evicted before a restore reached it)."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.bin").write_bytes(os.urandom(300_000))
    (files / "b.bin").write_bytes(os.urandom(200_000))
    store = LocalObjectStore(root=tmp_path / "state", fsync=False)

    cs = CheckpointStore(store=store, identity=Identity.parse("fill/from-upload"))
    cs.chunk_cache = cache = LocalChunkCache(directory=tmp_path / "cache")
    manifest = cs.commit(cs.acquire(), {"step": 1}, files=files)
    tree = cs.tree(manifest)
    assert tree is not None
    chunks = [c for f in tree.files for c in f.chunks]
    assert cache.stats.stored == len(chunks) == 2
    assert all(cache.get(c) is not None for c in chunks)

    small = CheckpointStore(store=store, identity=Identity.parse("fill/too-big"))
    small.chunk_cache = tiny = LocalChunkCache(directory=tmp_path / "tiny", max_bytes=400_000)
    small.commit(small.acquire(), {"step": 1}, files=files)
    assert tiny.stats.stored == 0


# -- what someone writing the cache as the same user can plant (issue 23, LOW 6) -------------------------------
def _chunk(data: bytes) -> ChunkRef:
    sha = hashlib.sha256(data).hexdigest()
    return ChunkRef(key=f"{IDENTITY.key}/~chunks/{sha}", sha256=sha, size=len(data))


def test_a_fifo_planted_at_a_chunks_name_costs_a_download_not_a_hang(
    tmp_path: Path, library_warnings: list[str]
) -> None:
    cache = LocalChunkCache(directory=tmp_path / "cache", max_bytes=10 * MIB)
    chunk = _chunk(b"chunk bytes" * 100)
    cache.put(_chunk(b"another"), b"another")  # opens the directory
    fanout = tmp_path / "cache" / chunk.sha256[:2]
    fanout.mkdir(mode=0o700, exist_ok=True)
    os.mkfifo(fanout / chunk.sha256)
    answer: list[Any] = []
    reader = threading.Thread(target=lambda: answer.append(cache.get(chunk)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        # Unblock the hung open (a writer on the FIFO), so the thread ends with the test.
        os.close(os.open(fanout / chunk.sha256, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("get() hung on a FIFO planted in the cache")
    assert answer == [None], "a miss: the chunk is downloaded"
    assert not (fanout / chunk.sha256).exists(), "the FIFO was discarded"
    assert any("not a regular file" in w for w in library_warnings)


def test_a_fanout_directory_that_is_a_link_is_never_written_through_or_read(tmp_path: Path) -> None:
    """Chunk bytes are as sensitive as the checkpoint: a fan-out directory replaced by a link to a directory
    the planter can read must not receive them, and what that directory holds must not be served."""
    cache = LocalChunkCache(directory=tmp_path / "cache", max_bytes=10 * MIB)
    data = b"secret model weights" * 100
    chunk = _chunk(data)
    cache.put(_chunk(b"another"), b"another")  # opens the directory
    fanout = tmp_path / "cache" / chunk.sha256[:2]
    planted, empty = tmp_path / "planted", tmp_path / "empty"
    planted.mkdir()
    empty.mkdir()
    (planted / chunk.sha256).write_bytes(data)  # with the right bytes, even
    fanout.symlink_to(planted)
    assert cache.get(chunk) is None, "nothing is read through the link"
    assert not fanout.is_symlink(), "the link was discarded"
    assert (planted / chunk.sha256).read_bytes() == data, "the link's target is left alone"
    fanout.symlink_to(empty)
    cache.put(chunk, data)
    assert list(empty.iterdir()) == [], "nothing was written through the link"
    # The cache goes on working: the link was replaced by a private directory of its own.
    assert not fanout.is_symlink() and (os.stat(fanout).st_mode & 0o777) == 0o700
    assert cache.get(chunk) == data


def test_a_fanout_directory_open_to_others_is_not_used(tmp_path: Path) -> None:
    cache = LocalChunkCache(directory=tmp_path / "cache", max_bytes=10 * MIB)
    data = b"x" * 1000
    chunk = _chunk(data)
    cache.put(chunk, data)
    fanout = tmp_path / "cache" / chunk.sha256[:2]
    fanout.chmod(0o777)
    assert cache.get(chunk) is None, "a directory others may write is not trusted"
