"""How a writer uses the worker's (or the node's) restore cache: fill it after a save, say what a restore got.

The cache (:mod:`airflow_stateful.core.data.chunk_cache`) can only save downloads, never change what a restore
returns: every chunk is verified against the checkpoint's SHA-256 either way. So both steps here are best effort
and only log: a save whose cache fill fails is still committed, and the line after a restore tells a user
whether the retry found its chunks locally (warm), some of them, or none (cold: the retry ran elsewhere).
"""

from __future__ import annotations

import logging
import os

from airflow_stateful.core.data.chunk_cache import CacheStats, LocalChunkCache
from airflow_stateful.core.data.transfer_progress import human_bytes
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.trees import Tree
from airflow_stateful.core.records.writer import WriterInfo

log = logging.getLogger("airflow_stateful")


def remember_saved(
    cache: LocalChunkCache, manifest: Manifest, tree: Tree | None, source: str | os.PathLike[str]
) -> None:
    """Keep the chunks ``manifest`` just committed from ``source`` (its ``files=``) in ``cache``, including those the
    upload did not send (the previous checkpoint held them), so the next try here restores them locally.
    Never raises: the checkpoint is committed whatever happens here."""
    if not manifest.has_files or tree is None:
        return
    try:
        cache.remember_files(tree, source)
    except Exception as exc:
        log.warning("restore cache not filled after checkpoint %d: %s", manifest.seq, exc)


def describe_use(
    cache: LocalChunkCache,
    before: CacheStats,
    manifest: Manifest,
    here: WriterInfo,
    *,
    runner: str = "this worker",
) -> str:
    """One line telling whether the restore of ``manifest`` was warm, given the cache's stats ``before`` it.

    ``runner`` names where the restore runs (``"this pod"`` for the pod client) in the part that compares nodes,
    which is said when a node is known (and always in a pod: the node is what a user pins to)."""
    after = cache.stats
    if not cache.usable:
        return f"restored checkpoint {manifest.seq} without the restore cache {cache.directory} (not usable)"
    hits, misses = after.hits - before.hits, after.misses - before.misses
    state = "warm" if hits and not misses else "partly warm" if hits else "cold"
    written = manifest.writer.node
    if runner == "this pod" or written or here.node:
        state += f"; written on node {written or 'unknown'}, {runner} runs on node {here.node or 'unknown'}"
    return (
        f"restored checkpoint {manifest.seq}: {human_bytes(after.hit_bytes - before.hit_bytes)} of "
        f"{human_bytes(manifest.total_size)} from the restore cache {cache.directory} ({hits} chunk(s)), "
        f"{misses} chunk(s) downloaded ({state})"
    )
