"""Checksum verification shared by every store: wrong bytes are never handed to a caller.

Downloads go through :class:`VerifiedFileWriter`, which writes to a temporary file beside the
destination, hashes every byte on the way, and gives the file its real name only when size and SHA-256
match what the manifest recorded. A corrupt or truncated object therefore never appears at ``dest``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.stores.base import CHUNK_SIZE, ProgressCallback


def check_digest(*, key: str, where: str, size: int, sha256: str, got_size: int, got: str) -> None:
    """Raise CheckpointCorruptError naming the object when the bytes are not the recorded ones."""
    if got_size != size or got != sha256:
        raise CheckpointCorruptError(
            f"object {key!r} in {where} is corrupt: expected {size} bytes with SHA-256 {sha256}, "
            f"read {got_size} bytes with SHA-256 {got}. The bytes were not used. Restore an older "
            "checkpoint (see `airflow-stateful history`) or investigate the store."
        )


class VerifiedFileWriter:
    """Sequential writer that publishes ``dest`` only if the written bytes match ``size`` and ``sha256``."""

    def __init__(
        self,
        dest: Path,
        *,
        key: str,
        where: str,
        size: int,
        sha256: str,
        progress: ProgressCallback | None = None,
    ) -> None:
        self.dest = Path(dest)
        self.key, self.where, self.size, self.sha256 = key, where, size, sha256
        self.progress = progress
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.dest.with_name(f".{self.dest.name}.{uuid.uuid4().hex[:12]}.partial")
        self._digest = hashlib.sha256()
        self._written = 0
        self._fh: BinaryIO | None = None

    def __enter__(self) -> VerifiedFileWriter:
        self._fh = open(self._tmp, "wb")
        return self

    def write(self, chunk: bytes) -> None:
        assert self._fh is not None, "use VerifiedFileWriter as a context manager"
        self._digest.update(chunk)
        self._fh.write(chunk)
        self._written += len(chunk)
        if self._written > self.size:
            # Stop early: an object longer than recorded is corrupt, no need to read the rest.
            self._verify()
        if self.progress:
            self.progress(len(chunk))

    def _verify(self) -> None:
        check_digest(
            key=self.key,
            where=self.where,
            size=self.size,
            sha256=self.sha256,
            got_size=self._written,
            got=self._digest.hexdigest(),
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._fh is not None:
                self._fh.close()
            if exc_type is None:
                self._verify()
                os.replace(self._tmp, self.dest)
        finally:
            self._tmp.unlink(missing_ok=True)


class Readable(Protocol):
    """A byte stream: a file, or botocore's StreamingBody."""

    def read(self, amt: int = ..., /) -> bytes: ...

    def close(self) -> None: ...


def copy_verified(
    src: Readable,
    dest: Path,
    *,
    key: str,
    where: str,
    size: int,
    sha256: str,
    progress: ProgressCallback | None = None,
) -> None:
    """Copy a stream to ``dest``, publishing it only if size and SHA-256 match. Closes ``src``."""
    with (
        contextlib.closing(src),
        VerifiedFileWriter(dest, key=key, where=where, size=size, sha256=sha256, progress=progress) as w,
    ):
        while chunk := src.read(CHUNK_SIZE):
            w.write(chunk)
