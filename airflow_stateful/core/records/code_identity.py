"""What code wrote a checkpoint: enough to tell two programs apart, and to say what changed between them.

Airflow versions the *serialized DAG* (``dag_version_id``), not a task's callable: changing a task's body and
bumping ``schema_version`` may leave the DAG version unchanged, and an unrelated task's edit changes it. So a
checkpoint records, beside the DAG version, the DAG bundle it came from (name and version: a Git bundle's
commit; ``None`` for the unversioned DAG folder), this library's version, and a fingerprint of the task's own
code (:func:`fingerprint_callable`, :func:`fingerprint_json`). The fingerprint decides whether the code changed
(``on_code_change``); the rest is said in the same log line, because it explains why.

No Airflow import: the operator reads the task instance and hands plain strings to :class:`CodeIdentity`.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from airflow_stateful.core.records.fields import Fields

ON_CODE_CHANGE = ("resume", "warn", "restart", "fail")
"""What a task does when it resumes a checkpoint its own code did not write (same ``schema_version``)."""

_LABELS = {
    "fingerprint": "task code",
    "dag_version_id": "dag version",
    "bundle_name": "bundle",
    "bundle_version": "bundle version",
    "provider_version": "airflow-provider-stateful",
}


@dataclass(frozen=True)
class CodeIdentity:
    """The code behind a checkpoint. Every field is optional: outside Airflow most are unknown."""

    #: SHA-256 (hex, first 16 characters) of the task's code: the callable's source, or the pod's image and command.
    fingerprint: str | None = None
    dag_version_id: str | None = None
    bundle_name: str | None = None
    #: The bundle version the try ran (a Git bundle's commit); ``None`` for an unversioned bundle.
    bundle_version: str | None = None
    provider_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, data: Any, *, what: str = "code") -> CodeIdentity:
        """Typed and bounded: it comes from storage."""
        f = Fields(data, what=what)
        return cls(
            fingerprint=f.optional_text("fingerprint", max_len=64),
            dag_version_id=f.optional_text("dag_version_id", max_len=64),
            bundle_name=f.optional_text("bundle_name", max_len=250),
            bundle_version=f.optional_text("bundle_version", max_len=200),
            provider_version=f.optional_text("provider_version", max_len=64),
        )

    def code_changed(self, other: CodeIdentity) -> bool:
        """Whether the task's own code differs (both fingerprints known and unequal)."""
        return bool(self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint)

    def changes(self, other: CodeIdentity) -> list[str]:
        """``["task code 1a2b -> 3c4d", "bundle version abc -> def"]``: what differs from ``self`` to ``other``.

        A field unknown on either side is not a change (a checkpoint from before this was recorded says nothing).
        """
        out = []
        for name, label in _LABELS.items():
            before, after = getattr(self, name), getattr(other, name)
            if name == "bundle_version" and self.bundle_name and self.bundle_name == other.bundle_name:
                if before != after and (before or after):
                    out.append(f"{label} {before or 'unversioned'} -> {after or 'unversioned'}")
                continue
            if before is not None and after is not None and before != after:
                out.append(f"{label} {before} -> {after}")
        return out

    def describe(self) -> str:
        """``code 1a2b from bundle repo@abc, dag version 7``; a try from a DAG folder without versions (Airflow's
        local bundle, ``dag.test()``) says so rather than printing a ``?`` that reads as a missing record."""
        if self.bundle_version:
            bundle = f"from bundle {self.bundle_name or '?'}@{self.bundle_version}"
        elif self.bundle_name:
            bundle = f"from bundle {self.bundle_name}, no bundle version (unversioned DAG folder)"
        else:
            bundle = "no bundle version (unversioned DAG folder)"
        return f"code {self.fingerprint or '?'} {bundle}, dag version {self.dag_version_id or '?'}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def fingerprint_callable(fn: Callable[..., Any]) -> str | None:
    """A fingerprint of a function's code: its source from the ``def`` line on, comments and blank lines out.

    Decorators are left out (``retries=3`` changed to ``retries=5`` is not new code), and so is formatting that
    does not reach the parser's lines, but any change of a statement changes it. Source text rather than bytecode
    or an AST dump, so a new Python on the workers does not make every checkpoint "written by other code". A
    callable without source (a builtin, code made at run time) falls back to its qualified name, or ``None``.
    """
    target = inspect.unwrap(fn)
    try:
        source = textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        name = getattr(target, "__qualname__", None)
        module = getattr(target, "__module__", None)
        return _digest(f"{module}.{name}") if name else None
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
        node = tree.body[0] if tree.body else None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = lines[node.lineno - 1 : node.end_lineno]
    except SyntaxError:  # a lambda's line, say: keep the lines as they are
        pass
    kept = [line.rstrip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return _digest("\n".join(kept))


def fingerprint_json(value: Any) -> str:
    """A fingerprint of code given as data (a pod's image, command and arguments): canonical JSON, hashed."""
    return _digest(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str))
