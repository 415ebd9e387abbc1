"""Lineage: which earlier checkpoint a checkpoint is a copy of (``copy_of`` in its manifest).

``airflow-stateful rollback --to 2`` commits a copy of checkpoint 2 as the newest. Without a record of that, the
copy reads like any other commit (``history`` cannot say where its state came from) and once retention drops
checkpoint 2 nobody can tell. The manifest is immutable and outlives the original, so the copy names its
original there, by ``seq`` *and* ``commit_id``: a seq alone is ambiguous after the original is gone, the commit id
is what the original's manifest, logs and events were known by.

Adding it is no format change (docs/formats.md): a reader that ignores it misreads nothing, the copy's value
and files are whole without it. Read back, it is untrusted like every stored field: typed, bounded, and it must
name an *earlier* checkpoint of the same identity (a copy of itself or of a later one is not something this
library wrote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.fields import Fields

COPY_OF_FIELD = "copy_of"
"""The manifest field that holds a :class:`CopyOf`."""


@dataclass(frozen=True, kw_only=True)
class CopyOf:
    """The checkpoint a copy was made from: its number and its commit id."""

    seq: int
    commit_id: str

    def describe(self) -> str:
        """``copy of seq 2``: how ``history``, ``show`` and the UI say it."""
        return f"copy of seq {self.seq}"

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "commit_id": self.commit_id}

    @classmethod
    def from_json(cls, data: Any, *, copy_seq: int, what: str) -> CopyOf:
        """Typed (``seq`` a positive integer, ``commit_id`` 32 hex digits) and naming a checkpoint older than the
        copy, ``copy_seq``; anything else raises CheckpointCorruptError naming ``what``."""
        f = Fields(data, what=what)
        origin = cls(seq=f.integer("seq", minimum=1), commit_id=f.hex32("commit_id"))
        if origin.seq >= copy_seq:
            raise CheckpointCorruptError(
                f"{what}: names checkpoint {origin.seq} as the original of checkpoint {copy_seq}; "
                "a copy is always newer than what it copies"
            )
        return origin
