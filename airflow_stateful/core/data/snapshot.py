"""Snapshots for a save that finishes in the background: the value and the files exactly as they were at the call.

``TaskState.save(..., wait=False)`` returns while the upload and the commit still run, and the task goes on
writing to the very directory it saved. What gets committed must nevertheless be the bytes of the moment of
the call, so the call takes a private copy before it returns:

* **the value** is encoded at once (:func:`snapshot_value`): a dict the task mutates a microsecond later does
  not change what is committed;
* **the files** are copied into a *staging directory* (:func:`snapshot_files`) and uploaded from there.

Why a copy, and which copy. The alternatives measured or weighed (256 MiB, ext4, 2 cores; a synchronous save
of the same file to moto's S3 takes about 3 s):

* ``os.copy_file_range`` into a directory on the **same filesystem**: 0.08 s (~3 GiB/s, the kernel copies
  page cache to page cache, no bytes pass through Python). On filesystems that share extents (btrfs, XFS with
  reflink, bcachefs) the kernel turns the same call into a reflink: constant time, no extra space. This is
  what is used, with a plain read/write copy as the fallback where the call is refused (another
  filesystem on an old kernel, macOS).
* ``shutil.copyfile`` (``sendfile``): 0.09 s here, and never a reflink.
* **hard links**: free, but a task that rewrites a file in place (``open(path, "wb")``) would rewrite the
  snapshot too; only safe for tasks that replace files by rename, which the library cannot know. Rejected.
* **keeping the bytes in memory**: breaks the memory bound for large checkpoints. Rejected.
* **uploading the originals and checking afterwards that nothing changed**: detects the problem but cannot
  commit the old bytes. Rejected.

The copy costs disk space equal to the checkpoint (none with reflinks) for as long as the upload runs.

Where staging lives. By default in a hidden ``.stateful-staging`` directory beside the saved path: on the same
filesystem, so the copy is an in-kernel copy or a reflink (never a RAM-backed ``/tmp``), the space is taken on
the disk the data already lives on, and a retry saving the same path on the same machine finds what a killed
try left behind. If that directory cannot be used (the parent is read-only, or the name is taken by something
that is not a directory of this user's: a link, another user's directory), a private directory under the system
temp directory is used; a caller may also name one (``staging_dir=``). Copies are never written through a link.

Crashes. Each snapshot is an entry ``save-<pid>-<random>`` holding a lock file that its process keeps
``flock``-ed until the entry is removed. The kernel drops the lock when the process dies, however it dies
(SIGKILL, OOM), so every later snapshot into the same root removes entries whose lock it can take:
no pid files, no guessing by age, and a live entry of another task is never touched. Only names this module
creates are ever removed. Nothing in here imports Airflow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_stateful.core.data.files import collect_files
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.codecs import PICKLE, decode_value, encode_value

STAGING_DIRNAME = ".stateful-staging"
_LOCK = ".lock"
_DATA = "data"
_ENTRY = re.compile(r"save-\d+-[0-9a-f]{12}")
_NEW = re.compile(r"\.new-save-\d+-[0-9a-f]{12}")
_ABANDONED_AFTER = 60.0  # seconds: an entry that never got past creation (a crash right then)
_COPY_CHUNK = 8 * 1024 * 1024
# copy_file_range is refused (rather than failing) across filesystems on older kernels and by some filesystems.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTSUP}


def snapshot_value(value: Any, codec: str) -> Any:
    """A private copy of ``value`` as the checkpoint will store it; InvalidValueError now if it cannot be stored.

    The copy is what a retry would read back (JSON: lists for tuples, string keys), so the task sees that same
    value once the save has landed.
    """
    stored = encode_value(value, codec)
    if codec == PICKLE:
        return decode_value(stored, PICKLE, allowed=PICKLE, where="the value being saved")
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False))


@dataclass
class FileSnapshot:
    """A private copy of a file or directory, in a staging entry this process holds locked until :meth:`discard`.

    ``path`` is what to commit as ``files=``: the copied directory, or the copied file under its own name.
    """

    path: Path
    entry: Path
    files: int
    bytes: int
    seconds: float
    method: str
    _lock_fd: int | None = field(default=None, repr=False)

    def discard(self) -> None:
        """Remove the copy and release the lock (and the staging root, when it is left empty). Never raises."""
        shutil.rmtree(self.entry, ignore_errors=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
        with contextlib.suppress(OSError):
            self.entry.parent.rmdir()  # only if empty: another task may be staging there too


def staging_roots(files: str | os.PathLike[str]) -> list[Path]:
    """Where a snapshot of ``files`` may be staged, best first: beside it (same filesystem), then a private
    directory under the temp dir (for a read-only parent, or one where another user owns the name)."""
    parent = Path(files).resolve().parent
    return [parent / STAGING_DIRNAME, Path(tempfile.gettempdir()) / f"airflow-stateful-staging-{os.getuid()}"]


def _usable_root(candidates: list[Path]) -> Path:
    problems = []
    for root in candidates:
        try:
            _ensure_private_root(root)
        except (OSError, InvalidValueError) as exc:
            problems.append(f"{str(root)!r}: {exc}")
            continue
        return root
    raise InvalidValueError(
        f"no usable staging directory for a background save ({'; '.join(problems)}). Pass staging_dir= to "
        "TaskState, or save with wait=True (no copy)."
    )


def snapshot_files(
    files: str | os.PathLike[str],
    *,
    follow_symlinks: bool = False,
    staging_root: str | os.PathLike[str] | None = None,
) -> FileSnapshot:
    """Copy ``files`` (a file or a directory tree) into a new staging entry and return the copy.

    The same checks as a synchronous save run first (links, special files; see
    :func:`~airflow_stateful.core.data.files.collect_files`), so a bad argument fails here, in the caller's
    thread, with nothing copied. Entries left by dead processes in the same root are removed first.
    """
    started = time.monotonic()
    local = collect_files(files, follow_symlinks=follow_symlinks)
    given = Path(files)
    candidates = [Path(staging_root)] if staging_root is not None else staging_roots(given)
    if given.is_dir():
        saved = given.resolve()
        for root in candidates:
            if root.resolve() == saved or saved in root.resolve().parents:
                raise InvalidValueError(
                    f"the staging directory {str(root)!r} is inside the saved directory {str(given)!r}; it would "
                    "be saved into itself. Choose a staging directory elsewhere."
                )
    root = _usable_root(candidates)
    sweep_staging(root)
    entry, lock_fd = _new_entry(root)
    data = entry / _DATA
    snapshot = FileSnapshot(
        path=data, entry=entry, files=len(local), bytes=0, seconds=0.0, method="", _lock_fd=lock_fd
    )
    methods: set[str] = set()
    try:
        data.mkdir(mode=0o700)
        for item in local:
            target = data / item.rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                snapshot.bytes += _copy(item.path, target, methods)
                os.chmod(target, item.mode)  # the tree records the copy's mode: make it the original's
            except FileNotFoundError:
                raise InvalidValueError(
                    f"file {item.rel!r} disappeared while the checkpoint was being snapshotted; nothing was "
                    "committed (the previous checkpoint is intact). Do not change the directory while it is saved."
                ) from None
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise OSError(
                        exc.errno,
                        f"no space to snapshot {str(given)!r} into {str(root)!r} for a background save "
                        f"({exc.strerror}); nothing was committed. Free space there, pass another staging "
                        "directory, or save with wait=True (no copy).",
                    ) from exc
                raise
    except BaseException:
        snapshot.discard()
        raise
    if given.is_file():
        snapshot.path = data / given.name
    snapshot.method = " + ".join(sorted(methods)) or "nothing to copy"
    snapshot.seconds = time.monotonic() - started
    return snapshot


def sweep_staging(root: Path) -> list[Path]:
    """Remove the staging entries under ``root`` whose process is gone; return what was removed.

    An entry is dead when its lock can be taken (the kernel released it with its process). An entry caught in
    creation (``.new-...``) is removed only once it is older than a minute and unlocked.
    """
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        entry = root / name
        final = _ENTRY.fullmatch(name) is not None
        if not final and _NEW.fullmatch(name) is None:
            continue  # never touch anything this module did not create
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue
        if not final and time.time() - st.st_mtime < _ABANDONED_AFTER:
            continue
        free, fd = _try_lock(entry / _LOCK)
        if not free:
            continue  # held: a live save of this or another process
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _try_lock(path: Path) -> tuple[bool, int | None]:
    """Whether nobody holds the lock file ``path``, and our fd holding it (``None`` when there is no such file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True, None  # half removed by a sweeper that died, or never locked: nobody can hold it
    except OSError:
        return False, None  # not ours to judge (a link, no permission)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False, None
    return True, fd


def _new_entry(root: Path) -> tuple[Path, int]:
    """Create ``root/save-<pid>-<random>`` with its lock already held.

    The entry is built under a ``.new-`` name and renamed once locked, so a sweeper never sees a final entry
    whose lock is not yet taken.
    """
    for _ in range(3):
        _ensure_private_root(root)
        name = f"save-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        building = root / f".new-{name}"
        try:
            building.mkdir(mode=0o700)
        except FileNotFoundError:
            continue  # the root was removed (emptied by another task) between the two calls: make it again
        fd = os.open(building / _LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        entry = root / name
        building.rename(entry)
        return entry, fd
    raise OSError(f"could not create a staging entry in {str(root)!r}")


def _ensure_private_root(root: Path) -> None:
    """Make ``root`` (mode 0700) or check that it is a real directory of ours: copies of checkpoints go there."""
    try:
        root.mkdir(mode=0o700, parents=True)
        return
    except FileExistsError:
        pass
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise InvalidValueError(
            f"staging directory {str(root)!r} is not a directory owned by this user (a link, a file, or another "
            "user's); refusing to copy checkpoint data into it."
        )


def _copy(src: Path, dst: Path, methods: set[str]) -> int:
    """Copy one file; ``os.copy_file_range`` (in-kernel, a reflink where the filesystem can) when possible."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        copied = _copy_range(fin.fileno(), fout.fileno())
        if copied is not None:
            methods.add("copy_file_range")
            return copied
        methods.add("read/write")
        total = 0
        while chunk := fin.read(_COPY_CHUNK):
            fout.write(chunk)
            total += len(chunk)
        return total


def _copy_range(fin: int, fout: int) -> int | None:
    """Bytes copied with ``copy_file_range`` until end of file; ``None`` if the call is refused before any byte."""
    copy_file_range = getattr(os, "copy_file_range", None)
    if copy_file_range is None:
        return None
    total = 0
    while True:
        try:
            n = copy_file_range(fin, fout, 1 << 30)
        except OSError as exc:
            if total == 0 and exc.errno in _NO_COPY_RANGE:
                return None
            raise
        if n == 0:
            return total
        total += n
