"""High-water marks: how far an identity's head has come, kept where a bucket writer cannot reach.

A signed head proves this deployment wrote it, not that it is the newest: someone who can write the bucket
but lacks the key can keep a head from before a retry took over and write it back later (bucket versioning
hands out every old head). Readers would resume from the older state, and the fenced zombie's lease would be
valid again. So each writer also records, outside the bucket, the newest ``(epoch, seq, commit)`` it wrote for
the identity (:class:`HighWaterMark`), and every reader and writer that can reach that record refuses a head
below it (:class:`RolledBackError`, naming identity, mark and head).

Where the marks live is the caller's (:class:`MarkStore`): the Airflow layer keeps them in Airflow's metadata
database (``airflow_stateful/marks.py``). A mark only rises. A head *above* its mark is accepted: a writer that
cannot reach the marks (a Kubernetes pod) moves the head on, and the worker holding its lease moves the mark
after it. This module never imports Airflow.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records.fields import Fields
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.identity import Identity

_COMMIT = re.compile(r"[0-9a-f]{32}")


class RolledBackError(CheckpointCorruptError):
    """An identity's head is older than the newest one this deployment recorded writing: written back."""


@dataclass(frozen=True)
class HighWaterMark:
    """The newest head position a writer recorded: its epoch, its newest checkpoint's seq and commit id."""

    epoch: int
    seq: int
    commit_id: str = ""

    @classmethod
    def of(cls, head: HeadRecord) -> HighWaterMark:
        latest = head.latest
        return cls(
            epoch=head.epoch, seq=latest.seq if latest else 0, commit_id=latest.commit_id if latest else ""
        )

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.seq

    def describe(self) -> str:
        commit = f", commit {self.commit_id}" if self.commit_id else ""
        return f"epoch {self.epoch}, seq {self.seq}{commit}"

    def to_json(self, identity: Identity) -> dict[str, Any]:
        return {"identity": identity.key, "epoch": self.epoch, "seq": self.seq, "commit_id": self.commit_id}

    @classmethod
    def from_json(cls, data: Any, *, identity: Identity, what: str) -> HighWaterMark:
        """A stored mark, typed and bounded; one recorded for another identity is refused (copied over)."""
        f = Fields(data, what=what)
        if f.text("identity", max_len=4096) != identity.key:
            raise CheckpointCorruptError(f"{what} is the mark of another identity, not of {identity.key!r}")
        commit_id = f.text("commit_id", max_len=32, default="")
        if commit_id and not _COMMIT.fullmatch(commit_id):
            raise CheckpointCorruptError(f"{what}: 'commit_id' must be 32 hex digits or empty")
        return cls(epoch=f.integer("epoch"), seq=f.integer("seq"), commit_id=commit_id)


class MarkStore(abc.ABC):
    """Where high-water marks are kept: somewhere a writer of the bucket cannot write."""

    #: Names the place in errors and logs (``"Airflow's metadata database"``).
    where: str = "the mark store"

    @abc.abstractmethod
    def get(self, identity: Identity) -> HighWaterMark | None:
        """The identity's mark, or ``None`` if none was recorded (a new identity, or marks just turned on)."""

    @abc.abstractmethod
    def put(self, identity: Identity, mark: HighWaterMark) -> None:
        """Record ``mark`` (the caller made sure it is higher than the one it read)."""


def check_mark(head: HeadRecord, mark: HighWaterMark | None, *, identity: Identity, where: str) -> None:
    """Raise :class:`RolledBackError` if ``head`` is below ``mark``: an older epoch, an older checkpoint of the
    same epoch, or another checkpoint at the very position the mark names."""
    if mark is None:
        return
    seen = HighWaterMark.of(head)
    if seen.position > mark.position:
        return
    if seen.position == mark.position and (not mark.commit_id or seen.commit_id == mark.commit_id):
        return
    raise RolledBackError(
        f"the head of identity {identity.key!r} is at {seen.describe()}, below the newest this deployment "
        f"wrote ({mark.describe()}, recorded in {where}): an older head was written back to the store (a "
        "rollback by someone who can write the bucket, or a restored object version). It was not used. Restore "
        "the newest head version from the bucket's versioning. (A deliberate `airflow-stateful rollback` commits "
        "a new checkpoint, and is never refused.)"
    )
