"""Who wrote a record: host, process, pod and node, so a person (and the restore cache) can tell tries apart."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Any

from airflow_stateful.core.records.fields import Fields


@dataclass(frozen=True)
class WriterInfo:
    """Who wrote a checkpoint or holds a lease. Every field is optional outside Airflow."""

    dag_id: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    map_index: int | None = None
    try_number: int | None = None
    dag_version_id: str | None = None
    host: str | None = None
    pod: str | None = None
    pid: int | None = None
    #: The Kubernetes node the writer ran on (``NODE_NAME``, from the downward API): where its restore cache is.
    node: str | None = None

    @classmethod
    def current(cls, **known: Any) -> WriterInfo:
        """This process: host name, pid and, inside Kubernetes, the pod name; plus what the caller knows."""
        in_pod = "KUBERNETES_SERVICE_HOST" in os.environ
        base: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pod": os.environ.get("POD_NAME") or (os.environ.get("HOSTNAME") if in_pod else None),
            "node": os.environ.get("NODE_NAME") or None,
        }
        base.update({k: v for k, v in known.items() if v is not None})
        return cls(**base)

    def to_json(self) -> dict[str, Any]:
        # Every field is a str or an int: no deep copy (``asdict``) needed, and this runs for every commit.
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, *, what: str = "writer") -> WriterInfo:
        """Known fields only, each typed (unknown ones, from a newer writer, are ignored)."""
        f = Fields(data or {}, what=what)
        return cls(
            dag_id=f.optional_text("dag_id", max_len=250),
            task_id=f.optional_text("task_id", max_len=250),
            run_id=f.optional_text("run_id", max_len=250),
            map_index=f.optional_integer("map_index", minimum=-1),
            try_number=f.optional_integer("try_number"),
            dag_version_id=f.optional_text("dag_version_id", max_len=64),
            host=f.optional_text("host", max_len=255),
            pod=f.optional_text("pod", max_len=253),
            pid=f.optional_integer("pid"),
            node=f.optional_text("node", max_len=253),
        )

    def describe(self) -> str:
        parts = []
        if self.try_number is not None:
            parts.append(f"try {self.try_number}")
        if self.run_id:
            parts.append(f"run {self.run_id}")
        if self.pod:
            parts.append(f"pod {self.pod}" + (f" on node {self.node}" if self.node else ""))
        elif self.host:
            parts.append(f"host {self.host}")
        return ", ".join(parts) or "an unknown writer"
