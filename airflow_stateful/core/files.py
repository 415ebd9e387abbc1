"""Turning a user's ``files=`` argument into a checked list of files, before anything is written."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from airflow_stateful.core.errors import CheckpointCorruptError, InvalidValueError


@dataclass(frozen=True)
class LocalFile:
    """A file to checkpoint: where it is now and the relative path it is restored to."""

    path: Path
    rel: str
    size: int


def collect_files(files: str | os.PathLike[str] | None, *, exclude: Collection[str] = ()) -> list[LocalFile]:
    """List the regular files of a file or directory tree, sorted by relative path.

    A single file is restored under its own name; a directory's files keep their paths below it. Empty
    directories are not recorded. Special files (pipes, sockets, devices) are refused by name. ``exclude``
    names relative paths to leave out (the pod client keeps its value file beside the data).
    """
    if files is None:
        return []
    if not isinstance(files, (str, os.PathLike)):
        raise InvalidValueError(
            f"files must be a path to a file or directory, not {type(files).__name__} {files!r}"
        )
    root = Path(files)
    if not root.exists():
        raise InvalidValueError(f"files={str(root)!r} does not exist.")
    if root.is_file():
        return [LocalFile(path=root, rel=root.name, size=root.stat().st_size)]
    if not root.is_dir():
        raise InvalidValueError(f"files={str(root)!r} is neither a regular file nor a directory.")
    found: list[LocalFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()  # follows symlinks: a link to a file is saved as that file's bytes
            if not stat.S_ISREG(st.st_mode):
                raise InvalidValueError(
                    f"{str(path)!r} is not a regular file (pipe, socket or device); move it out of {str(root)!r}."
                )
            rel = path.relative_to(root).as_posix()
            if rel not in exclude:
                found.append(LocalFile(path=path, rel=rel, size=st.st_size))
    found.sort(key=lambda f: f.rel)
    return found


def safe_relative(rel: str, *, manifest_key: str) -> PurePosixPath:
    """Refuse manifest paths that would restore outside the destination directory."""
    path = PurePosixPath(rel)
    if (
        not rel
        or path.is_absolute()
        or any(part in ("", ".", "..") for part in rel.split("/"))
        or "\\" in rel
    ):
        raise CheckpointCorruptError(
            f"manifest {manifest_key!r} lists the file path {rel!r}, which would restore outside the target directory."
        )
    return path
