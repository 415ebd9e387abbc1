"""Which committed checkpoints an identity keeps. A small protocol so policies can grow (age, every Nth, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from airflow_stateful.core.records import CheckpointEntry


class RetentionPolicy(Protocol):
    def split(
        self, entries: Sequence[CheckpointEntry]
    ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
        """Return ``(keep, drop)`` for entries ordered oldest first; the newest is always kept."""
        ...


@dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` checkpoints (``n >= 1``)."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"keep_last must be an integer >= 1, not {self.n!r}")

    def split(
        self, entries: Sequence[CheckpointEntry]
    ) -> tuple[list[CheckpointEntry], list[CheckpointEntry]]:
        cut = max(len(entries) - self.n, 0)
        return list(entries[cut:]), list(entries[:cut])
