"""Measure content-defined chunking (pyfastcdc) and chunk hashing (hashlib, blake3, xxhash) on this machine.

Run it with ``.venv/bin/python benchmarks/bench_chunking.py`` (``--help`` for options; the defaults take about
two minutes on a 2-core machine). It needs ``pyfastcdc``, ``blake3`` and ``xxhash`` in the environment. It
answers the questions that choosing the chunker and the chunk-naming hash for content-addressed checkpoints
depends on, and prints one table per question:

1. **Hash throughput** (MiB/s) over ``--hash-mib`` of random data hashed in ``--piece-mib`` pieces, one-shot
   per piece: ``hashlib.sha256``, ``hashlib.blake2b`` (32-byte digest), ``blake3`` single-threaded and with
   ``max_threads`` (``blake3.AUTO`` and 2), ``xxhash.xxh3_128`` and, for reference, ``zlib.crc32`` (the
   checksum botocore adds to every upload). **GIL**, three ways: (a) the same work in 2 threads at once;
   an aggregate close to 2x one thread means the hash releases the GIL (2 cores, nothing else running);
   (b) the work next to a thread running a pure-Python loop: that loop keeps ~100% of its solo speed if the
   hash runs without the GIL, and the hash's own throughput there shows the cost of taking the GIL back
   after every call (the busy thread keeps it up to ``sys.getswitchinterval()``, 5 ms); (c) **stall**: how
   much longer than asked a thread sleeping 0.5 ms in a loop waited to run (p99 / max) while the hash ran:
   how long an upload thread could be kept waiting. A pure-Python loop alone causes up to ~5 ms.
2. **pyfastcdc chunking** for each ``--avg-mib`` (min = avg / ``--min-div``, max = avg * ``--max-mul``,
   FastCDC's defaults 4 and 4): ``cut_buf`` on a buffer in memory (with the same GIL measures as 1), ``cut_stream`` of
   the file from the page cache, and the whole pipeline ``cut_stream`` + one hash per chunk (blake3,
   blake3 AUTO, sha256), and + a whole-file blake3 over the same bytes. The chunk boundaries of
   ``cut_buf``, ``cut_file`` and ``cut_stream`` are compared (they must be identical).
3. **Memory** while chunking the ``--file-mib`` file read from disk (its pages are dropped from the page
   cache first with ``posix_fadvise(DONTNEED)``, which only touches this file), ``cut_file`` (mmap) vs
   ``cut_stream`` (readinto a fixed buffer), each followed by blake3 of every chunk, in a fresh subprocess:
   tracemalloc peak, peak RSS growth (``VmHWM`` after ``/proc/self/clear_refs``) and the largest anonymous
   and file-backed RSS growth seen.
4. **Dedup**: the file (random bytes), then three new versions: 1% of its bytes overwritten as one
   contiguous region, 1% inserted as one region in the middle, and 100 scattered regions of 100 KiB
   overwritten. For each chunking (FastCDC per avg size, and fixed-size blocks of the same size as the
   baseline), the bytes and chunks of the new version whose hash the old version (or an earlier chunk of the
   new one) does not already have: what a re-save would upload, as a fraction of the file (target <= 0.05).
5. **Chunk counts**: chunks per GiB (one PutObject each), size distribution on random and on all-zero data,
   and the memory a streaming uploader needs (the ``cut_stream`` buffer is 2 x max; each chunk in flight
   can be max bytes).

Throughputs are the best of ``--repeat`` runs (the machine is shared; the best run is the one least
disturbed), as is the busy thread's share; stalls come from one run of at least 0.4 s. The random data come from BLAKE3's extendable output seeded by
``--seed``, so runs are reproducible. Scratch data go under ``--tmpdir`` and are deleted at the end.
The absolute numbers belong to this machine; the point is the ratios and the orders of magnitude next to the
~80-100 MiB/s (up) and ~40 MiB/s (down) that moto's S3 reaches on loopback here.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import pyfastcdc
    import xxhash
    from blake3 import blake3
    from pyfastcdc import FastCDC
except ImportError as exc:  # pragma: no cover - a clear message instead of a traceback
    sys.exit(
        f"bench_chunking needs pyfastcdc, blake3 and xxhash: pip install pyfastcdc blake3 xxhash ({exc})"
    )

MIB = 1 << 20
KIB = 1 << 10
GIB = 1 << 30
CPU_NOTE = (
    "`(per CPU-s)`: MiB per CPU-second of this process (all its threads), which other load on the machine "
    "changes much less than wall-clock MiB/s."
)


# -- small helpers -----------------------------------------------------------------------------------------
def random_bytes(n: int, label: str, seed: int) -> bytes:
    """``n`` pseudo-random bytes, reproducible from ``seed`` and ``label`` (BLAKE3 XOF, ~0.9 GB/s)."""
    return blake3(f"bench_chunking:{seed}:{label}".encode()).digest(length=n)


def mib_s(nbytes: int, seconds: float) -> float:
    return nbytes / MIB / seconds if seconds > 0 else float("inf")


def fmt_size(n: float) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{int(n // MIB)} MiB"
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    if n % KIB == 0:
        return f"{int(n // KIB)} KiB"
    return f"{n} B"


def print_table(title: str, headers: list[str], rows: list[list[Any]], notes: Iterable[str] = ()) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for r in cells:
        print(
            "| "
            + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True))
            + " |"
        )
    for note in notes:
        print(f"\n{note}")
    sys.stdout.flush()


def _numeric(cell: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d.,]+( \([\d.,]+\))?(x|%| ms| MiB)?", cell))


class StallMonitor:
    """A thread that sleeps 0.5 ms in a loop and records how much longer it waited to run again (GIL hold)."""

    def __init__(self, period: float = 0.0005) -> None:
        self.period = period
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-monitor", daemon=True)

    def _run(self) -> None:
        clock = time.perf_counter
        gaps = self.gaps
        while not self._stop.is_set():
            start = clock()
            time.sleep(self.period)
            gaps.append(clock() - start - self.period)

    def __enter__(self) -> StallMonitor:
        self._thread.start()
        time.sleep(0.01)
        self.gaps.clear()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        """``p99 / max`` extra wait, ms."""
        if not self.gaps:
            return "-"
        gaps = sorted(self.gaps)
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        return f"{p99 * 1000:.1f} / {gaps[-1] * 1000:.1f}"


def repeat_for(work: Callable[[], object], min_seconds: float) -> tuple[int, float]:
    """Run ``work`` until ``min_seconds`` have passed; (runs, seconds)."""
    start = time.perf_counter()
    runs = 0
    while True:
        work()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return runs, elapsed


def _spin(stop: threading.Event, count: list[int]) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(200):
            n += 1
    count[0] = n


def next_to_busy_python(work: Callable[[], object], min_seconds: float = 0.4) -> tuple[float, float]:
    """Run ``work`` (repeatedly, for at least ``min_seconds``) while another thread runs a pure-Python loop.

    Returns (seconds per ``work``, the loop's speed meanwhile as a fraction of its speed alone, measured just
    before). The fraction is ~1 if ``work`` runs without the GIL (two cores), ~0 if it holds it.
    """
    rates = []
    for with_work in (False, True):
        stop = threading.Event()
        count = [0]
        thread = threading.Thread(target=_spin, args=(stop, count))
        thread.start()
        start = time.perf_counter()
        if with_work:
            runs, _ = repeat_for(work, min_seconds)
        else:
            time.sleep(min_seconds / 2)
        stop.set()
        thread.join()
        elapsed = time.perf_counter() - start
        rates.append(count[0] / elapsed)
    return elapsed / runs, rates[1] / rates[0]


def stall_of(work: Callable[[], object], min_seconds: float = 0.4) -> str:
    with StallMonitor() as mon:
        repeat_for(work, min_seconds)
    return mon.summary()


def run_in_threads(work: Callable[[], None], n: int) -> float:
    """Wall time of ``n`` threads each running ``work`` once, started together."""
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def body() -> None:
        barrier.wait()
        try:
            work()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body) for _ in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


@dataclass(frozen=True)
class Timing:
    """Best wall time and best CPU time (all threads of this process) over the runs."""

    wall: float
    cpu: float

    def rate(self, nbytes: int) -> str:
        """``wall MiB/s (MiB per CPU-second)``."""
        return f"{mib_s(nbytes, self.wall):,.0f} ({mib_s(nbytes, self.cpu):,.0f})"


def best_time(work: Callable[[], object], repeat: int) -> Timing:
    walls, cpus = [], []
    for _ in range(repeat):
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return Timing(min(walls), min(cpus))


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes ({} off Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * KIB
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    except OSError:
        return False
    return True


def drop_file_cache(path: Path) -> None:
    """Evict this one file's clean pages from the page cache (no effect on anything else)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# -- chunkers ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    avg: int
    min: int
    max: int

    def make(self) -> FastCDC:
        return FastCDC(self.avg, min_size=self.min, max_size=self.max)

    @property
    def label(self) -> str:
        return f"{fmt_size(self.avg)} ({fmt_size(self.min)}..{fmt_size(self.max)})"


def params_for(avg: int, min_div: int, max_mul: int) -> tuple[Params | None, str]:
    p = Params(avg, avg // min_div, avg * max_mul)
    try:
        p.make()
    except ValueError as exc:
        return (
            None,
            f"pyfastcdc refuses avg {fmt_size(avg)} min {fmt_size(p.min)} max {fmt_size(p.max)}: {exc}",
        )
    return p, ""


def fastcdc_chunks(params: Params, buf: bytes | bytearray) -> Iterator[tuple[int, memoryview]]:
    for c in params.make().cut_buf(buf):
        yield c.length, c.data


def fixed_chunks(size: int, buf: bytes | bytearray) -> Iterator[tuple[int, memoryview]]:
    mv = memoryview(buf)
    for off in range(0, len(buf), size):
        piece = mv[off : off + size]
        yield len(piece), piece


def chunk_digests(chunks: Iterator[tuple[int, memoryview]]) -> list[tuple[bytes, int]]:
    return [(blake3(data, max_threads=blake3.AUTO).digest(), length) for length, data in chunks]


# -- 1. hashing --------------------------------------------------------------------------------------------
HASHES: dict[str, tuple[Callable[[memoryview], object], str]] = {
    "sha256 (hashlib/OpenSSL)": (lambda b: hashlib.sha256(b).digest(), "yes"),
    "blake2b-256 (hashlib)": (lambda b: hashlib.blake2b(b, digest_size=32).digest(), "yes"),
    "blake3": (lambda b: blake3(b).digest(), "yes"),
    "blake3 max_threads=AUTO": (lambda b: blake3(b, max_threads=blake3.AUTO).digest(), "yes"),
    "blake3 max_threads=2": (lambda b: blake3(b, max_threads=2).digest(), "yes"),
    "xxh3_128 (xxhash)": (lambda b: xxhash.xxh3_128_digest(b), "NO"),
    "crc32 (zlib; botocore's)": (lambda b: zlib.crc32(b), "NO"),
}


def bench_hashes(data: bytes | memoryview, piece_sizes: list[int], repeat: int) -> None:
    rows = []
    mv = memoryview(data)
    for piece in piece_sizes:
        pieces = [mv[o : o + piece] for o in range(0, len(data) - piece + 1, piece)]
        nbytes = piece * len(pieces)
        side = pieces[: max(1, (256 * MIB) // piece)]  # the runs next to other threads use <= 256 MiB
        for name, (fn, crypto) in HASHES.items():

            def work(fn: Callable[[memoryview], object] = fn, pieces: list[memoryview] = pieces) -> None:
                for p in pieces:
                    fn(p)

            one = best_time(work, repeat)
            two = min(run_in_threads(work, 2) for _ in range(repeat))
            busy = max(
                (next_to_busy_python(lambda fn=fn, side=side: [fn(p) for p in side]) for _ in range(repeat)),
                key=lambda r: r[1],
            )
            stall = stall_of(lambda fn=fn, side=side: [fn(p) for p in side])
            rows.append(
                [
                    name,
                    fmt_size(piece),
                    one.rate(nbytes),
                    f"{mib_s(2 * nbytes, two):,.0f}",
                    f"{one.wall / two * 2:.2f}x",
                    f"{mib_s(piece * len(side), busy[0]):,.0f}",
                    f"{100 * busy[1]:.0f}%",
                    stall,
                    crypto,
                ]
            )
    print_table(
        f"1. Hash throughput, {fmt_size(len(data))} of random data, one-shot per piece (MiB/s, best of {repeat})",
        [
            "hash",
            "piece",
            "1 thread (per CPU-s)",
            "2 threads (sum)",
            "2T / 1T",
            "next to a busy Python thread",
            "that thread's speed",
            "stall p99 / max ms",
            "crypto",
        ],
        rows,
        [
            "2T / 1T: aggregate throughput of 2 threads hashing at once over 1 thread; ~2x means the GIL is "
            "released (2 cores), unless memory bandwidth or another process is the limit. `next to a busy "
            "Python thread`: the hash's throughput while another thread runs a pure-Python loop, and that "
            "loop's speed as a % of its speed alone: ~100% means the hash does not hold the GIL; the hash's "
            "own slowdown there is the GIL hand-over after every piece (the busy thread keeps the GIL up to "
            "the 5 ms switch interval), which shrinks with bigger pieces. `stall`: how much longer than "
            "0.5 ms a thread sleeping 0.5 ms in a loop waited to run while the hash ran (p99 / max, over "
            "<= 256 MiB). blake3 AUTO uses all cores itself (rayon's global pool); max_threads=2 builds a "
            "new rayon pool for every hasher object (every piece here).",
            CPU_NOTE,
        ],
    )


# -- 2. chunking throughput --------------------------------------------------------------------------------
def boundaries(chunks: Iterable[Any]) -> list[tuple[int, int]]:
    return [(c.offset, c.length) for c in chunks]


def stream_pipeline(
    params: Params, path: Path, chunk_hash: Callable[[memoryview], object] | None, whole: bool
) -> int:
    total = 0
    file_hasher = blake3() if whole else None
    with open(path, "rb", buffering=0) as fh:
        for c in params.make().cut_stream(fh):
            if chunk_hash is not None:
                chunk_hash(c.data)
            if file_hasher is not None:
                file_hasher.update(c.data)
            total += c.length
    if file_hasher is not None:
        file_hasher.digest()
    return total


def bench_chunking(data: bytes, path: Path, params_list: list[Params], repeat: int) -> None:
    rows_cut = []
    rows_pipe = []
    checks = []
    size = len(data)
    b3 = HASHES["blake3"][0]
    for p in params_list:

        def cut(p: Params = p) -> None:  # a FastCDC object per thread: it is not to be shared
            for _ in p.make().cut_buf(data):
                pass

        buf_t = best_time(cut, repeat)
        two_t = min(run_in_threads(cut, 2) for _ in range(repeat))
        busy_t, busy_frac = max((next_to_busy_python(cut) for _ in range(repeat)), key=lambda r: r[1])
        cut_stall = stall_of(cut)
        stream_t = best_time(lambda p=p: stream_pipeline(p, path, None, False), repeat)
        rows_cut.append(
            [
                p.label,
                buf_t.rate(size),
                f"{mib_s(2 * size, two_t):,.0f}",
                f"{buf_t.wall / two_t * 2:.2f}x",
                f"{mib_s(size, busy_t):,.0f}",
                f"{100 * busy_frac:.0f}%",
                cut_stall,
                stream_t.rate(size),
            ]
        )

        def timed(hash_fn: Callable[[memoryview], object], whole: bool = False, p: Params = p) -> Timing:
            return best_time(lambda: stream_pipeline(p, path, hash_fn, whole), repeat)

        b3_t = timed(b3)
        b3auto_t = timed(HASHES["blake3 max_threads=AUTO"][0])
        sha_t = timed(HASHES["sha256 (hashlib/OpenSSL)"][0])
        whole_t = timed(b3, whole=True)
        pipe_busy_t, pipe_busy_frac = max(
            (next_to_busy_python(lambda p=p: stream_pipeline(p, path, b3, False)) for _ in range(repeat)),
            key=lambda r: r[1],
        )
        pipe_stall = stall_of(lambda p=p: stream_pipeline(p, path, b3, False))
        rows_pipe.append(
            [
                p.label,
                b3_t.rate(size),
                b3auto_t.rate(size),
                sha_t.rate(size),
                whole_t.rate(size),
                f"{mib_s(size, pipe_busy_t):,.0f}",
                f"{100 * pipe_busy_frac:.0f}%",
                pipe_stall,
            ]
        )
        ref = boundaries(p.make().cut_buf(data))
        via_file = boundaries(p.make().cut_file(path))
        with open(path, "rb", buffering=0) as fh:
            via_stream = boundaries(p.make().cut_stream(fh))
        with open(path, "rb") as fh:  # a buffered reader, as most callers would open it
            via_buffered = boundaries(p.make().cut_stream(fh))
        same = ref == via_file == via_stream == via_buffered
        checks.append(f"{p.label}: {len(ref)} chunks, identical: {'yes' if same else 'NO'}")
    print_table(
        f"2a. pyfastcdc {pyfastcdc.__version__} ({FastCDC.__module__}) chunking {fmt_size(size)} of random "
        f"data, no hashing (MiB/s, best of {repeat})",
        [
            "avg (min..max)",
            "cut_buf in memory (per CPU-s)",
            "2 threads (sum)",
            "2T / 1T",
            "next to a busy Python thread",
            "that thread's speed",
            "stall p99 / max ms",
            "cut_stream, page cache (per CPU-s)",
        ],
        rows_cut,
        [
            "Boundaries of cut_buf, cut_file and cut_stream (raw and buffered file): " + "; ".join(checks),
            CPU_NOTE,
        ],
    )
    print_table(
        f"2b. Commit pipeline: cut_stream of the {fmt_size(size)} file (page cache) + one hash per chunk, one "
        f"thread (MiB/s, best of {repeat})",
        [
            "avg (min..max)",
            "+ blake3 (per CPU-s)",
            "+ blake3 AUTO (per CPU-s)",
            "+ sha256 (per CPU-s)",
            "+ blake3 + whole-file blake3 (per CPU-s)",
            "+ blake3 next to a busy Python thread",
            "that thread's speed",
            "stall p99 / max ms",
        ],
        rows_pipe,
        [
            "What a commit spends before uploading. `+ blake3 + whole-file blake3`: a second blake3 hasher "
            "updated with every chunk (the cost of also keeping a whole-file hash in the same pass).",
            CPU_NOTE,
        ],
    )


# -- 3. memory (in a subprocess) ---------------------------------------------------------------------------
def child_memory(mode: str, path: str, avg: int, min_size: int, max_size: int) -> None:
    import tracemalloc

    params = Params(avg, min_size, max_size)
    drop_file_cache(Path(path))
    gc.collect()
    can_reset = reset_peak_rss()
    base = proc_status()
    peak_anon = peak_file = 0
    tracemalloc.start()
    start = time.perf_counter()
    total = chunks = 0
    with contextlib.ExitStack() as stack:
        if mode == "cut_file":
            it = params.make().cut_file(path)
        else:
            it = params.make().cut_stream(stack.enter_context(open(path, "rb", buffering=0)))
        for c in it:
            blake3(c.data).digest()
            total += c.length
            chunks += 1
            st = proc_status()
            peak_anon = max(peak_anon, st.get("RssAnon", 0) - base.get("RssAnon", 0))
            peak_file = max(peak_file, st.get("RssFile", 0) - base.get("RssFile", 0))
        elapsed = time.perf_counter() - start
        traced_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        end = proc_status()
    print(
        json.dumps(
            {
                "bytes": total,
                "chunks": chunks,
                "seconds": elapsed,
                "traced_peak": traced_peak,
                "hwm_growth": (end.get("VmHWM", 0) - base.get("VmRSS", 0)) if can_reset else None,
                "anon_growth": peak_anon,
                "file_growth": peak_file,
            }
        )
    )


def bench_memory(path: Path, params_list: list[Params]) -> None:
    rows = []
    for p in params_list:
        for mode in ("cut_stream", "cut_file"):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child-memory",
                mode,
                str(path),
                str(p.avg),
                str(p.min),
                str(p.max),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            hwm = "n/a" if r["hwm_growth"] is None else f"{r['hwm_growth'] / MIB:.1f} MiB"
            rows.append(
                [
                    p.label,
                    mode + (" (mmap)" if mode == "cut_file" else " (readinto)"),
                    f"{mib_s(r['bytes'], r['seconds']):,.0f}",
                    f"{r['traced_peak'] / MIB:.1f} MiB",
                    hwm,
                    f"{r['anon_growth'] / MIB:.1f} MiB",
                    f"{r['file_growth'] / MIB:.1f} MiB",
                ]
            )
    print_table(
        f"3. Memory chunking + blake3 per chunk of the {fmt_size(path.stat().st_size)} file read from disk "
        "(fresh subprocess, file evicted from the page cache first)",
        [
            "avg (min..max)",
            "mode",
            "MiB/s (cold)",
            "tracemalloc peak",
            "peak RSS growth (VmHWM)",
            "max RssAnon growth",
            "max RssFile growth",
        ],
        rows,
        [
            "cut_stream holds one bytearray of 2 x max_size (its read buffer); a chunk's `data` is only valid "
            "until the next chunk, so an uploader must copy it (bytes(c.data)) before handing it to a thread. "
            "cut_file maps the whole file: every page it touches counts in the process's RSS (file-backed, "
            "reclaimable, but it is what VmHWM / ru_maxrss / a cgroup see), and a file truncated while mapped "
            "raises SIGBUS, which kills the process."
        ],
    )


# -- 4. dedup and 5. chunk counts --------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    changed: int  # bytes modified or inserted
    build: Callable[[], bytes | bytearray]


def make_variants(old: bytes, seed: int, scattered_regions: int, scattered_size: int) -> list[Variant]:
    size = len(old)
    one_pct = size // 100
    # An arbitrary, unaligned position (not a multiple of any block size), a bit after the middle.
    where = size // 2 + 123_457

    def in_place() -> bytearray:
        new = bytearray(old)
        new[where : where + one_pct] = random_bytes(one_pct, "in-place", seed)
        return new

    def inserted() -> bytes:
        return b"".join((old[:where], random_bytes(one_pct, "insert", seed), old[where:]))

    def scattered() -> bytearray:
        new = bytearray(old)
        rng = random.Random(seed)
        slot = size // scattered_regions
        patch = random_bytes(scattered_regions * scattered_size, "scattered", seed)
        for i in range(scattered_regions):
            at = i * slot + rng.randrange(0, slot - scattered_size)
            new[at : at + scattered_size] = patch[i * scattered_size : (i + 1) * scattered_size]
        return new

    return [
        Variant(f"1% in place ({fmt_size(one_pct)} at one offset)", one_pct, in_place),
        Variant(f"1% inserted ({fmt_size(one_pct)} in the middle)", one_pct, inserted),
        Variant(
            f"{scattered_regions} x {fmt_size(scattered_size)} scattered in place",
            scattered_regions * scattered_size,
            scattered,
        ),
    ]


def upload_cost(old_digests: set[bytes], new: list[tuple[bytes, int]]) -> tuple[int, int, int]:
    """(bytes to upload, chunks to upload, total bytes) of ``new`` given the chunks ``old`` already has."""
    have = set(old_digests)
    up_bytes = up_chunks = total = 0
    for digest, length in new:
        total += length
        if digest not in have:
            have.add(digest)
            up_bytes += length
            up_chunks += 1
    return up_bytes, up_chunks, total


def bench_dedup(
    old: bytes,
    params_list: list[Params],
    fixed_sizes: list[int],
    refused: list[str],
    seed: int,
    scattered: tuple[int, int],
    max_concurrency: int,
) -> None:
    size = len(old)
    variants = make_variants(old, seed, *scattered)
    chunkings: list[
        tuple[str, Callable[[bytes | bytearray], Iterator[tuple[int, memoryview]]], Params | None]
    ]
    chunkings = [(f"FastCDC {p.label}", lambda b, p=p: fastcdc_chunks(p, b), p) for p in params_list]
    chunkings += [(f"fixed {fmt_size(s)}", lambda b, s=s: fixed_chunks(s, b), None) for s in fixed_sizes]

    old_sets: list[set[bytes]] = []
    count_rows = []
    for name, chunker, p in chunkings:
        digests = chunk_digests(chunker(old))
        old_sets.append({d for d, _ in digests})
        lengths = [n for _, n in digests]
        if p is not None:
            at_max = sum(1 for n in lengths if n == p.max) / len(lengths)
            buffer_mem = 2 * p.max + (max_concurrency + 1) * p.max
            count_rows.append(
                [
                    name,
                    f"{len(lengths) * GIB / size:,.0f}",
                    f"{statistics.fmean(lengths) / MIB:.2f} MiB",
                    f"{statistics.pstdev(lengths) / MIB:.2f} MiB",
                    f"{min(lengths[:-1] or lengths) / MIB:.2f} MiB",
                    f"{max(lengths) / MIB:.2f} MiB",
                    f"{100 * at_max:.1f}%",
                    f"{buffer_mem / MIB:.0f} MiB",
                ]
            )
        else:
            count_rows.append(
                [name, f"{len(lengths) * GIB / size:,.0f}", fmt_size(lengths[0]), "0", "-", "-", "-", "-"]
            )
        del digests
    zeros = bytes(256 * MIB)  # calloc'd: reading it costs no memory
    for p in params_list:
        lengths = [c.length for c in p.make().cut_buf(zeros)]
        count_rows.append(
            [
                f"FastCDC {p.label}, all-zero data",
                f"{len(lengths) * GIB / len(zeros):,.0f}",
                f"{statistics.fmean(lengths) / MIB:.2f} MiB",
                f"{statistics.pstdev(lengths) / MIB:.2f} MiB",
                f"{min(lengths[:-1] or lengths) / MIB:.2f} MiB",
                f"{max(lengths) / MIB:.2f} MiB",
                f"{100 * sum(1 for n in lengths if n == p.max) / len(lengths):.1f}%",
                "",
            ]
        )
    del zeros

    results: dict[tuple[int, int], tuple[int, int, int]] = {}
    for vi, variant in enumerate(variants):
        new = variant.build()
        for ci, (_, chunker, _) in enumerate(chunkings):
            results[(vi, ci)] = upload_cost(old_sets[ci], chunk_digests(chunker(new)))
        del new
        gc.collect()

    rows = []
    for ci, (name, _, _) in enumerate(chunkings):
        row = [name]
        for vi in range(len(variants)):
            up_bytes, up_chunks, total = results[(vi, ci)]
            ratio = up_bytes / total
            row += [f"{ratio:.3f}{' ok' if ratio <= 0.05 else ' MISS'}", f"{up_chunks}"]
        rows.append(row)
    headers = ["chunking"]
    for v in variants:
        headers += [f"{v.name}: upload / total", "chunks (PUTs)"]
    notes = [
        "upload / total: bytes of the new version in chunks whose BLAKE3 the store would not already hold, "
        "over the new version's size (target <= 0.05, marked ok / MISS). Changed bytes: "
        + ", ".join(f"{v.name} = {100 * v.changed / size:.2f}%" for v in variants)
        + ". Random data: no repeated content inside the file, so every saving comes from the old version."
    ]
    notes += refused
    print_table(f"4. Dedup: re-saving a {fmt_size(size)} file after a change", headers, rows, notes)
    print_table(
        f"5. Chunk counts and sizes ({fmt_size(size)} of random data; 256 MiB of zeros)",
        [
            "chunking",
            "chunks per GiB (PUTs)",
            "mean",
            "stdev",
            "smallest (not last)",
            "largest",
            "at max_size",
            f"stream buffer + {max_concurrency}+1 chunks in flight",
        ],
        count_rows,
        [
            "All-zero data (sparse or preallocated files) never finds a cut point: every chunk is max_size, "
            "so memory must be sized for max_size, not avg (the zero chunks all dedup to one object). "
            "A full upload of 1 GiB with boto3's upload_file (8 MiB parts) takes 128 UploadPart + 2 requests. "
            "Last column: worst-case bytes a cut_stream uploader holds with the store's max_concurrency (a "
            "byte budget for chunks in flight bounds it better than a count)."
        ],
    )


# -- main --------------------------------------------------------------------------------------------------
def parse_sizes(text: str, unit: int) -> list[int]:
    return [int(float(x) * unit) for x in text.split(",") if x.strip()]


def machine_line() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        m = re.search(r"^model name\s*:\s*(.+)$", fh.read(), re.MULTILINE)
        if m:
            cpu = m.group(1)
    import ssl

    return (
        f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {ssl.OPENSSL_VERSION}, "
        f"pyfastcdc {pyfastcdc.__version__} ({FastCDC.__module__}), blake3 {sys.modules['blake3'].__version__}, "
        f"xxhash {xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION})"
    )


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Measure pyfastcdc chunking and chunk hashes (sha256, blake2b, blake3, xxh3) here.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--hash-mib", type=int, default=512, help="random data hashed per run in section 1")
    ap.add_argument("--piece-mib", default="1,8", help="comma-separated piece sizes for section 1, MiB")
    ap.add_argument("--file-mib", type=int, default=1024, help="size of the file chunked in sections 2-5")
    ap.add_argument("--avg-mib", default="1,2,4,8", help="FastCDC average chunk sizes, MiB (floats allowed)")
    ap.add_argument("--min-div", type=int, default=4, help="min_size = avg / this (FastCDC default 4)")
    ap.add_argument("--max-mul", type=int, default=4, help="max_size = avg * this (FastCDC default 4)")
    ap.add_argument("--fixed-mib", default="1,2,4,8", help="fixed-size block baselines for section 4, MiB")
    ap.add_argument("--scattered", default="100,100", help="section 4 scattered edit: COUNT,KIB")
    ap.add_argument("--max-concurrency", type=int, default=4, help="uploads in flight, for section 5's bound")
    ap.add_argument("--repeat", type=int, default=2, help="runs per throughput figure (the best is kept)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random data")
    ap.add_argument("--tmpdir", default=None, help="where the scratch file goes (default: the system's)")
    ap.add_argument(
        "--sections", default="1,2,3,4", help="which sections to run (4 also prints 5, chunk counts)"
    )
    ap.add_argument("--child-memory", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child_memory:
        mode, path, avg, lo, hi = args.child_memory
        child_memory(mode, path, int(avg), int(lo), int(hi))
        return 0

    sections = {s.strip() for s in args.sections.split(",")}
    params_list: list[Params] = []
    refused: list[str] = []
    for avg in parse_sizes(args.avg_mib, MIB):
        p, why = params_for(avg, args.min_div, args.max_mul)
        if p is None:
            refused.append(why)
        else:
            params_list.append(p)
    count, kib = (int(x) for x in args.scattered.split(","))
    size = args.file_mib * MIB

    print("# bench_chunking\n")
    print(machine_line())
    print(
        f"switch interval {sys.getswitchinterval() * 1000:.0f} ms; file {fmt_size(size)}; seed {args.seed}; "
        f"load average at the start: {load_average()} (other work on the machine makes the numbers noisy)"
    )
    for why in refused:
        print(why)
    sys.stdout.flush()

    started = time.perf_counter()
    data = random_bytes(max(size, args.hash_mib * MIB), "old", args.seed)
    scratch = Path(tempfile.mkdtemp(prefix="bench_chunking-", dir=args.tmpdir))
    try:
        if "1" in sections:
            bench_hashes(
                memoryview(data)[: args.hash_mib * MIB], parse_sizes(args.piece_mib, MIB), args.repeat
            )
        old = data[:size] if len(data) > size else data
        del data
        path = scratch / "old.bin"
        if sections & {"2", "3"}:
            with open(path, "wb") as fh:
                mv = memoryview(old)
                for off in range(0, size, 8 * MIB):
                    fh.write(mv[off : off + 8 * MIB])
                fh.flush()
                os.fsync(fh.fileno())
        if "2" in sections:
            bench_chunking(old, path, params_list, args.repeat)
        if "3" in sections:
            bench_memory(path, params_list)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if "4" in sections:
            bench_dedup(
                old,
                params_list,
                parse_sizes(args.fixed_mib, MIB),
                refused,
                args.seed,
                (count, kib * KIB),
                args.max_concurrency,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n(total {time.perf_counter() - started:.0f} s; load average at the end: {load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
