"""What a restore does with what its destination already holds: the modes by name, their checks, the result.

A restore into a directory that already has files must not leave a mix nobody asked for: a retry that restores
its work directory must not see the part files the killed try left beside the restored ones. So every restore
names a mode:

* ``"exact"``: afterwards the destination holds exactly the checkpoint's files. What it does not have (files,
  links, directories) is moved aside inside the same journaled, all-or-nothing swap as the restored files
  (:mod:`airflow_stateful.core.data.restore`) and deleted only once the swap completed.
* ``"merge"``: files of the same name are replaced, every other file is left.
* ``"empty"``: refuse, before anything is downloaded, unless the destination is missing or empty.

The library's own working directories at the top of the destination are never content: not counted, never
removed. They are a restore's staging (``.stateful-restore-*``) and a background save's snapshot staging
(``.stateful-staging``, beside a saved file, so inside the directory it is restored to; it may be in use).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from airflow_stateful.core.data.files import dir_prefixes
from airflow_stateful.core.data.snapshot import STAGING_DIRNAME
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.errors import DestinationNotEmptyError, InvalidValueError

EXACT, MERGE, EMPTY = "exact", "merge", "empty"
MODES = (EXACT, MERGE, EMPTY)
"""The restore modes, by name."""

STAGING_PREFIX = ".stateful-restore-"
"""Name prefix of the staging directory a restore builds inside its destination."""


def ours(name: str) -> bool:
    """Whether ``name``, at the top of a destination, is one of the library's working directories."""
    return name.startswith(STAGING_PREFIX) or name == STAGING_DIRNAME


SHOWN = 5
"""How many names an error or a log line lists before "and N more"."""


def check_mode(mode: Any) -> str:
    """``mode`` if it names a restore mode; InvalidValueError naming it and the choices otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        choices = ", ".join(repr(m) for m in MODES)
        raise InvalidValueError(f"restore mode must be one of {choices}, not {mode!r}")
    return mode


def _few(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def content_of(dest: Path) -> list[str]:
    """The names directly in ``dest`` (sorted), the library's working directories left out; ``[]`` if missing."""
    if not dest.is_dir():
        return []
    return sorted(name for name in os.listdir(dest) if not ours(name))


def refuse_unless_empty(dest: Path) -> None:
    """Mode ``"empty"``: DestinationNotEmptyError naming ``dest``, a few of its names and the modes to choose,
    unless it is missing or empty. Nothing has been downloaded or changed when it raises."""
    there = dest.exists() or dest.is_symlink()
    names = content_of(dest) if dest.is_dir() else [dest.name] if there else []
    if not names:
        return
    raise DestinationNotEmptyError(
        f"{refusal(dest, names)}; mode 'empty' restores only where nothing is yet, so nothing was restored. "
        "Choose mode 'exact' to make it hold exactly the checkpoint's files (the others are removed) or 'merge' "
        "to replace same-named files and keep the others.",
        dest=dest,
        names=names,
    )


def refusal(dest: Path, names: list[str]) -> str:
    """The first half of mode "empty"'s refusal: what is in the way (front ends add their own way out)."""
    if dest.is_dir():
        return f"restore destination {str(dest)!r} is not empty (it holds {_few(names)})"
    return f"restore destination {str(dest)!r} already exists"


def not_in_checkpoint(dest: Path, rels: Collection[PurePosixPath]) -> tuple[list[PurePosixPath], list[str]]:
    """What mode ``"exact"`` moves out of ``dest``: the entries the checkpoint's files ``rels`` do not need.

    Returns the entries to move (a file, a link, or a whole directory no checkpoint file lies below: one move
    takes its contents along, so the directory cannot be left behind empty) and, for reporting, every path
    they hold (directories end in ``/``), sorted. Directories on the way to a checkpoint file are kept and
    looked into; links are never followed; the library's working directories at the top are left alone.
    """
    files = {str(rel) for rel in rels}
    dirs = {parent for name in files for parent in dir_prefixes(name)}
    aside: list[PurePosixPath] = []
    listed: list[str] = []
    pending: list[tuple[Path, PurePosixPath | None]] = [(dest, None)]
    while pending:
        directory, base = pending.pop()
        for entry in _entries(directory, dest):
            if base is None and ours(entry.name):
                continue
            rel = PurePosixPath(entry.name) if base is None else base / entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if is_dir and str(rel) in dirs:
                pending.append((Path(entry.path), rel))
            elif str(rel) not in files:
                aside.append(rel)
                listed += _held(Path(entry.path), rel, dest) if is_dir else [str(rel)]
    return aside, sorted(listed)


def _entries(directory: Path, dest: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as found:
            return sorted(found, key=lambda e: e.name)
    except OSError as exc:
        raise InvalidValueError(
            f"{str(directory)!r} cannot be listed ({exc.strerror or exc}); mode 'exact' must know everything in "
            f"{str(dest)!r}. Nothing was restored."
        ) from exc


def _held(root: Path, rel: PurePosixPath, dest: Path) -> list[str]:
    """``rel/`` and every path below it (directories end in ``/``; links are listed, not followed)."""
    held = [f"{rel}/"]

    def unreadable(error: OSError) -> None:
        raise error

    try:
        for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
            here = rel / Path(dirpath).relative_to(root).as_posix()
            held += [str(here / d) if (Path(dirpath) / d).is_symlink() else f"{here / d}/" for d in dirnames]
            held += [str(here / name) for name in filenames]
    except OSError as exc:
        raise InvalidValueError(
            f"{str(root)!r} cannot be listed ({exc.strerror or exc}); mode 'exact' must know everything in "
            f"{str(dest)!r}. Nothing was restored."
        ) from exc
    return held


@dataclass(frozen=True)
class RestoreResult:
    """What one restore did, for the caller and for the log (:meth:`describe`).

    Works where the list of restored paths used to: iterating gives :attr:`files`, ``len()`` is their number,
    and it is true only when files were restored, so ``if not state.restore_files(d)`` keeps its meaning.
    """

    #: The directory restored into (for an output: the output's own path).
    dest: Path
    #: The mode the restore ran in (``"exact"``, ``"merge"`` or ``"empty"``).
    mode: str
    #: The checkpoint restored; ``None`` when there was none yet.
    seq: int | None
    #: The paths of the restored files.
    files: list[Path] = field(default_factory=list)
    #: Relative paths mode ``"exact"`` removed (not in the checkpoint); directories end in ``/``.
    removed: list[str] = field(default_factory=list)
    #: How many restored files replaced a file of the same name.
    replaced: int = 0
    #: Bytes restored.
    bytes: int = 0
    #: What was restored, as the log line names it (``checkpoint``, ``output 'model' of checkpoint``).
    what: str = "checkpoint"
    #: True when ``dest`` was not touched: no checkpoint yet, or one that carries no files.
    untouched: bool = False

    def __iter__(self) -> Iterator[Path]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __bool__(self) -> bool:
        return bool(self.files)

    def describe(self) -> str:
        """One line for the log: what was restored where, and what exact mode removed."""
        if self.seq is None:
            return f"no checkpoint yet: nothing restored, {self.dest} left as it was"
        if self.untouched:
            return f"{self.what} {self.seq} has no files: nothing restored, {self.dest} left as it was"
        line = (
            f"restored {self.what} {self.seq} into {self.dest} ({self.mode}): {len(self.files)} file(s), "
            f"{human_bytes(self.bytes)}"
        )
        if self.replaced:
            line += f", {self.replaced} replaced"
        if self.removed:
            line += f"; removed {len(self.removed)} not in it: {_few(self.removed)}"
        return line

    def to_json(self) -> dict[str, Any]:
        """The result for ``--json`` output."""
        return {
            "dest": str(self.dest),
            "mode": self.mode,
            "seq": self.seq,
            "files": len(self.files),
            "bytes": self.bytes,
            "replaced": self.replaced,
            "removed": list(self.removed),
        }
