"""Format versions, limits and object names: what every record of the commit protocol agrees on.

Records carry ``format`` (this library's on-disk format version, docs/formats.md). A reader refuses a newer
format with a clear error instead of guessing, so an old worker never misreads state written by new code. It
refuses format 1 too (whole-file data objects, written only by pre-release development builds): this version no
longer reads it, and reading such a record as if it had no files would lose them silently.
"""

from __future__ import annotations

import re
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError, FormatVersionError

FORMAT_VERSION = 5
"""The newest format this library reads and writes (docs/formats.md). 2: content-addressed trees and chunks,
inline manifests. 3: published outputs (an outputs tree every kept checkpoint references). 4: pinned checkpoints
(a head that lists a checkpoint retention must never evict). 5: packs (small chunks stored inside pack objects,
``~packs/``, that an older release's GC would take for garbage). A record is written in the lowest format that can
hold it, so a writer that never publishes or pins stays readable by the releases that read 2; a release that
reads less refuses a newer record instead of collecting objects it cannot see are referenced, or dropping a pin
when it rewrites the head."""
PLAIN_FORMAT = 2
"""The format of a head or manifest without outputs or pins, and the oldest format this library reads."""
DROPPED_FORMAT = 1
"""Whole-file data objects under ``<identity>/~data/<commit_id>/`` listed in the manifest: written only by
pre-release development builds, refused by this one (:func:`format_1_refused`)."""
OUTPUTS_FORMAT = 3
"""The format of a head or manifest that carries outputs (and of a head with outputs but no pins)."""
PINS_FORMAT = 4
"""The format of a head that lists a pinned checkpoint."""
PACKS_FORMAT = 5
"""The format of a manifest whose tree (or outputs tree) names packed chunks, and of a head that keeps one."""
MAX_PINS = 10
"""Most pinned checkpoints one head keeps; pinning another releases the oldest pin (with a warning)."""

MAX_HEAD_BYTES = 2 * 1024 * 1024
"""A head record larger than this is refused unread (a thousand kept checkpoints take about 1.2 MiB)."""
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
"""Largest manifest a head may point at; a reader also never reads more than the size the head recorded."""
MAX_KEPT = 1000
"""Most checkpoints one head may list (``keep_last`` is capped at this)."""
MAX_CHUNK_BYTES = 4 * 1024 * 1024
"""The largest chunk a writer cuts (:data:`airflow_stateful.core.data.chunking.MAX_CHUNK` is this) and a reader
accepts: a download holds a whole chunk in memory, so a tree claiming a larger one is refused when it is read.
Raising it is a format change (readers of this release would refuse the larger chunks)."""
MAX_EXPECTED_INTERVAL = 366 * 86400.0
"""Longest ``expected_checkpoint_interval`` a lease may declare (a year, in seconds)."""

CODEC_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,15}$")

HEAD_NAME = "~head.json"
MANIFEST_DIR = "~manifests"
# `~` cannot occur in an identity segment, so these names can never collide with a nested identity.


def format_1_refused(
    what: str, *, identity: str, how: str = "is in format 1 (files as whole-file objects under '~data/')"
) -> FormatVersionError:
    """The error for a record (or the part of one, ``how``) written in format 1: loud, because this version
    cannot see which ``~data/`` objects it references, so reading it as a checkpoint without files would drop
    them; and saying what to do, because no later release will read it either."""
    return FormatVersionError(
        f"{what} {how}: it was written by a pre-release development build of airflow-provider-stateful, and "
        f"this version no longer reads format {DROPPED_FORMAT} (it reads formats {PLAIN_FORMAT} to "
        f"{FORMAT_VERSION}). Nothing was read from it or written to it, and this version's `airflow-stateful gc` "
        f"keeps it whole. To keep its state, restore it with that build (`airflow-stateful cat {identity} --files "
        f"DEST`); then, or if it is not needed, delete the identity: with that build's `airflow-stateful gc`, or "
        f"by hand (every object under '{identity}/')."
    )


def check_format(record: dict[str, Any], *, what: str, identity: str) -> None:
    """Refuse a record this version cannot read: no valid format (corrupt), format 1 (dropped) or a newer one."""
    fmt = record.get("format")
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise CheckpointCorruptError(
            f"{what} has no valid 'format' field; it was not written by this library."
        )
    if fmt < PLAIN_FORMAT:
        raise format_1_refused(what, identity=identity)
    if fmt > FORMAT_VERSION:
        raise FormatVersionError(
            f"{what} uses format {fmt}, newer than the {FORMAT_VERSION} this version of "
            "airflow-provider-stateful reads. Upgrade airflow-provider-stateful on this worker."
        )


def manifest_key(identity: str, seq: int, commit_id: str, *, rewrite: str | None = None) -> str:
    """Where checkpoint ``seq`` (commit ``commit_id``) of ``identity`` keeps its manifest.

    ``rewrite``: the id of the GC repack that rewrote it (its tree now names the repacked chunks). A manifest
    object is never overwritten in place: a reader holding the older head still finds the older manifest.
    """
    return f"{identity}/{MANIFEST_DIR}/{seq:012d}-{commit_id}" + (f"-{rewrite}" if rewrite else "") + ".json"


def is_manifest_key(key: str, identity: str, seq: int, commit_id: str) -> bool:
    """Whether ``key`` is where checkpoint ``seq`` of ``identity`` may keep its manifest (first written, or
    rewritten by a repack)."""
    return key == manifest_key(identity, seq, commit_id) or bool(
        re.fullmatch(
            re.escape(manifest_key(identity, seq, commit_id)[: -len(".json")]) + r"-[0-9a-f]{32}\.json", key
        )
    )
