"""Durable identity of one stateful job, and the rules that keep it inside its prefix.

An identity is a ``/``-separated key such as ``etl/enrich/run=manual__2026-11-30T08%3A00%3A00%2B00%3A00/map=-1``.
Every object of the job lives under ``<backend prefix>/<identity>/``, so the identity must never be able
to escape that prefix or land inside another identity's private folders. See docs/adr/0002-identity-scheme.md.
Names starting with ``~`` are reserved for the library: ``~head.json``, ``~manifests/``, ``~trees/`` and
``~chunks/`` inside an identity (and ``~data/``, format 1's, no longer read), and ``~task-state/`` /
``~asset-state/`` (the task state store backend) at the backend's root; no identity segment may contain ``~``,
so none can collide with them (tools listing identities skip them).

Tasks get their identity from ``(dag_id, task_id, scope, map_index)``: the scope is the run_id for state that
belongs to one DAG run, or a user-chosen name for state that lives across runs. Never ``ti.id`` or the try
number: both change between tries, and resuming across tries is the whole point.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from urllib.parse import unquote

from airflow_stateful.core.errors import IdentityError

#: Characters that stand for themselves in a key segment; everything else is percent-encoded.
SAFE_CHARS = frozenset(string.ascii_letters + string.digits + "._-")
#: Characters a validated segment may contain (encoded segments add ``%``; scope markers add ``=``).
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._%=+-]+$")
#: A user-chosen scope name: readable, no encoding needed.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

MAX_KEY_BYTES = 700
"""Longest identity key. S3 keys end at 1024 bytes; the rest is left for the prefix and our object names."""
MAX_SEGMENT_BYTES = 255
"""Longest segment: NAME_MAX of common filesystems, so the local store can hold every identity S3 can."""
MAX_NAME_CHARS = 200

RUN_SCOPE = "run"
NAMED_SCOPE = "name"


def _reject_control(what: str, value: str) -> None:
    for ch in value:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            raise IdentityError(f"{what} {value!r} contains the control character {ch!r}; remove it.")


def encode_segment(value: str) -> str:
    """Percent-encode ``value`` so it is one safe key segment (UTF-8, upper-case hex)."""
    out = []
    for ch in value:
        if ch in SAFE_CHARS:
            out.append(ch)
        else:
            out.extend(f"%{byte:02X}" for byte in ch.encode("utf-8"))
    return "".join(out)


def _check_segment(segment: str, *, key: str) -> None:
    if segment == "":
        raise IdentityError(f"identity {key!r} has an empty segment (a leading, trailing or doubled '/').")
    if segment in (".", ".."):
        raise IdentityError(f"identity {key!r} has the segment {segment!r}, which could escape its prefix.")
    if not _SEGMENT_RE.fullmatch(segment):
        bad = sorted({ch for ch in segment if not _SEGMENT_RE.fullmatch(ch)})
        raise IdentityError(
            f"identity {key!r} has the segment {segment!r} with characters {bad!r}; "
            "segments may hold only letters, digits and . _ - % = +."
        )
    if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
        raise IdentityError(
            f"identity segment {segment[:40]!r}... is {len(segment)} bytes; the limit is {MAX_SEGMENT_BYTES}."
        )


@dataclass(frozen=True, order=True)
class Identity:
    """A validated identity key. Build one with :meth:`for_task` or :meth:`parse`."""

    key: str

    def __post_init__(self) -> None:
        key = self.key
        if not isinstance(key, str):
            raise IdentityError(f"identity must be a string, not {type(key).__name__} ({key!r}).")
        if key == "":
            raise IdentityError("identity is empty.")
        _reject_control("identity", key)
        if key.startswith("/") or "\\" in key:
            raise IdentityError(f"identity {key!r} is an absolute or Windows-style path; use a relative key.")
        if len(key.encode("utf-8")) > MAX_KEY_BYTES:
            raise IdentityError(f"identity {key[:60]!r}... is longer than {MAX_KEY_BYTES} bytes.")
        for segment in key.split("/"):
            _check_segment(segment, key=key)

    @classmethod
    def parse(cls, key: str) -> Identity:
        """Validate an identity key given as text (CLI argument, ``STATEFUL_IDENTITY`` in a pod)."""
        return cls(key)

    @classmethod
    def for_task(
        cls,
        *,
        dag_id: str,
        task_id: str,
        map_index: int = -1,
        run_id: str | None = None,
        name: str | None = None,
    ) -> Identity:
        """The identity of one task's state: per DAG run (``run_id``) or across runs (``name``).

        Exactly one of ``run_id`` and ``name`` must be given. ``name`` is a user-chosen label such as
        ``"nightly-watermark"`` and is kept readable; the other parts are percent-encoded where needed.
        """
        if (run_id is None) == (name is None):
            raise IdentityError(
                f"give exactly one of run_id ({run_id!r}) and name ({name!r}) as the identity's scope."
            )
        for what, value in (("dag_id", dag_id), ("task_id", task_id)):
            if not isinstance(value, str) or value == "":
                raise IdentityError(f"{what} must be a non-empty string, not {value!r}.")
            _reject_control(what, value)
        if isinstance(map_index, bool) or not isinstance(map_index, int) or map_index < -1:
            raise IdentityError(f"map_index must be an integer >= -1, not {map_index!r}.")
        if name is not None:
            if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > MAX_NAME_CHARS:
                raise IdentityError(
                    f"identity name {name!r} is not valid: use 1-{MAX_NAME_CHARS} letters, digits, "
                    "'.', '_' or '-', starting with a letter or digit (e.g. 'nightly-watermark')."
                )
            scope = f"{NAMED_SCOPE}={name}"
        else:
            if not isinstance(run_id, str) or run_id == "":
                raise IdentityError(f"run_id must be a non-empty string, not {run_id!r}.")
            _reject_control("run_id", run_id)
            scope = f"{RUN_SCOPE}={encode_segment(run_id)}"
        return cls("/".join((encode_segment(dag_id), encode_segment(task_id), scope, f"map={map_index}")))

    @property
    def task_parts(self) -> dict[str, str | int] | None:
        """Decode an identity made by :meth:`for_task`; ``None`` for any other shape."""
        parts = self.key.split("/")
        if len(parts) != 4 or not parts[3].startswith("map="):
            return None
        kind, _, scope = parts[2].partition("=")
        if kind not in (RUN_SCOPE, NAMED_SCOPE):
            return None
        try:
            map_index = int(parts[3][4:])
        except ValueError:
            return None
        decoded: dict[str, str | int] = {
            "dag_id": unquote(parts[0]),
            "task_id": unquote(parts[1]),
            "scope_kind": kind,
            "scope": unquote(scope),
            "map_index": map_index,
        }
        # Only the canonical key of a task decodes: "map=05" or "%3a" would otherwise alias another key.
        scope_arg = {"run_id": unquote(scope)} if kind == RUN_SCOPE else {"name": unquote(scope)}
        try:
            canonical = Identity.for_task(
                dag_id=str(decoded["dag_id"]),
                task_id=str(decoded["task_id"]),
                map_index=map_index,
                **scope_arg,
            )
        except IdentityError:
            return None
        return decoded if canonical.key == self.key else None

    def __str__(self) -> str:
        return self.key
