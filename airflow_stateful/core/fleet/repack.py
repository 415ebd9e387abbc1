"""Repacking: GC rewrites mostly-dead packs, so a pack's dead bytes are not billed for as long as one chunk lives.

A pack is kept whole while one kept checkpoint needs one chunk in it (docs/adr/0006-packs.md). After retention
drops old checkpoints, a pack may hold a few live chunks among many dead ones. A pack whose dead bytes reach
:data:`REPACK_DEAD_FRACTION` of its size is *repacked* (restic's ``prune``), by GC only, never by a task:

1. the live chunks of those packs are read by ranged GETs, each checked against its SHA-256, and appended to new
   packs named by the repack's own id (``~packs/<repack id>-<n>``: no writer and no other pass holds the name);
2. every kept tree naming such a chunk is written again naming the new copy, and every manifest naming such a
   tree is written again, inline in the head or as a new object (``~manifests/<seq>-<commit>-<repack id>``:
   never overwritten in place, so a reader of the older head still reads what that head names);
3. one compare-and-swap of the head swaps the kept checkpoints' entries, only while the head keeps exactly
   the checkpoints the repack read and no lease stands (a dead lease is broken first, fencing its holder,
   whose in-memory view of the old trees could otherwise make its next commit name a deleted pack);
4. then the old packs, trees and manifest objects, no longer referenced, are deleted.

Crash-safe at every step: before 3 the new objects are unreferenced (young garbage, deleted by a later pass
once older than GC's ``min_age``) and the head still names the old ones, all intact; after 3 the old ones are
unreferenced, and what 4 did not delete the next pass does. A writer that takes the lease before 3 makes the
swap fail (the repack is abandoned, its objects are garbage). A chunk that fails its SHA-256 check stops the
repack of the identity before anything is swapped: nothing corrupt is ever copied into a new pack.

Values, file contents, paths, modes and checkpoint numbers are unchanged; only where the bytes live changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, cast

from airflow_stateful.core.data.packs import PACK_TARGET, PackBuilder, SealedPack, coalesce
from airflow_stateful.core.errors import CheckpointCorruptError, ObjectNotFoundError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.commit_point import INLINE_MANIFEST_BYTES
from airflow_stateful.core.protocol.retention import References
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import manifest_key
from airflow_stateful.core.records.heads import CheckpointEntry, HeadRecord
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.trees import ChunkRef, Tree, TreeFile, TreeRef
from airflow_stateful.core.stores.base import ObjectInfo

log = logging.getLogger("airflow_stateful")

REPACK_DEAD_FRACTION = 0.5
"""A kept pack is repacked once at least this share of its bytes is needed by no kept checkpoint: copying the
live half costs at most as many bytes as it frees (restic's ``prune`` defaults to a far lower threshold; a pack
here is 8 MiB, and repacking rewrites trees and manifests too, so only packs mostly dead are worth it)."""


@dataclass(frozen=True)
class RepackPlan:
    """What a repack of one identity rewrites and then deletes.

    ``packs``: the packs rewritten (deleted once the head names the new copies); ``replaced``: the trees and
    manifest objects written again, deleted with them; ``live_bytes``: the bytes copied into new packs (each
    distinct chunk once); ``dead_bytes``: the bytes of ``packs`` that no longer need storing once it is done."""

    packs: tuple[str, ...]
    replaced: tuple[str, ...]
    live_bytes: int
    dead_bytes: int
    #: the bytes of ``packs``, the bytes of them kept checkpoints need, and how many packs those fill again.
    pack_bytes: int = 0
    old_live_bytes: int = 0
    new_packs: int = 0

    @property
    def keys(self) -> list[str]:
        return [*self.packs, *self.replaced]


def mostly_dead(
    identity_key: str, infos: Iterable[ObjectInfo], refs: References, *, dead_fraction: float
) -> list[ObjectInfo]:
    """The kept packs among ``infos`` whose bytes no kept checkpoint needs are at least ``dead_fraction`` of them."""
    prefix = f"{identity_key}/~packs/"
    found = []
    for info in infos:
        live = refs.pack_live_bytes.get(info.key)
        if live is None or not info.key.startswith(prefix) or info.size <= 0:
            continue
        if info.size - min(live, info.size) >= dead_fraction * info.size:
            found.append(info)
    return found


def _wanted(affected: dict[str, tuple[TreeRef, Tree]], packs: set[str]) -> list[ChunkRef]:
    """The chunks to copy, each distinct chunk (by content) once wherever it was, in the order they are read
    and packed again (by pack and offset: neighbours share a ranged GET)."""
    unique: dict[str, ChunkRef] = {}
    for _ref, tree in affected.values():
        for chunk in (c for f in tree.files for c in f.chunks if c.key in packs):
            unique.setdefault(chunk.sha256, chunk)
    return sorted(unique.values(), key=lambda c: (c.key, c.offset or 0))


def _affected(
    head: HeadRecord, packs: set[str], trees: Callable[[TreeRef], Tree]
) -> dict[str, tuple[TreeRef, Tree]]:
    """The kept trees (by key) that name a chunk in one of ``packs``."""
    found: dict[str, tuple[TreeRef, Tree]] = {}
    for entry in head.checkpoints:
        for ref in (entry.tree, entry.outputs_tree):
            if ref is None or not ref.packed or ref.key in found:
                continue
            tree = trees(ref)
            if any(c.key in packs for f in tree.files for c in f.chunks):
                found[ref.key] = (ref, tree)
    return found


def plan_repack(
    cs: CheckpointStore,
    head: HeadRecord,
    infos: Iterable[ObjectInfo],
    refs: References,
    *,
    dead_fraction: float = REPACK_DEAD_FRACTION,
) -> RepackPlan | None:
    """What repacking ``head``'s mostly-dead packs would rewrite and delete (``None``: no pack is due)."""
    listed = list(infos)
    due = mostly_dead(cs.identity.key, listed, refs, dead_fraction=dead_fraction)
    if not due:
        return None
    packs = {i.key for i in due}
    affected = _affected(head, packs, cs.content.tree_of)
    replaced = set(affected)
    for entry in head.checkpoints:
        if entry.manifest is not None and any(
            t is not None and t.key in affected for t in (entry.tree, entry.outputs_tree)
        ):
            replaced.add(entry.manifest)
    wanted = _wanted(affected, packs)
    fill = new_packs = 0
    for chunk in wanted:  # as PackBuilder seals them
        fill += chunk.size
        if fill >= PACK_TARGET:
            new_packs, fill = new_packs + 1, 0
    live = sum(c.size for c in wanted)
    size = sum(i.size for i in due)
    return RepackPlan(
        packs=tuple(sorted(packs)),
        replaced=tuple(sorted(replaced)),
        live_bytes=live,
        dead_bytes=size - live,
        pack_bytes=size,
        old_live_bytes=sum(min(refs.pack_live_bytes[i.key], i.size) for i in due),
        new_packs=new_packs + (1 if fill else 0),
    )


@dataclass
class Rewritten:
    """A repack's new objects, before the head names them: the entries to swap in, and what was written."""

    checkpoints: tuple[CheckpointEntry, ...]
    packs_written: int
    bytes_copied: int


def rewrite(cs: CheckpointStore, head: HeadRecord, packs: set[str]) -> Rewritten:
    """Copy the live chunks of ``packs`` into new packs and write the trees and manifests naming them.

    Writes only new objects under names of this repack's own; the head is not touched (the caller swaps it).
    Raises CheckpointCorruptError if a chunk read fails its check or a pack is missing: nothing is swapped.
    """
    repack_id = uuid.uuid4().hex
    store, identity = cs.store, cs.identity.key
    affected = _affected(head, packs, cs.content.tree_of)
    moved: dict[str, ChunkRef] = {}
    builder = PackBuilder(identity=identity, commit_id=repack_id)
    written = [0, 0]

    def upload(sealed: SealedPack | None) -> None:
        if sealed is None:
            return
        try:
            store.put(sealed.key, cast(bytes, sealed.data), if_none_match=True)
            written[0] += 1
            written[1] += len(sealed.data)
        finally:
            sealed.close()

    # One ranged GET at a time (at most MAX_RANGE bytes) and one pack filling: a repack's memory is bounded
    # like a save's, whatever the identity holds.
    for span in coalesce((chunk, None) for chunk in _wanted(affected, packs)):
        try:
            data = store.get_range(span.key, offset=span.offset, length=span.length)
        except ObjectNotFoundError as exc:
            raise CheckpointCorruptError(f"pack {span.key!r} is missing from {store.url}: {exc}") from exc
        for chunk, _ in span.members:
            at = (chunk.offset or 0) - span.offset
            piece = data[at : at + chunk.size]
            got = hashlib.sha256(piece).hexdigest()
            if len(piece) != chunk.size or got != chunk.sha256:
                raise CheckpointCorruptError(
                    f"chunk {chunk.sha256} at offset {chunk.offset} of pack {chunk.key!r} in {store.url} is "
                    f"corrupt (read {len(piece)} bytes with SHA-256 {got}); the pack is not repacked and the "
                    "checkpoints naming it stay as they are. Restores of that chunk fail the same way: roll "
                    "back to a checkpoint that does not need it (`airflow-stateful history`)."
                )
            ref, sealed = builder.add(chunk.sha256, piece)
            moved[chunk.sha256] = ref
            upload(sealed)
        del data
    upload(builder.flush())

    def moved_file(f: TreeFile) -> TreeFile:
        return replace(f, chunks=tuple(moved[c.sha256] if c.key in packs else c for c in f.chunks))

    new_refs: dict[str, TreeRef] = {}
    for key, (_ref, tree) in affected.items():
        again = Tree(identity=identity, files=tuple(moved_file(f) for f in tree.files))
        new_refs[key] = cs.content.write_tree(again, repack_id, same_as=None)

    def swapped(ref: TreeRef | None) -> TreeRef | None:
        return new_refs.get(ref.key, ref) if ref is not None else None

    entries = []
    for entry in head.checkpoints:
        files_ref, outputs_ref = swapped(entry.tree), swapped(entry.outputs_tree)
        if (files_ref, outputs_ref) == (entry.tree, entry.outputs_tree):
            entries.append(entry)
            continue
        manifest = replace(cs.content.read_manifest(entry), tree=files_ref, outputs_tree=outputs_ref)
        entries.append(_entry(cs, entry, manifest, repack_id=repack_id))
    return Rewritten(checkpoints=tuple(entries), packs_written=written[0], bytes_copied=written[1])


def _entry(
    cs: CheckpointStore, entry: CheckpointEntry, manifest: Manifest, *, repack_id: str
) -> CheckpointEntry:
    """``entry`` naming ``manifest`` (the same checkpoint, its trees repacked): inline where it was inline."""
    raw = canonical_json(manifest.to_json()) + b"\n"
    changes: dict[str, Any] = {"tree": manifest.tree, "outputs_tree": manifest.outputs_tree}
    if entry.inline is not None and len(raw) <= 2 * INLINE_MANIFEST_BYTES:
        # Inline before, inline again: a new tree ref is the same size as the old, give or take a suffix.
        changes["inline"] = json.loads(raw)
    else:
        key = manifest_key(cs.identity.key, entry.seq, entry.commit_id, rewrite=repack_id)
        cs.content.write_manifest(key, raw)
        changes.update(inline=None, manifest=key, manifest_sha256=sha256_hex(raw), manifest_size=len(raw))
    return replace(entry, **changes)
