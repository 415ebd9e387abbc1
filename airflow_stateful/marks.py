"""High-water marks in Airflow's metadata database, as Airflow Variables.

The core checks every head against its identity's mark (:mod:`airflow_stateful.core.protocol.marks`); this is
where the marks live: somewhere someone who can write the bucket cannot write. Airflow 3 tasks reach the
metadata database only through the Task SDK, and of what the Task SDK lets a task write on Airflow 3.1 to 3.3,
Variables are the only record that lives beyond the task instance and its run (XComs are cleared with the task;
the 3.3 task state store lives in the bucket when this package is its backend). So each identity has one
Variable, ``stateful_mark_<32 hex digits of the SHA-256 of the identity key>``, holding
``{"identity", "epoch", "seq", "commit_id"}`` as JSON. In a task it is read and written through the Task SDK
(the execution API); in the CLI and the api-server, which reach the database themselves, through the ORM.

Marks are kept only when heads are signed (``[stateful] signing_conn_id``): without a key, whoever can write
the bucket can write any head, at any epoch, and a mark would stop nothing. Users who may edit Variables can
edit the marks: the same people who can edit the signing key's connection.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.protocol.marks import HighWaterMark, MarkStore
from airflow_stateful.core.records.identity import Identity

log = logging.getLogger("airflow_stateful")

KEY_PREFIX = "stateful_mark_"
MAX_MARK_CHARS = 8192
"""A mark is about 100 characters plus its identity key; anything longer was not written by this package."""


def variable_key(identity: Identity) -> str:
    """The Variable that holds ``identity``'s mark (a hash: identity keys may be longer than a Variable key)."""
    return KEY_PREFIX + hashlib.sha256(identity.key.encode("utf-8")).hexdigest()[:32]


def _in_task() -> bool:
    """Whether this process is a task under Airflow's supervisor (whose only way to the database is the SDK)."""
    try:
        from airflow.sdk.execution_time import task_runner
    except ImportError:  # pragma: no cover - the Task SDK ships with every supported Airflow
        return False
    return getattr(task_runner, "SUPERVISOR_COMMS", None) is not None


class VariableMarks(MarkStore):
    """High-water marks as Airflow Variables (see the module docstring)."""

    where = "Airflow's metadata database (the Variable stateful_mark_<hash of the identity key>)"

    def get(self, identity: Identity) -> HighWaterMark | None:
        key = variable_key(identity)
        text = self._read(key)
        if text is None:
            return None
        what = f"the high-water mark of {identity.key!r} (Variable {key})"
        if not isinstance(text, str) or len(text) > MAX_MARK_CHARS:
            raise CheckpointCorruptError(f"{what} is not a mark this package wrote")
        try:
            data: Any = json.loads(text)
        except ValueError:
            raise CheckpointCorruptError(f"{what} is not valid JSON") from None
        return HighWaterMark.from_json(data, identity=identity, what=what)

    def put(self, identity: Identity, mark: HighWaterMark) -> None:
        key = variable_key(identity)
        text = json.dumps(mark.to_json(identity), sort_keys=True)
        description = f"airflow-provider-stateful: the newest head written for {identity.key}"[:4000]
        if _in_task():
            from airflow.sdk import Variable

            Variable.set(key, text, description=description)
        else:
            from airflow.models import Variable as VariableModel

            VariableModel.set(key, text, description=description)

    @staticmethod
    def _read(key: str) -> str | None:
        if _in_task():
            from airflow.sdk import Variable

            value: Any = Variable.get(key, default=None)
        else:
            from airflow.models import Variable as VariableModel

            value = VariableModel.get(key, default_var=None)
        return None if value is None else str(value)
