"""Pinned checkpoints: how a deploy rollback and the rollforward after it keep the newer code's progress.

The story, with a task whose ``schema_version`` went from 1 to 2:

1. schema-2 code runs and commits checkpoints at schema 2;
2. the deploy is rolled back. The retry runs schema-1 code, which cannot read schema 2. With
   ``on_incompatible="restart"`` it starts fresh and **pins** the schema-2 checkpoint
   (:meth:`~airflow_stateful.core.protocol.checkpoint_store.CheckpointStore.pin`): retention (``keep_last``) never evicts
   a pinned checkpoint, however many schema-1 checkpoints follow it;
3. schema-2 code is deployed again. Its next try finds the newest checkpoint at schema 1 (older code wrote it
   after setting the pin) and a pinned schema-2 checkpoint before it: it resumes from the pinned one
   (:func:`pin_to_resume`), commits a copy of it as the newest checkpoint and releases the pin. The schema-1
   checkpoints stay in history (``airflow-stateful rollback`` picks any kept one by hand).

Without the pin, step 3 would either migrate the older code's fresh start (losing the schema-2 progress) or find
nothing, since ``keep_last`` evicted it. A pin is written only in format 4, so a release that does not know
pins refuses the head instead of rewriting it without the pin.
"""

from __future__ import annotations

from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord


def pin_to_resume(head: HeadRecord, *, schema_version: int) -> CheckpointEntry | None:
    """The pinned checkpoint code of ``schema_version`` resumes from instead of the newest, or ``None``.

    That is the newest pinned checkpoint written at exactly ``schema_version`` when the newest checkpoint is
    older than it in schema: code that could not read the pinned one wrote since. When the newest checkpoint
    has this code's schema (or a newer one) the usual rules apply.
    """
    latest = head.latest
    if latest is None or latest.schema_version >= schema_version:
        return None
    candidates = [e for e in head.pinned if e.schema_version == schema_version and e.seq < latest.seq]
    return candidates[-1] if candidates else None
