"""CheckpointReader: one identity's committed checkpoints, read without a lease, every byte verified.

Everything a sensor, the CLI, the UI or a restore needs: the head, the kept checkpoints, their manifests, files
and outputs. The head (read fresh on every call unless the caller passes one it holds) says which checkpoints
exist; the content layer (:class:`~airflow_stateful.core.data.content.ContentStore`) fetches and verifies their
bytes. A reader never writes: :class:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore`, which
adds leases and commits, is one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from airflow_stateful.core.data.content import ContentStore, StoredFileInfo
from airflow_stateful.core.data.file_index import FileIndex
from airflow_stateful.core.data.restore import ChunkCache
from airflow_stateful.core.data.restore_modes import EXACT, RestoreResult, check_mode
from airflow_stateful.core.errors import CheckpointCorruptError, CheckpointNotFoundError, ObjectNotFoundError
from airflow_stateful.core.protocol.heads import HeadStore
from airflow_stateful.core.protocol.marks import MarkStore
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.integrity import HeadSigner
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import OutputInfo, check_output_name
from airflow_stateful.core.records.trees import Tree, TreeFile
from airflow_stateful.core.stores.base import ObjectStore


class CheckpointReader:
    """The committed checkpoints of one identity in one object store.

    :param store: where the objects live.
    :param identity: whose checkpoints these are.
    :param signer: the deployment's head signing policy (:class:`~airflow_stateful.core.records.integrity.HeadSigner`;
        ``None``: heads are neither signed nor required to be).
    :param marks: where the identity's high-water mark is kept (``None``: not checked).
    :param clock: seconds since the epoch; injectable for tests of expiry.
    :param parallelism: chunks moved at once by a restore; default: what the store suits.
    """

    def __init__(
        self,
        *,
        store: ObjectStore,
        identity: Identity,
        signer: HeadSigner | None = None,
        marks: MarkStore | None = None,
        clock: Callable[[], float] = time.time,
        parallelism: int | None = None,
    ) -> None:
        if not isinstance(identity, Identity):
            raise TypeError(f"identity must be an Identity, not {type(identity).__name__}")
        self.store = store
        self.identity = identity
        self.clock = clock
        #: The head signing policy every head of this identity is written and read with.
        self.signer = signer
        self.heads = HeadStore(store=store, identity=identity, signer=signer, marks=marks, clock=clock)
        #: The identity's bytes (chunks, trees, manifest objects, outputs), read and written below the head.
        self.content = ContentStore(store=store, identity=identity, parallelism=parallelism)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(identity={self.identity.key!r}, store={self.store!r})"

    @property
    def parallelism(self) -> int:
        """Chunks moved at once by a commit or a restore (the content store's: one number, not a copy)."""
        return self.content.parallelism

    @property
    def file_index(self) -> FileIndex:
        """The files this writer saved last (a re-save reads only the files that changed)."""
        return self.content.file_index

    @property
    def chunk_cache(self) -> ChunkCache | None:
        """The worker's restore cache every uploaded chunk is also kept in, if the writer has one."""
        return self.content.chunk_cache

    @chunk_cache.setter
    def chunk_cache(self, cache: ChunkCache | None) -> None:
        self.content.chunk_cache = cache

    def head(self) -> HeadRecord | None:
        return self.heads.load()[0]

    def history(self) -> list[CheckpointEntry]:
        """Committed checkpoints still kept, newest first."""
        head = self.head()
        return list(reversed(head.checkpoints)) if head else []

    def latest(self, head: HeadRecord | None = None) -> Manifest | None:
        """The newest checkpoint, verified, or ``None`` when nothing was committed yet.

        :param head: a head this process just read or wrote (after taking the lease): with an inline manifest
            that costs no request at all.
        """
        for attempt in range(5):
            if head is None or attempt:
                head = self.head()
            if head is None or head.latest is None:
                return None
            try:
                return self.content.read_manifest(head.latest)
            except ObjectNotFoundError:
                # Pruned between our head read and the manifest read? Re-read the head and try again.
                if self._still_listed(head.latest):
                    raise self._missing(head.latest) from None
        raise CheckpointNotFoundError(f"identity {self.identity} kept changing while it was read; try again.")

    def get(self, seq: int) -> Manifest:
        """A kept checkpoint by number, verified."""
        head = self.head()
        entries = {e.seq: e for e in (head.checkpoints if head else ())}
        if seq not in entries:
            kept = ", ".join(str(s) for s in sorted(entries)) or "none"
            raise CheckpointNotFoundError(f"identity {self.identity} has no checkpoint {seq}; kept: {kept}.")
        try:
            return self.content.read_manifest(entries[seq])
        except ObjectNotFoundError:
            if self._still_listed(entries[seq]):
                raise self._missing(entries[seq]) from None
            raise CheckpointNotFoundError(
                f"checkpoint {seq} of {self.identity} was pruned while it was read."
            ) from None

    def _still_listed(self, entry: CheckpointEntry) -> bool:
        head = self.head()
        return head is not None and any(e.commit_id == entry.commit_id for e in head.checkpoints)

    def _missing(self, entry: CheckpointEntry) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint {entry.seq} of {self.identity} is listed in the head record but its manifest "
            f"{entry.manifest!r} is missing from {self.store.url}. Something deleted it outside this library; "
            "roll back to an older checkpoint with `airflow-stateful rollback`."
        )

    def read_manifest(self, entry: CheckpointEntry) -> Manifest:
        """The manifest of ``entry``, one of the checkpoints of a head record of this identity, verified
        (:meth:`~airflow_stateful.core.data.content.ContentStore.read_manifest`; a missing object raises
        ObjectNotFoundError as it is: :meth:`get` and :meth:`latest` tell a pruned checkpoint from a lost one)."""
        return self.content.read_manifest(entry)

    def files(self, manifest: Manifest) -> list[StoredFileInfo]:
        """The files of a checkpoint (its tree's): path, size and the chunks holding its bytes."""
        return self.content.files(manifest)

    def tree(self, manifest: Manifest) -> Tree | None:
        """The file tree of a checkpoint, verified against its recorded SHA-256 (``None``: it has no files)."""
        return self.content.tree(manifest)

    def restore_files(
        self,
        manifest: Manifest,
        dest: str | Path,
        *,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
        shared_dest: bool = False,
        durable: bool = False,
    ) -> RestoreResult:
        """Download a checkpoint's files into directory ``dest``, verified, all or nothing; what it did.

        Files land in a staging directory first; only when every file is verified are they moved into
        ``dest``. On any error (or a kill: the next restore undoes it) ``dest`` is left as it was. ``mode``
        says what happens to what ``dest`` already holds (:mod:`airflow_stateful.core.data.restore_modes`):
        ``"exact"`` (default) makes it hold exactly the checkpoint's files, the others moved out within the same
        all-or-nothing swap; ``"merge"`` replaces same-named files and keeps the others; ``"empty"`` refuses a
        ``dest`` that is not missing or empty (DestinationNotEmptyError, before anything is downloaded). A
        checkpoint without files leaves ``dest`` alone. ``cache`` may supply chunks without downloading them
        (verified like downloaded ones). ``dest`` must be this user's and writable by nobody else (another writer
        could plant links or an interrupted restore's journal there): InvalidValueError before anything is
        written, unless ``shared_dest=True`` says the caller shares it knowingly. ``durable=True`` fsyncs every
        restored file before it is moved into place: for a directory that outlives the task (the CLI's ``cat
        --files``); a task's own restore does not need it, its retry restores again (docs/adr/0006-packs.md).
        """
        return self.content.restore_files(
            manifest, dest, mode=mode, cache=cache, shared_dest=shared_dest, durable=durable
        )

    def verify(self, manifest: Manifest) -> None:
        """Read back every byte of a checkpoint and check every hash (its tree's chunks); raise
        CheckpointCorruptError naming the first bad object. Nothing is kept."""
        self.content.verify(manifest)

    # -- outputs ---------------------------------------------------------------------------------------------
    def outputs(self, manifest: Manifest | None = None) -> dict[str, OutputInfo]:
        """The outputs committed so far (by the newest checkpoint, or by ``manifest``), by name; ``{}`` before
        the first commit that carried outputs. Only committed outputs are ever listed."""
        return self.content.outputs(manifest if manifest is not None else self.latest())

    def output_files(self, manifest: Manifest, name: str) -> list[TreeFile]:
        """The files of committed output ``name`` of ``manifest``, verified (see :class:`ContentStore`)."""
        return self.content.output_files(manifest, name)

    def restore_output(
        self,
        name: str,
        dest: str | Path,
        *,
        manifest: Manifest | None = None,
        mode: str = EXACT,
        cache: ChunkCache | None = None,
        shared_dest: bool = False,
    ) -> RestoreResult:
        """Download committed output ``name`` to ``dest/<name>`` (a file, or a directory of its files), every chunk
        verified, all or nothing; what it did. Default: the output as the newest checkpoint has it. ``mode`` as
        for :meth:`restore_files`, applied to the output's own path only
        (:meth:`~airflow_stateful.core.data.content.ContentStore.restore_output`)."""
        check_output_name(name)
        check_mode(mode)
        manifest = manifest or self.latest()
        if manifest is None:
            raise CheckpointNotFoundError(f"identity {self.identity} has no checkpoint, so no outputs")
        return self.content.restore_output(
            name, dest, manifest=manifest, mode=mode, cache=cache, shared_dest=shared_dest
        )
