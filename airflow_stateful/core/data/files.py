"""Turning a user's ``files=`` argument into a checked list of files, before anything is written."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from airflow_stateful.core.data.file_index import FileStatus
from airflow_stateful.core.errors import CheckpointCorruptError, InvalidValueError
from airflow_stateful.core.records.trees import MAX_PATH


@dataclass(frozen=True)
class LocalFile:
    """A file to checkpoint: where it is now and the relative path it is restored to.

    ``where`` is the file's path as text: a save of 10,000 small files only opens each one, and building a
    :class:`~pathlib.Path` per file cost more than a tenth of such a re-save (docs/performance.md, issue 32);
    :attr:`path` makes one for callers that want it."""

    where: str
    rel: str
    size: int
    mode: int = 0o600
    """Its permission bits (``stat.S_IMODE & 0o777``), recorded in the tree and applied by a restore."""
    status: FileStatus | None = None
    """Its status as the listing saw it, before anything read it: what the writer's file index compares
    (:mod:`~airflow_stateful.core.data.file_index`), so a re-save stats each file once, not twice."""

    @property
    def path(self) -> Path:
        return Path(self.where)


def collect_files(
    files: str | os.PathLike[str] | None,
    *,
    exclude: Collection[str] = (),
    follow_symlinks: bool = False,
) -> list[LocalFile]:
    """List the regular files of a file or directory tree, sorted by relative path.

    A single file is restored under its own name; a directory's files keep their paths below it. Empty
    directories are not recorded. Special files (pipes, sockets, devices) are refused by name. ``exclude``
    names relative paths to leave out (the pod client keeps its value file beside the data).

    Symbolic links inside the tree are refused by name unless ``follow_symlinks`` is given; then a link is
    saved as what it points to, which must be inside the saved directory (a link out of it, a dangling link
    and a loop are refused by name). Either way nothing outside the directory is ever read. ``files`` itself
    may be a link: it is the user's own choice of what to save.
    """
    if files is None:
        return []
    if not isinstance(files, (str, os.PathLike)):
        raise InvalidValueError(
            f"files must be a path to a file or directory, not {type(files).__name__} {files!r}"
        )
    given = Path(files)
    if not given.exists():
        raise InvalidValueError(f"files={str(given)!r} does not exist.")
    if given.is_file():
        _check_restorable(given.name, shown=str(given))
        st = given.stat()
        return [
            LocalFile(
                where=os.fspath(given),
                rel=given.name,
                size=st.st_size,
                mode=stat.S_IMODE(st.st_mode) & 0o777,
                status=FileStatus.of(st),
            )
        ]
    if not given.is_dir():
        raise InvalidValueError(f"files={str(given)!r} is neither a regular file nor a directory.")
    root = given.resolve()
    found: list[LocalFile] = []
    visited = {root}
    # One scandir per directory, its entries' types from the listing and one lstat per file (the entry's own,
    # kept for the file index): a tree of 10,000 small files spent more listing itself than reading its bytes
    # (docs/performance.md, issue 32).
    pending: list[tuple[str, str]] = [(os.fspath(root), "")]
    try:
        while pending:
            directory, prefix = pending.pop()
            with os.scandir(directory) as listing:
                entries = list(listing)
            for entry in entries:
                full = entry.path
                if entry.is_dir(follow_symlinks=False):
                    pending.append((full, prefix + entry.name + "/"))
                    continue
                source: Path | None = None
                try:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISLNK(st.st_mode):
                        source = _link_target(Path(full), root=root, given=given, follow=follow_symlinks)
                        if source.is_dir():
                            if source in visited:
                                raise InvalidValueError(
                                    f"{_shown(Path(full), root, given)!r} links back to a directory already "
                                    "saved (a loop); remove the link."
                                )
                            visited.add(source)
                            pending.append((full, prefix + entry.name + "/"))
                            continue
                        st = source.stat()
                except FileNotFoundError:
                    raise InvalidValueError(
                        f"{_shown(Path(full), root, given)!r} disappeared while the checkpoint was prepared; "
                        "nothing was written."
                    ) from None
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidValueError(
                        f"{_shown(Path(full), root, given)!r} is not a regular file (pipe, socket or device); move "
                        f"it out of {str(given)!r}."
                    )
                rel = prefix + entry.name
                if not (rel.isascii() and "\\" not in rel and len(rel) <= MAX_PATH) and path_problem(rel):
                    # A listed name is never empty, ".", ".." or holds "/": only these can be wrong with it.
                    _check_restorable(rel, shown=_shown(Path(full), root, given))
                if rel not in exclude:
                    found.append(
                        LocalFile(
                            full if source is None else os.fspath(source),
                            rel,
                            st.st_size,
                            stat.S_IMODE(st.st_mode) & 0o777,
                            FileStatus(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
                        )
                    )
    except OSError as error:
        # Any other failure to read the tree (a directory that cannot be listed, a path too long for the
        # system, an I/O error) names the place and writes nothing.
        where = Path(error.filename) if isinstance(error.filename, str) else root
        shown = _shown(where, root, given) if root in where.parents else str(where)
        raise InvalidValueError(
            f"{shown!r} cannot be read ({error.strerror or error}); nothing was written."
        ) from error
    found.sort(key=lambda f: f.rel)
    return found


def _shown(path: Path, root: Path, given: Path) -> str:
    """``path`` as the user knows it: below the directory they passed, not its resolved form."""
    return str(given / path.relative_to(root))


def _link_target(path: Path, *, root: Path, given: Path, follow: bool) -> Path:
    """Where the link ``path`` leads, if links may be followed and it stays inside ``root``."""
    shown = _shown(path, root, given)
    if not follow:
        raise InvalidValueError(
            f"{shown!r} is a symbolic link; links are not saved by default. Pass follow_symlinks=True to save "
            "what it points to (which must be inside the saved directory), or remove it."
        )
    try:
        target = path.resolve(strict=True)
    except FileNotFoundError:
        raise InvalidValueError(
            f"{shown!r} is a dangling symbolic link (its target does not exist)."
        ) from None
    except RuntimeError:  # a loop of links
        raise InvalidValueError(f"{shown!r} is a loop of symbolic links.") from None
    if target != root and root not in target.parents:
        raise InvalidValueError(
            f"{shown!r} links to {str(target)!r}, outside the saved directory {str(given)!r}; a checkpoint "
            "never reads outside the directory it saves."
        )
    return target


def check_restore_targets(dest: Path, rels: Collection[PurePosixPath]) -> None:
    """Refuse a restore that would write through a link or onto a file, before anything is moved.

    Every directory on the way from ``dest`` to each file must be a real directory or not exist yet: a
    symbolic link already inside ``dest`` (planted, or left by the job) would redirect the restore outside
    ``dest``, and a file where a directory belongs would stop it half-way.
    """
    checked: set[str] = set()
    base = str(dest)
    for rel in rels:
        name = str(rel)
        for parent in dir_prefixes(name):
            if parent in checked:
                continue
            checked.add(parent)
            check_restore_directory(dest / parent, where=" inside the restore destination")
        target = os.path.join(base, name)
        try:
            is_dir = stat.S_ISDIR(os.lstat(target).st_mode)  # a real directory, not a link to one
        except FileNotFoundError:
            is_dir = False
        if is_dir:
            raise InvalidValueError(
                f"{target!r} is a directory where the checkpoint has a file; remove it (nothing was restored)."
            )


def dir_prefixes(name: str) -> Iterator[str]:
    """The directories on the way to relative path ``name``, outermost first (``a``, ``a/b`` for ``a/b/c``):
    what ``PurePosixPath(name).parents`` names, without building a path object per level (a restore of many
    small files spent more on those than on the files)."""
    at = name.find("/")
    while at != -1:
        yield name[:at]
        at = name.find("/", at + 1)


def check_restore_directory(path: Path, *, where: str = "") -> None:
    """Refuse a restore into ``path`` (a directory output's own path, or a directory on the way to a file) when
    it is a link or a file: a restore never writes through links, and a file there would stop it. Nothing has
    been changed when it raises; ``where`` says where the link is, in the message."""
    if path.is_symlink():
        raise InvalidValueError(
            f"{str(path)!r} is a symbolic link{where}; a restore never writes through links. Remove it (nothing "
            "was restored)."
        )
    if path.exists() and not path.is_dir():
        raise InvalidValueError(
            f"{str(path)!r} is a file where the checkpoint has a directory; remove it (nothing was restored)."
        )


def path_problem(rel: str) -> str | None:
    """Why a checkpoint may not record the relative path ``rel``, or ``None``.

    The one rule for both sides: save refuses (by name, before anything is written) exactly the paths that
    restore refuses, so a checkpoint that was written can always be restored.
    """
    if not rel or rel.startswith("/") or any(part in ("", ".", "..") for part in rel.split("/")):
        return "it would restore outside the target directory"
    if "\\" in rel:
        return "it has a backslash, which restore refuses (on Windows it is a path separator)"
    if "\x00" in rel:
        return "it has a NUL character"
    if len(rel) > MAX_PATH:
        return f"it is longer than {MAX_PATH} characters"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid UTF-8 (the file system holds bytes no text encoding can record)"
    return None


def _check_restorable(rel: str, *, shown: str) -> None:
    problem = path_problem(rel)
    if problem is not None:
        raise InvalidValueError(
            f"{shown!r} cannot be checkpointed: {problem}. Rename it or move it out of the saved directory "
            "(nothing was written)."
        )


def safe_relative(rel: str, *, manifest_key: str) -> PurePosixPath:
    """Refuse manifest paths that would restore outside the destination directory (or that save refuses)."""
    problem = path_problem(rel)
    if problem is not None:
        raise CheckpointCorruptError(f"manifest {manifest_key!r} lists the file path {rel!r}: {problem}.")
    return PurePosixPath(rel)


def check_distinct_paths(rels: Collection[PurePosixPath], *, manifest_key: str) -> None:
    """Refuse a file list naming one path twice, or a path that is both a file and a directory (``a`` and
    ``a/b``): no directory can hold both, and a restore would fail half-way. Save never writes such a list."""
    files = {str(rel) for rel in rels}
    if len(files) != len(rels):
        raise CheckpointCorruptError(f"manifest {manifest_key!r} lists a file path twice.")
    for name in files:
        for parent in dir_prefixes(name):
            if parent in files:
                raise CheckpointCorruptError(
                    f"manifest {manifest_key!r} lists {parent!r} as a file and {name!r} below it; "
                    "nothing was restored."
                )
