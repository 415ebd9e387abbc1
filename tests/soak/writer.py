"""The child process of the kill -9 soak (``tests/soak/kill_soak.py``): a writer, or a restore, to be killed.

Run by path with only the library and boto3 (``python tests/soak/writer.py write|restore --spec JSON``).

``write``: open a :class:`~airflow_stateful.core.WriterSession` on the identity (``steal=True``, as an Airflow
retry does), restore the latest checkpoint's files into a fresh work directory, then commit forever. Each
value carries a counter, the SHA-256 of every file it was committed with, and a digest of itself, so a
reader can check a checkpoint against nothing but itself. Most commits change the file tree first (a
region of a multi-MiB file, a whole file rewritten, a log part added or removed: several chunks and
requests); the others keep the files by reference. Some values are padded past the inline-manifest size so
the manifest is a separate object. Right after ``commit()`` returns, one line goes to the ack log (seq,
commit id, value digest, files digest) with flush and ``os.fsync``: a commit is *acknowledged* once its
line is complete in that log.

``restore``: restore checkpoint ``--seq`` into ``--dest`` (which holds another complete state and a file no
checkpoint has) once, in mode ``"exact"``, then exit 0.

Both write what they are doing to a small *phase file* (a fixed-size record rewritten in place, before and
after every store call): after a SIGKILL the driver reads there what the process was doing when it died.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, ProgressCallback, StoredFile

MIB = 1024 * 1024
PHASE_BYTES = 160
"""Size of the phase record (rewritten in place with one ``pwrite``)."""
PAD_BYTES = (9 * 1024, 14 * 1024)
"""A padded value's pad: past the 8 KiB a manifest may have to ride inline in the head."""
BIG_FILES = {"model.bin": 5 * MIB, "data/shard-0.bin": 3 * MIB, "data/shard-1.bin": 5 * MIB // 2}
"""Multi-MiB files: several chunks (about 2 MiB each) and several requests per file."""
SMALL_FILES = ("meta/config.json", "meta/step.txt")
LOG_DIR = "logs"
USER_FILE = "user-notes.txt"
"""A file of the restore destination that no checkpoint holds: the soak's exact restore must remove it, and a
killed one must leave it where it was."""


# -- digests (shared with the driver) --------------------------------------------------------------------
def canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * MIB):
            digest.update(block)
    return digest.hexdigest()


def tree_digests(root: Path, *, skip_hidden: bool = False) -> dict[str, str]:
    """``{relative path: SHA-256}`` of every regular file below ``root`` (``skip_hidden``: not below a
    directory or file whose name starts with a dot)."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if skip_hidden and any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_file() and not path.is_symlink():
            out[rel.as_posix()] = file_sha256(path)
    return out


def files_digest(files: dict[str, str]) -> str:
    return sha256_hex(canonical(files))


def make_value(counter: int, files: dict[str, str], pad: str) -> dict[str, Any]:
    """A value a reader can check alone: its own digest, and the digest of every file committed with it."""
    body = {"counter": counter, "files": files, "files_digest": files_digest(files), "pad": pad}
    return {**body, "digest": sha256_hex(canonical(body))}


def value_problem(value: Any) -> str | None:
    """Why ``value`` is not a value :func:`make_value` built (``None``: it is one, intact)."""
    if not isinstance(value, dict) or set(value) != {"counter", "files", "files_digest", "pad", "digest"}:
        return f"not a soak value: {str(value)[:200]}"
    body = {k: v for k, v in value.items() if k != "digest"}
    if sha256_hex(canonical(body)) != value["digest"]:
        return "the value's digest does not match its content"
    if files_digest(value["files"]) != value["files_digest"]:
        return "the value's files digest does not match its file list"
    return None


# -- the store, and what the process is doing -------------------------------------------------------------
def open_store(spec: dict[str, Any]) -> ObjectStore:
    """The store a spec names: ``{"kind": "local", "root": ...}`` or ``{"kind": "s3", "bucket", "prefix",
    "endpoint_url", "region"}`` (credentials from the environment, boto3's standard chain)."""
    if spec["kind"] == "local":
        from airflow_stateful.core.stores.local import LocalObjectStore

        return LocalObjectStore(root=spec["root"])
    from airflow_stateful.core.stores.s3 import S3ObjectStore

    return S3ObjectStore(
        bucket=spec["bucket"],
        prefix=spec["prefix"],
        endpoint_url=spec["endpoint_url"],
        region_name=spec["region"],
    )


class Phase:
    """A fixed-size record in a file, rewritten in place: what the process is doing right now. It sits in the
    page cache, so it survives a SIGKILL of the process (not a crash of the machine: none is needed)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.context = "start"
        self.set("start", "in")

    def set(self, label: str, state: str) -> None:
        record = f"{label} {state}".encode()[: PHASE_BYTES - 1].ljust(PHASE_BYTES - 1) + b"\n"
        os.pwrite(self.fd, record, 0)

    def enter(self, context: str) -> None:
        self.context = context
        self.set(context, "in")


def read_phase(path: Path) -> str:
    """The phase record as the process last wrote it (``""``: none yet)."""
    try:
        with open(path, "rb") as f:
            return f.read(PHASE_BYTES).decode(errors="replace").strip()
    except FileNotFoundError:
        return ""


def object_kind(key: str) -> str:
    if key.endswith(HEAD_NAME):
        return "head"
    for kind in ("chunks", "trees", "manifests"):
        if f"/~{kind}/" in key:
            return kind[:-1]
    return "object"


class TracedStore(ObjectStore):
    """A real store, every call of which is written to the phase file before it is sent and after it returns.

    The label is ``<context>:<object kind>-<call>``; the context is what the main thread is doing, or the
    library's background thread making the call (lease renewal, cleanup)."""

    def __init__(self, inner: ObjectStore, phase: Phase) -> None:
        self.inner = inner
        self.phase = phase
        self.url = inner.url
        self.parallelism = inner.parallelism

    def _label(self, kind: str, call: str) -> str:
        thread = threading.current_thread().name
        if thread.startswith("stateful-lease"):
            context = "lease"
        elif thread.startswith("stateful-cleanup"):
            context = "sweep"
        else:
            context = self.phase.context
        return f"{context}:{kind}-{call}"

    def _traced(self, kind: str, call: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        label = self._label(kind, call)
        self.phase.set(label, "in")
        result = fn(*args, **kwargs)
        self.phase.set(label, "done")
        return result

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        blob: Blob = self._traced(object_kind(key), "get", self.inner.get, key, max_bytes=max_bytes)
        return blob

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        etag: str = self._traced(
            object_kind(key),
            "put",
            self.inner.put,
            key,
            data,
            if_none_match=if_none_match,
            if_match=if_match,
            adopt_identical=adopt_identical,
        )
        return etag

    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        stored: StoredFile = self._traced(
            object_kind(key), "upload", self.inner.upload_file, key, path, progress=progress
        )
        return stored

    def download_file(
        self, key: str, dest: Path, *, size: int, sha256: str, progress: ProgressCallback | None = None
    ) -> None:
        self._traced(
            object_kind(key),
            "download",
            self.inner.download_file,
            key,
            dest,
            size=size,
            sha256=sha256,
            progress=progress,
        )

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        listed: list[ObjectInfo] = self._traced(
            "prefix", "list", lambda: list(self.inner.list_objects(prefix))
        )
        return iter(listed)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self._traced(object_kind(key), "delete", self.inner.delete, key, if_match=if_match)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._traced("objects", "delete", self.inner.delete_many, list(keys))

    def close(self) -> None:
        self.inner.close()


# -- the writer ------------------------------------------------------------------------------------------
def fsync_append(path: Path, line: str) -> None:
    """Append one line and make it durable before returning (the acknowledgement)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def random_bytes(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def create_tree(work: Path, rng: random.Random) -> None:
    for rel, size in BIG_FILES.items():
        write_file(work / rel, random_bytes(rng, size))
    write_file(work / "meta/config.json", canonical({"lr": rng.random(), "layers": rng.randint(1, 64)}))
    write_file(work / "meta/step.txt", b"0\n")
    for i in range(3):
        write_file(work / LOG_DIR / f"part-{i}.txt", random_bytes(rng, rng.randint(100, 8000)))


def change_tree(work: Path, rng: random.Random, counter: int) -> list[str]:
    """Change some of the files (which, and how, varies); the names of the changes made."""
    changes = ["step"]
    write_file(work / "meta/step.txt", f"{counter}\n".encode())
    bigs = sorted(BIG_FILES)
    if rng.random() < 0.45:  # a region of a big file: one or two new chunks
        rel = rng.choice(bigs)
        size = (work / rel).stat().st_size
        offset = rng.randrange(0, max(1, size - 64 * 1024))
        with open(work / rel, "r+b") as f:
            f.seek(offset)
            f.write(random_bytes(rng, 64 * 1024))
        changes.append(f"patch {rel}")
    if rng.random() < 0.15:  # a big file rewritten whole, at another size: every chunk new
        rel = rng.choice(bigs)
        write_file(work / rel, random_bytes(rng, rng.randint(2 * MIB, 6 * MIB)))
        changes.append(f"rewrite {rel}")
    if rng.random() < 0.2:
        write_file(work / "meta/config.json", canonical({"lr": rng.random(), "layers": rng.randint(1, 64)}))
        changes.append("config")
    logs = sorted((work / LOG_DIR).glob("part-*.txt"))
    if rng.random() < 0.3:
        write_file(work / LOG_DIR / f"part-{counter}.txt", random_bytes(rng, rng.randint(100, 20000)))
        changes.append("add log")
    if len(logs) > 1 and rng.random() < 0.2:
        rng.choice(logs).unlink()
        changes.append("remove log")
    return changes


def run_writer(spec: dict[str, Any]) -> None:
    phase = Phase(Path(spec["phase"]))
    rng = random.Random(spec["seed"])
    store = TracedStore(open_store(spec["store"]), phase)
    checkpoints = CheckpointStore(
        store=store,
        identity=Identity.parse(spec["identity"]),
        keep_last=spec["keep_last"],
        lease_ttl=spec["lease_ttl"],
    )
    writer = WriterInfo.current(try_number=spec["round"] + 1)
    work = Path(tempfile.mkdtemp(prefix="work-", dir=spec["work_root"]))
    ack_log = Path(spec["ack_log"])
    phase.enter("open")
    session = WriterSession(checkpoints=checkpoints, writer=writer, steal=True).open()
    counter = 0
    files: dict[str, str] = {}
    if session.latest is not None:
        value = session.value
        problem = value_problem(value)
        if problem:
            raise SystemExit(f"the writer resumed from a bad checkpoint {session.latest.seq}: {problem}")
        counter, files = value["counter"], value["files"]
        phase.enter("restore-work")
        session.restore_files(work)
        if tree_digests(work) != files:
            raise SystemExit(f"checkpoint {session.latest.seq} restored to other files than its value lists")
    phase.enter("ready")
    while True:
        counter += 1
        phase.enter("prepare")
        commit_files = not files or rng.random() < 0.6
        if commit_files:
            if not files:
                create_tree(work, rng)
            else:
                change_tree(work, rng, counter)
            files = tree_digests(work)
        pad = rng.randbytes(rng.randint(*PAD_BYTES) // 2).hex() if rng.random() < 0.35 else ""
        value = make_value(counter, files, pad)
        phase.enter("commit")
        manifest = session.commit(value, files=work if commit_files else None)
        phase.enter("ack")
        time.sleep(rng.uniform(0, 0.002))  # the task's own bookkeeping: committed, not yet acknowledged
        ack = {
            "seq": manifest.seq,
            "commit_id": manifest.commit_id,
            "value_digest": value["digest"],
            "files_digest": value["files_digest"],
            "counter": counter,
            "files": commit_files,
            "pid": os.getpid(),
            "time": time.time(),
        }
        fsync_append(ack_log, json.dumps(ack, sort_keys=True))
        phase.enter("acked")
        if spec.get("pause"):
            time.sleep(rng.uniform(0, spec["pause"]))


# -- the restore -------------------------------------------------------------------------------------------
class RestoreTracedStore(TracedStore):
    """Also notes the moment the last chunk of the restore is in (phase ``restore-place``): what is left then
    is putting the files in place, the step a kill must never leave half done."""

    def __init__(self, inner: ObjectStore, phase: Phase) -> None:
        super().__init__(inner, phase)
        self._lock = threading.Lock()
        self._missing: set[str] = set()

    def expect_chunks(self, keys: set[str]) -> None:
        self._missing = set(keys)

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        blob = super().get(key, max_bytes=max_bytes)
        with self._lock:
            if key in self._missing:
                self._missing.discard(key)
                if not self._missing:
                    self.phase.enter("restore-place")
        return blob


def run_restore(spec: dict[str, Any]) -> None:
    phase = Phase(Path(spec["phase"]))
    store = RestoreTracedStore(open_store(spec["store"]), phase)
    checkpoints = CheckpointStore(store=store, identity=Identity.parse(spec["identity"]))
    phase.enter("restore-read")
    manifest = checkpoints.get(spec["seq"])
    tree = checkpoints.tree(manifest)
    assert tree is not None, "the soak writes format-2 checkpoints only"
    store.expect_chunks({c.key for f in tree.files for c in f.chunks})
    phase.enter("restore")
    checkpoints.restore_files(manifest, Path(spec["dest"]), mode="exact")  # moves USER_FILE out in its swap
    phase.enter("restored")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the driver that started it dies, so no writer outlives a soak."""
    parent = os.environ.get("KILL_SOAK_PARENT")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the driver died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("write", "restore"))
    parser.add_argument("--spec", required=True, help="JSON: store, identity, paths, seed (see kill_soak.py)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    if args.mode == "write":
        run_writer(spec)
    else:
        run_restore(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
