"""restore / save / run / sidecar: what the in-pod client does, as functions the CLI and tests call.

Every verb opens a :class:`~airflow_stateful.core.protocol.session.WriterSession` on the lease the operator took for
this pod (adopted, never released: the operator releases it). Opening renews the lease once, which proves it
is still this pod's before anything is restored or saved; ``run`` and ``sidecar`` keep renewing it in the
background, so a pod may compute for hours between two saves, and stop the job at once if a newer try took
the lease over.

With ``STATEFUL_RESTORE_CACHE_DIR`` (the operator's ``restore_cache_host_path``, a directory on the node) the
client restores through the node's restore cache, :class:`~airflow_stateful.core.data.chunk_cache.LocalChunkCache`
(every chunk verified against the checkpoint's SHA-256 before it is used), logs how much of the restore it
served, and fills it after each save. The cache can only save downloads: one that cannot be used is reported
once and skipped, never fails the pod.

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
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from airflow_stateful.client.settings import VALUE_FILE, PodSettings
from airflow_stateful.core.data.restore_modes import EXACT
from airflow_stateful.core.errors import FencedError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.registry import store_from_url

log = logging.getLogger("airflow_stateful.client")

EXIT_CONFIG = 2
EXIT_FENCED = 3
_POLL = 0.5
"""How often ``run`` looks at its job and at the lease between saves (seconds)."""


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


@contextmanager
def pod_session(settings: PodSettings, *, heartbeat: bool) -> Iterator[WriterSession]:
    """The pod's writer session on the operator's lease; the store is closed afterwards."""
    # Encryption, KMS key, expected owner, TLS and botocore settings as the operator's connection has them
    # (STATEFUL_S3_*); credentials from boto3's chain.
    store = store_from_url(settings.backend_url, **settings.store_options())
    checkpoints = CheckpointStore(
        store=store,
        identity=settings.identity,
        signer=settings.head_signer,
        keep_last=settings.keep_last,
        lease_ttl=settings.lease_ttl,
    )
    cache = settings.restore_cache()
    session = WriterSession(
        checkpoints=checkpoints,
        writer=writer_from_env(),
        schema_version=settings.schema_version,
        lease=settings.lease(),
        heartbeat=heartbeat,
    )
    session.use_restore_cache(
        cache, runner="this pod"
    )  # restores read it first; what a save commits is kept in it
    try:
        with session:
            yield session
    finally:
        if cache is not None:
            cache.close()
        store.close()


def restore(session: WriterSession, directory: Path, *, mode: str = EXACT) -> Manifest | None:
    """Bring the latest checkpoint's files into ``directory`` and its value into ``<directory>/.stateful-value.json``.

    ``mode="exact"`` (default): the pod owns its work directory, so afterwards it holds exactly the checkpoint's
    files (and the value file); what a killed pod left beside them is removed within the same all-or-nothing
    swap. ``"merge"`` and ``"empty"`` as for :meth:`~airflow_stateful.core.protocol.session.WriterSession.restore_files`.
    The result's line is logged (also "no checkpoint yet", when ``directory`` is left as it was)."""
    latest = session.latest
    directory.mkdir(parents=True, exist_ok=True)
    # The pod's state directory is an emptyDir (mode 0777): only this pod's containers can write it, so it is
    # shared knowingly, with them.
    result = session.restore_files(directory, mode=mode, shared_dest=True)
    if latest is None:
        log.info("no checkpoint for %s: starting fresh", session.identity)
        return None
    (directory / VALUE_FILE).write_text(json.dumps(session.value))
    log.info(
        "restored checkpoint %d of %s (written by %s at %s): %d file(s)%s",
        latest.seq,
        session.identity,
        latest.writer.describe(),
        latest.created_at,
        len(result),
        f", {len(result.removed)} not in it removed" if result.removed else "",
    )
    return latest


def save(session: WriterSession, directory: Path) -> Manifest:
    """Commit ``directory`` (and the value in its ``.stateful-value.json``) with the epoch the pod was given."""
    value_file = directory / VALUE_FILE
    value = json.loads(value_file.read_text()) if value_file.exists() else None
    extra = {"image": os.environ["STATEFUL_IMAGE"]} if os.environ.get("STATEFUL_IMAGE") else None
    manifest = session.commit(value, files=directory, exclude=(VALUE_FILE,), extra=extra, keep_files=False)
    log.info("saved checkpoint %d of %s (%d file(s))", manifest.seq, session.identity, manifest.file_count)
    return manifest


def _periodic_save(session: WriterSession, directory: Path) -> None:
    """A save between the final ones: a store hiccup is logged, not fatal (the heartbeat judges the lease)."""
    try:
        save(session, directory)
    except FencedError:
        raise
    except Exception as exc:
        log.warning("periodic save failed (%s); the next one or the final save retries", exc)


@contextmanager
def _stop_signals() -> Iterator[threading.Event]:
    """While inside, SIGTERM and SIGINT set the returned event instead of ending the process."""
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopping
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(
    settings: PodSettings, directory: Path, command: Sequence[str], *, every: float, mode: str = EXACT
) -> int:
    """Restore (in ``mode``), run ``command``, save every ``every`` seconds, on its exit and on SIGTERM; return
    its code.

    SIGTERM and SIGINT are forwarded to the command; once it exits, the final save runs (within the pod's
    grace period). If the lease is lost (a save is fenced, or the heartbeat finds it taken over), the command
    is terminated at once and the exit code is 3.
    """
    with pod_session(settings, heartbeat=True) as session, _stop_signals() as stopping:
        restore(session, directory, mode=mode)
        child = subprocess.Popen(list(command))
        forwarded = False
        try:
            next_save = time.monotonic() + every
            while True:
                try:
                    code = child.wait(timeout=_POLL)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if stopping.is_set() and not forwarded:
                    child.send_signal(signal.SIGTERM)  # the final save follows the command's exit
                    forwarded = True
                session.ensure_alive()  # a lost lease stops the job now, not at the next save
                if not stopping.is_set() and time.monotonic() >= next_save:
                    _periodic_save(session, directory)
                    next_save = time.monotonic() + every
            save(session, directory)
            log.info("command exited with %d%s", code, " after a stop signal" if stopping.is_set() else "")
            return code
        except FencedError as exc:
            log.error("FENCED: %s", exc)
            if child.poll() is None:
                child.terminate()
                child.wait()
            return EXIT_FENCED


def sidecar(settings: PodSettings, directory: Path, *, every: float) -> int:
    """Keep the lease alive and save ``directory`` every ``every`` seconds, and once more on SIGTERM.

    The native-sidecar form of ``run`` for images that cannot be changed: the kubelet sends SIGTERM when the
    job container ends or the pod is deleted. Returns 0, or 3 once the lease is lost.
    """
    with pod_session(settings, heartbeat=True) as session, _stop_signals() as stopping:
        try:
            next_save = time.monotonic() + every
            while not stopping.wait(_POLL):
                session.ensure_alive()
                if time.monotonic() >= next_save:
                    _periodic_save(session, directory)
                    next_save = time.monotonic() + every
            save(session, directory)
            return 0
        except FencedError as exc:
            log.error("FENCED: %s", exc)
            return EXIT_FENCED
