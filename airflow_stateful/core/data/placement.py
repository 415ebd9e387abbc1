"""Where the last writer ran, and whether this worker's restore cache already holds its checkpoint.

A retry that lands on the machine its failed try ran on can restore the checkpoint's files from the worker's
restore cache (:mod:`airflow_stateful.core.data.chunk_cache`) instead of downloading them; one that lands elsewhere
downloads everything. Schedulers place retries without knowing that, so the least this library can do is
record where each checkpoint was written (``manifest.writer``: host, pod, Kubernetes node) and say, at the start
of every try, whether the cache is warm: a user who sees "cold" on every retry knows to pin the task to a pool
or queue. The Kubernetes operator goes further and *prefers* (never requires) the last writer's node.

This module only measures; it never fails a try (a cache it cannot read counts as cold).
"""

from __future__ import annotations

from dataclasses import dataclass

from airflow_stateful.core.data.chunk_cache import LocalChunkCache
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.trees import Tree
from airflow_stateful.core.records.writer import WriterInfo


@dataclass(frozen=True)
class Warmth:
    """How much of a checkpoint's file data this worker's cache holds, and who wrote the checkpoint where."""

    seq: int
    written_on: str
    here: str
    same_machine: bool
    cached_bytes: int
    total_bytes: int
    cached_chunks: int
    total_chunks: int

    @property
    def warm(self) -> bool:
        return self.total_bytes > 0 and self.cached_bytes == self.total_bytes

    def describe(self) -> str:
        state = "warm" if self.warm else "partly warm" if self.cached_bytes else "cold"
        where = "this machine" if self.same_machine else f"{self.written_on} (this is {self.here})"
        return (
            f"restore cache {state}: checkpoint {self.seq} was written on {where}; the cache holds "
            f"{human_bytes(self.cached_bytes)} of its {human_bytes(self.total_bytes)} "
            f"({self.cached_chunks}/{self.total_chunks} chunks)"
        )


def _machine(writer: WriterInfo) -> str:
    if writer.node:
        return f"node {writer.node}" + (f" (pod {writer.pod})" if writer.pod else "")
    return f"host {writer.host}" if writer.host else "an unknown machine"


def warmth(manifest: Manifest, tree: Tree, cache: LocalChunkCache, *, here: WriterInfo) -> Warmth:
    """Measure ``cache`` against ``tree`` (``manifest``'s files). A stat per distinct chunk, no reads."""
    chunks = {c.sha256: c for f in tree.files for c in f.chunks}
    held = [c for c in chunks.values() if cache.holds(c)]
    written = manifest.writer
    same = (written.node is not None and written.node == here.node) or (
        written.node is None and written.host is not None and written.host == here.host
    )
    return Warmth(
        seq=manifest.seq,
        written_on=_machine(written),
        here=_machine(here),
        same_machine=same,
        cached_bytes=sum(c.size for c in held),
        total_bytes=sum(c.size for c in chunks.values()),
        cached_chunks=len(held),
        total_chunks=len(chunks),
    )
