"""restore / save / run: what the in-pod client does, as functions the CLI and tests call.

Exit codes a pod's command line can rely on: the wrapped command's own code for ``run``; 0 for success;
2 when the client is misconfigured or the checkpoint does not fit this pod (schema version); 3 when the pod
was fenced — a newer try or pod owns the state and this one must stop without writing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from airflow_stateful.client.settings import VALUE_FILE, PodSettings
from airflow_stateful.core.checkpoint_store import CheckpointStore
from airflow_stateful.core.errors import FencedError, IncompatibleStateError
from airflow_stateful.core.records import Manifest, WriterInfo
from airflow_stateful.core.stores.registry import store_from_url

log = logging.getLogger("airflow_stateful.client")

EXIT_CONFIG = 2
EXIT_FENCED = 3


def open_checkpoints(settings: PodSettings) -> CheckpointStore:
    options: dict[str, Any] = {}
    if settings.endpoint_url and settings.backend_url.startswith("s3://"):
        options["endpoint_url"] = settings.endpoint_url
    store = store_from_url(settings.backend_url, **options)
    return CheckpointStore(store=store, identity=settings.identity, keep_last=settings.keep_last)


def writer_from_env(env: dict[str, str] | None = None) -> WriterInfo:
    env = dict(os.environ) if env is None else env
    try_number = env.get("STATEFUL_TRY_NUMBER")
    map_index = env.get("STATEFUL_MAP_INDEX")
    return WriterInfo.current(
        dag_id=env.get("STATEFUL_DAG_ID"),
        task_id=env.get("STATEFUL_TASK_ID"),
        run_id=env.get("STATEFUL_RUN_ID"),
        try_number=int(try_number) if try_number and try_number.isdigit() else None,
        map_index=int(map_index) if map_index and map_index.lstrip("-").isdigit() else None,
        pod=env.get("POD_NAME") or env.get("HOSTNAME"),
    )


def restore(
    settings: PodSettings, directory: Path, checkpoints: CheckpointStore | None = None
) -> Manifest | None:
    """Bring the latest checkpoint's files into ``directory`` and its value into ``<directory>/.stateful-value.json``."""
    checkpoints = checkpoints or open_checkpoints(settings)
    latest = checkpoints.latest()
    directory.mkdir(parents=True, exist_ok=True)
    if latest is None:
        log.info("no checkpoint for %s: starting fresh", settings.identity)
        return None
    if latest.schema_version != settings.schema_version:
        raise IncompatibleStateError(
            f"checkpoint {latest.seq} of {settings.identity} has schema_version {latest.schema_version}, this pod "
            f"expects {settings.schema_version}; the operator migrates state before the pod starts, so this pod "
            "was started by a different operator version. Nothing was restored."
        )
    restored = checkpoints.restore_files(latest, directory)
    (directory / VALUE_FILE).write_text(json.dumps(latest.value))
    log.info(
        "restored checkpoint %d of %s (written by %s at %s): %d file(s)",
        latest.seq,
        settings.identity,
        latest.writer.describe(),
        latest.created_at,
        len(restored),
    )
    return latest


def save(settings: PodSettings, directory: Path, checkpoints: CheckpointStore | None = None) -> Manifest:
    """Commit ``directory`` (and the value in its ``.stateful-value.json``) with the epoch the pod was given."""
    checkpoints = checkpoints or open_checkpoints(settings)
    value_file = directory / VALUE_FILE
    value = json.loads(value_file.read_text()) if value_file.exists() else None
    extra = {"image": os.environ["STATEFUL_IMAGE"]} if os.environ.get("STATEFUL_IMAGE") else None
    manifest = checkpoints.commit(
        settings.lease(),
        value,
        files=directory,
        exclude=(VALUE_FILE,),
        schema_version=settings.schema_version,
        writer=writer_from_env(),
        extra=extra,
    )
    log.info("saved checkpoint %d of %s (%d file(s))", manifest.seq, settings.identity, len(manifest.files))
    return manifest


def run(settings: PodSettings, directory: Path, command: Sequence[str], *, every: float) -> int:
    """Restore, run ``command``, save every ``every`` seconds, on its exit and on SIGTERM; return its code.

    SIGTERM and SIGINT are forwarded to the command; once it exits, the final save runs (within the pod's
    grace period). If a save is fenced, the command is terminated and the exit code is 3.
    """
    checkpoints = open_checkpoints(settings)
    restore(settings, directory, checkpoints)
    child = subprocess.Popen(list(command))
    stopping = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = child.wait(timeout=every)
                break
            except subprocess.TimeoutExpired:
                if stopping.is_set():
                    continue  # the command is shutting down; the final save follows its exit
                save(settings, directory, checkpoints)
        save(settings, directory, checkpoints)
        log.info("command exited with %d%s", code, " after a stop signal" if stopping.is_set() else "")
        return code
    except FencedError as exc:
        log.error("FENCED: %s", exc)
        if child.poll() is None:
            child.terminate()
            child.wait()
        return EXIT_FENCED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        checkpoints.store.close()
