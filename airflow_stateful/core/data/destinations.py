"""Whose a restore destination is, and what in it a restore may trust.

A restore writes into ``dest`` and, after a kill, undoes an interrupted restore from the journal and the files
it moved aside in ``dest/.stateful-restore-*``. Whoever else can write ``dest`` could plant both: a link to the
victim's home and a journal saying a file there was "moved aside", and the victim's own restore would put the
planter's file in its place. So:

* a restore refuses a ``dest`` owned by another user or writable by group or others (:func:`check_destination`),
  unless the caller says by name that it shares it knowingly (``shared_dest=True``: a pod's ``emptyDir``);
* recovery trusts only staging directories and journals of this user that nobody else may write
  (:func:`trusted_staging`), and never moves or deletes anything through a link inside ``dest``
  (:func:`first_link`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from airflow_stateful.core.errors import InvalidValueError


def check_destination(dest: Path, *, shared_dest: bool = False) -> None:
    """Refuse to restore into ``dest`` if another user owns it or may write it (InvalidValueError naming which,
    before anything is read or written); a ``dest`` that does not exist yet is created by the restore, 0700-safe.

    A link as ``dest`` must be this user's, and what it points at is checked. ``shared_dest=True`` skips the
    checks: for a directory shared on purpose with writers the caller trusts.
    """
    if shared_dest:
        return
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if stat.S_ISLNK(info.st_mode):
        if info.st_uid != me:
            raise InvalidValueError(
                f"restore destination {str(dest)!r} is a symbolic link owned by uid {info.st_uid}, not by this "
                f"user (uid {me}); nothing was restored. Restore into a directory of your own"
            )
        info = os.stat(dest)
    if not stat.S_ISDIR(info.st_mode):
        return  # the restore says what is wrong with it (not a directory)
    if info.st_uid != me:
        raise InvalidValueError(
            f"restore destination {str(dest)!r} is owned by uid {info.st_uid}, not by this user (uid {me}): "
            "whoever owns it could have planted links or an interrupted restore's journal in it. Nothing was "
            "restored. Restore into a directory of your own, or pass shared_dest=True if you trust that user"
        )
    if info.st_mode & 0o022:
        raise InvalidValueError(
            f"restore destination {str(dest)!r} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}): they could have planted links or an interrupted restore's journal "
            "in it. Nothing was restored. Remove their write permission (chmod go-w), or pass "
            "shared_dest=True if you trust every writer"
        )


def trusted_staging(staging: Path) -> str | None:
    """Why a staging directory (and its journal) found in a destination may not be trusted, or ``None``: it must
    be a real directory and journal of this user that nobody else may write."""
    me = os.geteuid()
    for path, kind in ((staging, stat.S_ISDIR), (staging / "journal.json", stat.S_ISREG)):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            if path is staging:
                return "it is gone"
            continue  # no journal: a restore killed while downloading, nothing to undo
        if not kind(info.st_mode):
            return f"{path.name} is not a {'directory' if kind is stat.S_ISDIR else 'regular file'}"
        if info.st_uid != me:
            return f"{path.name} is owned by uid {info.st_uid}, not by this user (uid {me})"
        if info.st_mode & 0o022:
            return f"{path.name} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def first_link(root: Path, rel: PurePosixPath) -> Path | None:
    """The first directory on the way from ``root`` to ``root / rel`` (``rel``'s parents, not ``rel`` itself)
    that is a symbolic link, or ``None``: moving or deleting ``root / rel`` through it would act outside ``root``."""
    current = root
    for part in rel.parts[:-1]:
        current = current / part
        try:
            if stat.S_ISLNK(os.lstat(current).st_mode):
                return current
        except FileNotFoundError:
            return None
    return None
