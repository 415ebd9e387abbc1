"""What a sensor waits for in an identity's state, judged on the head record without Airflow.

:class:`CheckpointCondition` is shared by the sensors (poke and reschedule mode, on a worker) and by the
trigger (deferrable mode, in the triggerer), so both decide the same way. It is a plain frozen dataclass
that round-trips through :meth:`~CheckpointCondition.to_dict` / :meth:`~CheckpointCondition.from_dict`,
because a trigger's arguments are stored as JSON in Airflow's metadata database.

Two kinds:

* ``"checkpoint"`` (the default): the identity has a committed checkpoint, optionally with a sequence
  number of at least ``min_seq``, written after ``newer_than`` and whose value's ``field`` compares to
  ``value`` with ``op``. Only a value test reads the checkpoint's manifest; the rest is in the head record.
* ``"lease_released"``: no live lease holds the identity (no writer is running, or its lease expired). An
  identity that was never used holds no lease either.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.codecs import JSON
from airflow_stateful.core.records.heads import HeadRecord
from airflow_stateful.core.records.manifests import Manifest

CHECKPOINT = "checkpoint"
LEASE_RELEASED = "lease_released"
KINDS = (CHECKPOINT, LEASE_RELEASED)

OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}

_MISSING = object()


def parse_aware(value: str, *, what: str) -> datetime:
    """An ISO 8601 timestamp with a timezone (``Z`` accepted); InvalidValueError otherwise."""
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidValueError(
            f"{what} {value!r} is not an ISO 8601 timestamp (e.g. '2026-01-31T08:00:00+00:00')."
        ) from None
    if parsed.tzinfo is None:
        raise InvalidValueError(
            f"{what} {value!r} has no timezone, so it is ambiguous; add one (e.g. '+00:00')."
        )
    return parsed


def lookup(value: Any, path: str) -> Any:
    """The part of a JSON value a dotted ``path`` names (``"stats.rows"``, ``"files.0"``), or ``_MISSING``."""
    current = value
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif (
            isinstance(current, list)
            and part.lstrip("-").isdigit()
            and -len(current) <= int(part) < len(current)
        ):
            current = current[int(part)]
        else:
            return _MISSING
    return current


@dataclass(frozen=True)
class Verdict:
    """The answer of one check: met or not, why (for the log), and what the sensor returns when met."""

    met: bool
    reason: str
    seq: int | None = None
    created_at: str | None = None
    epoch: int | None = None

    def __bool__(self) -> bool:
        return self.met

    def result(self, identity: str) -> dict[str, Any]:
        """What a sensor returns (its XCom) once the condition is met: JSON, small, no checkpoint value."""
        return {"identity": identity, "seq": self.seq, "created_at": self.created_at, "epoch": self.epoch}


@dataclass(frozen=True)
class CheckpointCondition:
    """A test of an identity's state that a sensor or trigger repeats until it holds.

    :param kind: ``"checkpoint"`` (default) or ``"lease_released"``; the latter takes no other parameter.
    :param min_seq: the latest checkpoint's sequence number must be at least this.
    :param newer_than: ISO 8601 timestamp with a timezone; the latest checkpoint must be written after it.
    :param field: dotted path into the checkpoint's (JSON) value, e.g. ``"stats.rows"``; ``""`` is the
        whole value. Requires ``op`` and ``value``.
    :param op: one of ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``.
    :param value: what the field is compared to (JSON: it is stored with a deferred trigger).
    """

    kind: str = CHECKPOINT
    min_seq: int | None = None
    newer_than: str | None = None
    field: str | None = None
    op: str = "=="
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidValueError(f"condition kind must be one of {', '.join(KINDS)}, not {self.kind!r}.")
        if self.kind == LEASE_RELEASED:
            if self.min_seq is not None or self.newer_than is not None or self.field is not None:
                raise InvalidValueError(
                    "a lease_released condition takes no min_seq, newer_than or field; "
                    "wait for the checkpoint with a second sensor."
                )
            return
        if self.min_seq is not None and (
            isinstance(self.min_seq, bool) or not isinstance(self.min_seq, int) or self.min_seq < 1
        ):
            raise InvalidValueError(f"min_seq must be an integer >= 1, not {self.min_seq!r}.")
        if self.newer_than is not None:
            if not isinstance(self.newer_than, str):
                raise InvalidValueError(
                    f"newer_than must be an ISO 8601 string, not {type(self.newer_than).__name__}."
                )
            parse_aware(self.newer_than, what="newer_than")
        if self.op not in OPERATORS:
            raise InvalidValueError(f"op must be one of {', '.join(OPERATORS)}, not {self.op!r}.")
        if self.field is not None:
            if not isinstance(self.field, str) or (
                self.field and any(part == "" for part in self.field.split("."))
            ):
                raise InvalidValueError(
                    f"field must be a dotted path such as 'stats.rows' (or '' for the whole value), "
                    f"not {self.field!r}."
                )
            try:
                json.dumps(self.value, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise InvalidValueError(
                    f"the value a field is compared to must be JSON ({exc}); checkpoint values are JSON."
                ) from exc

    @property
    def needs_value(self) -> bool:
        """Whether checking needs the checkpoint's value (one more read than the head record)."""
        return self.field is not None

    def describe(self) -> str:
        """The condition in words, for logs: ``a checkpoint (seq >= 3, value['done'] == True)``."""
        if self.kind == LEASE_RELEASED:
            return "no live lease"
        parts = []
        if self.min_seq is not None:
            parts.append(f"seq >= {self.min_seq}")
        if self.newer_than is not None:
            parts.append(f"written after {self.newer_than}")
        if self.field is not None:
            parts.append(f"value{_path_repr(self.field)} {self.op} {self.value!r}")
        return "a checkpoint" + (f" ({', '.join(parts)})" if parts else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointCondition:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidValueError(
                f"unknown condition parameter(s) {unknown}; upgrade airflow-provider-stateful."
            )
        return cls(**dict(data))

    # -- checking ------------------------------------------------------------------------------------------
    def evaluate(
        self,
        head: HeadRecord | None,
        load_latest: Callable[[], Manifest | None],
        *,
        now: float,
        predicate: Callable[[Any], bool] | None = None,
    ) -> Verdict:
        """Judge the identity's current state.

        :param head: the identity's head record (``None``: never used).
        :param load_latest: reads the latest checkpoint's verified manifest; called only for a value test
            or ``predicate``.
        :param now: seconds since the epoch, to judge lease expiry.
        :param predicate: a callable on the decoded value that must also return true (poke mode only:
            a callable cannot be stored with a trigger).

        Errors of the store (a missing bucket, a corrupt record) propagate: they are not "not yet".
        """
        if self.kind == LEASE_RELEASED:
            return self._lease_released(head, now)
        latest = head.latest if head is not None else None
        if latest is None:
            return Verdict(False, "no checkpoint has been committed yet")
        seq, created_at = latest.seq, latest.created_at
        value: Any = _MISSING
        if self.needs_value or predicate is not None:
            # One consistent snapshot: judge seq and time on the manifest whose value is tested.
            manifest = load_latest()
            if manifest is None:
                return Verdict(False, "no checkpoint has been committed yet (the state was just deleted)")
            if manifest.value_codec != JSON:
                raise InvalidValueError(
                    f"checkpoint {manifest.seq} stores its value with the {manifest.value_codec!r} codec; a "
                    "sensor tests JSON values only (it never unpickles). Test min_seq or newer_than instead."
                )
            seq, created_at, value = manifest.seq, manifest.created_at, manifest.value
        epoch = head.epoch if head is not None else None
        if self.min_seq is not None and seq < self.min_seq:
            return Verdict(False, f"the latest checkpoint is {seq}, not yet {self.min_seq}", seq, created_at)
        if self.newer_than is not None:
            since = parse_aware(self.newer_than, what="newer_than")
            if parse_aware(created_at, what="created_at") <= since:
                return Verdict(
                    False,
                    f"the latest checkpoint ({seq}) was written at {created_at}, not after {self.newer_than}",
                    seq,
                    created_at,
                )
        if self.field is not None:
            verdict = self._compare(value, seq, created_at)
            if not verdict:
                return verdict
        if predicate is not None and not predicate(value):
            return Verdict(False, f"checkpoint {seq}: the predicate returned false", seq, created_at)
        return Verdict(True, f"checkpoint {seq} ({created_at}) meets the condition", seq, created_at, epoch)

    def _compare(self, value: Any, seq: int, created_at: str) -> Verdict:
        assert self.field is not None
        found = lookup(value, self.field) if self.field else value
        where = f"checkpoint {seq}: value{_path_repr(self.field)}"
        if found is _MISSING:
            return Verdict(False, f"{where} does not exist yet", seq, created_at)
        try:
            ok = bool(OPERATORS[self.op](found, self.value))
        except TypeError:
            # Values evolve (None before the first count, a number after): not an error, just not yet.
            return Verdict(
                False,
                f"{where} is {found!r} ({type(found).__name__}), which cannot be compared "
                f"with {self.op} {self.value!r} ({type(self.value).__name__})",
                seq,
                created_at,
            )
        if not ok:
            return Verdict(
                False, f"{where} is {found!r}, waiting for {self.op} {self.value!r}", seq, created_at
            )
        return Verdict(True, "", seq, created_at)

    @staticmethod
    def _lease_released(head: HeadRecord | None, now: float) -> Verdict:
        if head is None:
            return Verdict(True, "the identity has never been used, so no lease holds it")
        latest = head.latest
        seq, created_at = (latest.seq, latest.created_at) if latest else (None, None)
        lease = head.lease
        if lease is not None and not lease.expired(now):
            return Verdict(
                False,
                f"leased by {lease.holder.describe()} (epoch {lease.epoch}) until {lease.expires_at}",
                seq,
                created_at,
                head.epoch,
            )
        why = "its lease expired" if lease is not None else "no lease holds it"
        return Verdict(True, f"{why} (epoch {head.epoch})", seq, created_at, head.epoch)


def _path_repr(path: str) -> str:
    return "".join(f"[{part!r}]" for part in path.split(".")) if path else ""
