"""WriterView: what a writer sees of its identity, and the reads it makes without changing anything.

A :class:`~airflow_stateful.core.protocol.session.WriterSession` is one: its newest checkpoint and value as this
writer knows them (the one it started from, or its last commit), the store's view as it is now (history, head,
the newest checkpoint another process may have committed), a checkpoint's outputs and files, and restores that go
through the writer's restore cache first and say how warm they were. Task and operator code read through these
instead of reaching into the checkpoint store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from airflow_stateful.core.data.cache_use import describe_use
from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.data.restore import ChunkCache
from airflow_stateful.core.data.restore_modes import EXACT, RestoreResult, check_mode
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import OutputInfo
from airflow_stateful.core.records.trees import Tree
from airflow_stateful.core.records.writer import WriterInfo

log = logging.getLogger("airflow_stateful")


class WriterView:
    """One writer's view of its identity.

    :param checkpoints: the identity's checkpoint store.
    :param writer: who writes (its node is compared with the checkpoint's in the restore cache's line).
    :param restore_cache: the worker's (or node's) restore cache (see :meth:`use_restore_cache`).
    """

    def __init__(
        self,
        *,
        checkpoints: CheckpointStore,
        writer: WriterInfo,
        restore_cache: LocalChunkCache | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.identity = checkpoints.identity
        self.writer = writer
        self._latest: Manifest | None = None
        self._value: Any = None
        self.restore_cache: LocalChunkCache | None = None
        self._cache_runner = "this worker"
        if restore_cache is not None:
            self.use_restore_cache(restore_cache)

    def use_restore_cache(self, cache: LocalChunkCache | None, *, runner: str = "this worker") -> None:
        """Keep what this writer commits in ``cache`` and restore from it first (``None``: no cache). ``runner``
        names where this writer runs in the line a restore logs (the pod client says ``"this pod"``)."""
        self.restore_cache, self._cache_runner = cache, runner
        self.checkpoints.chunk_cache = cache  # uploads fill it from memory

    def history(self) -> list[CheckpointEntry]:
        """The identity's kept checkpoints, newest first (read now)."""
        return self.checkpoints.history()

    def head(self) -> HeadRecord | None:
        """The identity's head as it is now (read now)."""
        return self.checkpoints.head()

    def read_latest(self) -> Manifest | None:
        """The newest checkpoint as the store has it now: another process (the pod this operator runs) may have
        committed since :attr:`latest`, which is this session's own view."""
        return self.checkpoints.latest()

    def outputs(self, manifest: Manifest) -> dict[str, OutputInfo]:
        """The outputs ``manifest`` carries, by name."""
        return self.checkpoints.outputs(manifest)

    def tree(self, manifest: Manifest) -> Tree | None:
        """The file tree of ``manifest`` (no request for one this writer just wrote or read)."""
        return self.checkpoints.tree(manifest)

    @property
    def store_url(self) -> str:
        """Where the identity's objects live."""
        return self.checkpoints.store.url

    @property
    def latest(self) -> Manifest | None:
        """The newest checkpoint this session knows: the one it started from (or migrated), or its last commit."""
        return self._latest

    @property
    def value(self) -> Any:
        """The value of :attr:`latest`, decoded (and migrated); ``None`` when there is none."""
        return self._value

    def restore_files(
        self,
        dest: str | Path,
        manifest: Manifest | None = None,
        *,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
        shared_dest: bool = False,
    ) -> RestoreResult:
        """Restore the files of ``manifest`` (default :attr:`latest`) into ``dest``; what it did, also logged.

        ``mode`` defaults to ``"exact"``: the task owns the directory it saves and restores, so a retry sees
        exactly the checkpoint's files, never the part files a killed try left beside them (see
        :meth:`CheckpointStore.restore_files` for ``"merge"`` and ``"empty"``). With no checkpoint yet, or one
        without files, ``dest`` is left as it is and the result is false. ``cache``: where chunks may be found
        first; default: this writer's restore cache, whose use is then logged in one line. ``shared_dest``: a
        ``dest`` another user owns or may write is refused unless this says it is shared knowingly."""
        mode = check_mode(mode)
        manifest = manifest or self._latest
        if manifest is None:
            result = RestoreResult(dest=Path(dest), mode=mode, seq=None, untouched=True)
            log.info("%s", result.describe())
            return result
        local = self.restore_cache if cache is None and manifest.has_files else None
        before = local.stats if local is not None else None
        result = self.checkpoints.restore_files(
            manifest, dest, mode=mode, cache=cache or local, shared_dest=shared_dest
        )
        if local is not None and before is not None:
            log.info("%s", describe_use(local, before, manifest, self.writer, runner=self._cache_runner))
        log.info("%s", result.describe())
        return result
