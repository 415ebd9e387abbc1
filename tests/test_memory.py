"""A large file, and a tree of many small ones, round-trip through CheckpointStore with bounded memory.

Checkpoints of many GiB must fit in a small pod, so commit and restore stream: files are cut into chunks of
at most 4 MiB and a save holds at most ``transfer.MAX_SAVE_IN_FLIGHT`` (20 MiB: two 8 MiB packs and a chunk)
of chunk data, loose chunks of large files within ``MAX_IN_FLIGHT`` (12 MiB) of it; a restore
``MAX_RESTORE_IN_FLIGHT`` (32 MiB), whatever the file size, the number of files or the store. The measurement runs in a fresh interpreter so earlier tests do not
pollute its peak RSS; moto's server, which holds the uploaded bytes, runs in its own process too.

Two figures are checked:

* peak RSS growth, what a pod's memory limit sees, must stay within the documented 64 MiB (glibc's
  per-thread arenas and its moving mmap threshold keep some freed memory, so RSS is above the live bytes);
* the peak of live Python allocations (tracemalloc), the library's own buffering, which must stay within the
  documented in-flight bound: ``MAX_IN_FLIGHT`` (a large file: its chunks are never packed) or
  ``MAX_SAVE_IN_FLIGHT`` (small files, packed) plus the chunker's window plus the chunk being hashed (a
  restore: ``MAX_RESTORE_IN_FLIGHT`` plus one chunk). Packs are filled in anonymous mappings, which
  tracemalloc does not see: RSS is what bounds them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core.data.chunking import MAX_CHUNK, MIN_CHUNK, WINDOW
from airflow_stateful.core.data.download import MAX_RESTORE_IN_FLIGHT
from airflow_stateful.core.data.packs import PACK_TARGET
from airflow_stateful.core.data.transfer import MAX_IN_FLIGHT, MAX_SAVE_IN_FLIGHT

pytestmark = [pytest.mark.slow, pytest.mark.s3]

MIB = 1024 * 1024
FILE_SIZE = 256 * MIB
SMALL_FILES, SMALL_SIZE = 2048, 32 * 1024  # 64 MiB in 2,048 files: every one packed (8 packs)
SLACK = 8 * MIB
RSS_BOUND = 64 * MIB
REPO = Path(__file__).resolve().parent.parent

# argv: store kind ("local" or "s3"), shape ("big": one file of that size; "small": that many files of 32 KiB),
# size, work dir. S3 settings come in STATEFUL_MEM_S3 (JSON), so
# credentials of a real endpoint never show in a process listing.
CHILD = r"""
import gc, hashlib, json, os, sys, threading, time, tracemalloc
from pathlib import Path

import psutil

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.s3 import S3ObjectStore

kind, shape, size, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
proc = psutil.Process()
MIB = 1024 * 1024


def sha256_of(root):  # one digest of every file's path and bytes under root
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(MIB):
                digest.update(chunk)
    return digest.hexdigest()


# Random bytes (incompressible, no repeated parts): one file written 1 MiB at a time, or many small ones.
src = work / "src"
src.mkdir()
if shape == "big":
    with open(src / "big.bin", "wb") as fh:
        for _ in range(size // MIB):
            fh.write(os.urandom(MIB))
else:
    for i in range(size):
        part = src / f"part={i // 256:03d}"
        part.mkdir(exist_ok=True)
        (part / f"{i:05d}.bin").write_bytes(os.urandom(32 * 1024))
expected = sha256_of(src)

if kind == "s3":
    s3 = json.loads(os.environ["STATEFUL_MEM_S3"])
    store = S3ObjectStore(bucket=s3.pop("bucket"), prefix=s3.pop("prefix"), **s3)  # library defaults
    settings = {"part_size": store.part_size, "max_concurrency": store.max_concurrency}
else:
    store = LocalObjectStore(root=work / "state")
    settings = {}
cs = CheckpointStore(store=store, identity=Identity.for_task(dag_id="mem", task_id="big", name="round-trip"))
lease = cs.acquire()
cs.commit(lease, {"warm": True})  # first requests (client, connection pool) before the baseline
assert cs.latest() is not None

gc.collect()
# Reset the kernel's peak-RSS mark (VmHWM) so it covers only what follows; sampling is the fallback.
try:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    hwm_reset = True
except OSError:
    hwm_reset = False
baseline = proc.memory_info().rss
peak = baseline
done = threading.Event()


def sample():
    global peak
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.01)


sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
manifest = cs.commit(lease, {"shape": shape}, files=src)
mid = proc.memory_info().rss
restored = cs.restore_files(cs.latest(), work / "dest")
done.set()
sampler.join()
peak = max(peak, mid, proc.memory_info().rss)

hwm = None
if hwm_reset:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024

# The same files again: every chunk is already kept, so nothing is uploaded. Once the files have settled
# (file_index.RACY_SECONDS) the tree also records their status; a third save of the same files is then the
# very same tree.
from airflow_stateful.core.data import file_index
newest = max(p.stat().st_mtime for p in src.rglob("*") if p.is_file())
time.sleep(max(0.0, newest + file_index.RACY_SECONDS + 0.2 - time.time()))
again = cs.commit(lease, {"shape": shape, "again": True}, files=src)
third = cs.commit(lease, {"shape": shape, "again": 2}, files=src)

# A second round trip under tracemalloc (which perturbs RSS, hence not during the first): the peak of
# live Python allocations, i.e. the library's own buffers, independent of the allocator. It goes to a new
# identity so every chunk is uploaded again.
cs2 = CheckpointStore(store=store, identity=Identity.for_task(dag_id="mem", task_id="big", name="traced"))
lease2 = cs2.acquire()
tracemalloc.start(1)
second = cs2.commit(lease2, {"shape": shape, "round": 2}, files=src)
traced_commit = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
cs2.restore_files(second, work / "dest2")
traced_restore = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()

print(json.dumps({
    "kind": kind,
    "shape": shape,
    "settings": settings,
    "baseline_rss": baseline,
    "sampled_peak_rss": peak,
    "hwm_rss": hwm,
    "traced_commit": traced_commit,
    "traced_restore": traced_restore,
    "committed_size": manifest.total_size,
    "restored": len(restored),
    "expected_sha256": expected,
    "restored_sha256": sha256_of(work / "dest"),
    "recorded_size": sum(f.size for f in cs.files(manifest)),
    "again_same_files": [(f.path, f.size, f.chunks, f.mode) for f in cs.content.tree(again).files]
    == [(f.path, f.size, f.chunks, f.mode) for f in cs.content.tree(manifest).files],
    "again_all_seen": all(f.seen is not None for f in cs.content.tree(again).files),
    "third_same_tree": third.tree == again.tree,
    "chunk_objects": len([o for o in store.list_objects("") if "/~chunks/" in o.key]),
    "pack_objects": len([o for o in store.list_objects("") if "/~packs/" in o.key]),
    "second_sha256": sha256_of(work / "dest2"),
}))
"""


def measure(kind: str, work: Path, s3: dict[str, Any] | None = None, *, shape: str = "big") -> dict[str, Any]:
    env = dict(os.environ)
    if s3 is not None:
        env["STATEFUL_MEM_S3"] = json.dumps(s3)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            kind,
            shape,
            str(FILE_SIZE if shape == "big" else SMALL_FILES),
            str(work),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, f"measurement failed ({proc.returncode}):\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(result: dict[str, Any]) -> None:
    # Correctness first: the bytes that came back are the bytes that went in.
    big = result["shape"] == "big"
    total = FILE_SIZE if big else SMALL_FILES * SMALL_SIZE
    assert result["committed_size"] == total
    assert result["restored"] == (1 if big else SMALL_FILES)
    assert result["restored_sha256"] == result["expected_sha256"]
    assert result["recorded_size"] == total
    assert result["second_sha256"] == result["expected_sha256"]
    # Saving the same files again references the same chunks (only the traced identity adds objects); its tree
    # adds the settled files' status, and a third save of the same files is the very same tree.
    assert result["again_same_files"]
    assert result["again_all_seen"]
    assert result["third_same_tree"]
    if big:  # a large file's chunks are objects of their own, never packed
        assert result["chunk_objects"] <= 2 * math.ceil(FILE_SIZE / MIN_CHUNK)
        assert result["pack_objects"] == 0
        in_flight = MAX_IN_FLIGHT + WINDOW + MAX_CHUNK  # loose chunks, the chunker's window, the one hashed
    else:  # every small file is in a pack: two identities of 64 MiB in 8 MiB packs
        assert result["chunk_objects"] == 0
        assert result["pack_objects"] <= 2 * (math.ceil(total / PACK_TARGET) + 1)
        in_flight = MAX_SAVE_IN_FLIGHT + MAX_CHUNK
    restore_in_flight = MAX_RESTORE_IN_FLIGHT + MAX_CHUNK  # one chunk past the cap may pass
    peak = max(result["sampled_peak_rss"], result["hwm_rss"] or 0)
    growth = peak - result["baseline_rss"]
    figures = (
        f"{result['kind']} store {result['settings']}: "
        + (
            f"file {FILE_SIZE / MIB:.0f} MiB, "
            if big
            else f"{SMALL_FILES} files of {SMALL_SIZE // 1024} KiB, "
        )
        + f"baseline RSS {result['baseline_rss'] / MIB:.1f} MiB, peak {peak / MIB:.1f} MiB "
        f"(sampled {result['sampled_peak_rss'] / MIB:.1f}, VmHWM "
        f"{(result['hwm_rss'] or 0) / MIB:.1f}), growth {growth / MIB:.1f} MiB; live Python allocations "
        f"peak {result['traced_commit'] / MIB:.1f} MiB in commit, {result['traced_restore'] / MIB:.1f} MiB "
        f"in restore (documented in flight: {in_flight / MIB:.0f} MiB, restore {restore_in_flight / MIB:.0f} MiB)"
    )
    print(figures)
    assert growth <= RSS_BOUND, f"memory grew past the documented {RSS_BOUND / MIB:.0f} MiB: {figures}"
    assert result["traced_commit"] < in_flight + SLACK, f"commit buffers more than documented: {figures}"
    assert result["traced_restore"] < restore_in_flight + SLACK, (
        f"restore buffers more than documented: {figures}"
    )


def test_local_store_round_trip_has_bounded_memory(tmp_path: Path) -> None:
    check(measure("local", tmp_path))


def test_s3_store_round_trip_has_bounded_memory(tmp_path: Path, s3_endpoint: Any, s3_prefix: str) -> None:
    settings = {"bucket": s3_endpoint.bucket, "prefix": s3_prefix, **s3_endpoint.options()}
    result = measure("s3", tmp_path, settings)
    assert result["settings"] == {"part_size": 8 * MIB, "max_concurrency": 4}
    check(result)


def test_many_small_files_round_trip_has_bounded_memory(
    tmp_path: Path, s3_endpoint: Any, s3_prefix: str
) -> None:
    """2,048 files of 32 KiB, every one packed: the packs being filled and uploaded stay within the bound."""
    settings = {"bucket": s3_endpoint.bucket, "prefix": s3_prefix, **s3_endpoint.options()}
    check(measure("s3", tmp_path, settings, shape="small"))


def test_many_small_files_on_a_local_store_have_bounded_memory(tmp_path: Path) -> None:
    check(measure("local", tmp_path, shape="small"))
