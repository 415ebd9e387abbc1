"""Rolling an identity back: commit a copy of an older checkpoint as the newest, saying it is a copy.

One function, so that whoever rolls back (the CLI's ``rollback``, a script) writes the same copy: the value as
stored (a pickle is never unpickled here), the same files by reference, the same schema and code identity, and
the lineage (``copy_of``, :mod:`airflow_stateful.core.records.lineage`) in the copy's immutable manifest, which
is what ``history``, ``show`` and the UI read. Retention may drop the original afterwards (it is an older
checkpoint now); the lineage names its seq and commit id all the same.
"""

from __future__ import annotations

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.lease import Lease
from airflow_stateful.core.records.lineage import CopyOf
from airflow_stateful.core.records.manifests import Manifest

LEGACY_MARK = "rolled_back_from"
"""The ``extra`` key earlier builds marked a rollback's copy with (the original's seq, untyped, in the user's
metadata): never carried into a new copy, whose lineage is ``copy_of``."""


def commit_copy(cs: CheckpointStore, lease: Lease, target: Manifest) -> Manifest:
    """Commit ``target`` (a kept checkpoint of ``cs``'s identity) again as the newest checkpoint, under ``lease``.

    The copy's ``extra`` is the original's, less an earlier build's rollback mark (it would name the original's
    own origin, not this copy's). A pinned original loses its pin in the same write: the newest checkpoint is
    what resumes now, so the pin has done its job.
    """
    extra = {k: v for k, v in target.extra.items() if k != LEGACY_MARK}
    return cs.commit(
        lease,
        target.value,
        encoded=True,  # copied as stored: a pickled value stays the same pickle, never unpickled here
        schema_version=target.schema_version,
        value_codec=target.value_codec,
        keep_files_from=target,
        extra=extra,
        code=target.code,
        unpin=[target.commit_id],
        copy_of=CopyOf(seq=target.seq, commit_id=target.commit_id),
    )
