"""A real store wrapped so a test can "kill the process" at any store call.

This is not a mock: every call goes to the real store (local directory or S3 over HTTP). The wrapper
only counts calls and, at the chosen one, raises :class:`SimulatedCrash` either before the call (the
request never left) or after it (the request took effect but the writer died before seeing the answer).
``SimulatedCrash`` derives from BaseException so no ``except Exception`` in the code under test can
swallow it, just as nothing survives a SIGKILL.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from airflow_stateful.core.stores.base import Blob, ObjectInfo, ObjectStore, ProgressCallback, StoredFile


class SimulatedCrash(BaseException):
    pass


class CrashingStore(ObjectStore):
    def __init__(self, inner: ObjectStore, *, crash_at: int | None = None, after: bool = False) -> None:
        self.inner = inner
        self.url = inner.url
        self.crash_at = crash_at
        self.after = after
        self.calls: list[str] = []

    def _call(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        index = len(self.calls)
        self.calls.append(name)
        if index == self.crash_at and not self.after:
            raise SimulatedCrash(f"crash before call {index} ({name})")
        result = fn(*args, **kwargs)
        if index == self.crash_at and self.after:
            raise SimulatedCrash(f"crash after call {index} ({name})")
        return result

    def get(self, key: str, *, max_bytes: int | None = None) -> Blob:
        return self._call("get", self.inner.get, key, max_bytes=max_bytes)

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        adopt_identical: bool = True,
    ) -> str:
        return self._call(
            "put",
            self.inner.put,
            key,
            data,
            if_none_match=if_none_match,
            if_match=if_match,
            adopt_identical=adopt_identical,
        )

    def upload_file(self, key: str, path: Path, *, progress: ProgressCallback | None = None) -> StoredFile:
        return self._call("upload_file", self.inner.upload_file, key, path, progress=progress)

    def download_file(
        self, key: str, dest: Path, *, size: int, sha256: str, progress: ProgressCallback | None = None
    ) -> None:
        return self._call(
            "download_file", self.inner.download_file, key, dest, size=size, sha256=sha256, progress=progress
        )

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(self._call("list_objects", lambda p: list(self.inner.list_objects(p)), prefix))

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        return self._call("delete", self.inner.delete, key, if_match=if_match)

    def delete_many(self, keys: Iterable[str]) -> None:
        return self._call("delete_many", self.inner.delete_many, list(keys))


class FakeClock:
    """Seconds since the epoch that only move when the test says so (lease expiry without sleeping).

    It starts at the real time, so lease times and the store's own last-modified stamps agree until the
    test moves it (GC compares the two: what a lease holder wrote is newer than its acquisition).
    """

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
