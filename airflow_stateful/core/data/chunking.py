"""Cutting a file into chunks whose boundaries depend on the content, so a change moves only nearby boundaries.

A small file is one chunk. A large one is cut by FastCDC (content-defined chunking, the ``pyfastcdc``
package): a boundary is placed where a rolling hash of the last bytes matches a pattern, so inserting or
changing bytes in one place changes the chunks around it and leaves every other chunk — and its name, the
SHA-256 of its bytes — as it was. A re-save then uploads only those few chunks.

The parameters are part of the dedup contract: a writer with other sizes still writes correct checkpoints,
it just shares fewer chunks with earlier ones. Without ``pyfastcdc`` (an image with only boto3), files are cut
into fixed-size pieces: correct, but an insertion then shifts every later chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from airflow_stateful.core.records.formats import MAX_CHUNK_BYTES

MIB = 1024 * 1024
MAX_CHUNK = MAX_CHUNK_BYTES
"""The largest chunk cut: what every reader accepts (a larger one would be refused as corrupt)."""
AVG_CHUNK = MAX_CHUNK // 2
MIN_CHUNK = AVG_CHUNK // 4
WINDOW = 2 * MAX_CHUNK
"""Bytes of a file the chunker holds while it looks for the next cut point."""
SMALL_FILE = MAX_CHUNK
"""Files up to this size are one chunk (read whole)."""


def _fastcdc() -> object | None:
    try:
        from pyfastcdc import FastCDC
    except ImportError:  # pragma: no cover - pyfastcdc is a dependency; pods may run without it
        return None
    return FastCDC(avg_size=AVG_CHUNK, min_size=MIN_CHUNK, max_size=MAX_CHUNK)


def iter_chunks(path: Path, size: int) -> Iterator[bytes]:
    """The chunks of the file at ``path`` (``size`` bytes when listed), in order; memory stays bounded.

    pyfastcdc's ``cut_stream`` reads the file through a window of about twice the largest chunk and gives
    the same cut points as cutting the whole file at once (checked in the tests).
    """
    with open(path, "rb") as fh:
        if size <= SMALL_FILE:
            data = fh.read()
            if data or size:
                yield data
            return
        cdc = _fastcdc()
        if cdc is None:
            while block := fh.read(AVG_CHUNK):
                yield block
            return
        for chunk in cdc.cut_stream(fh):  # type: ignore[attr-defined]
            yield bytes(chunk.data)  # the chunker reuses its buffer: copy before the next chunk
