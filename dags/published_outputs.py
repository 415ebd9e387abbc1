"""Published outputs: files handed to a downstream DAG only once committed, exactly once across a crash.

``published_outputs`` writes three report parts. Each part is staged with ``state.publish(name, path)`` and
becomes visible only with the next ``state.save``, atomically with the checkpoint. The task declares an
outlet asset: when it succeeds, its asset event lists the outputs this run committed (name, size, SHA-256,
where), and ``consume_published_outputs``, scheduled on that asset, fetches each one through the store API,
verified. A try that dies between publishing a part and the save that would commit it leaves nothing
visible: its retry resumes from the last checkpoint, writes and publishes the part again, and each part is
committed once.

Run parameter ``interrupt`` (default ``"none"``): on try 1, after publishing part 1 and before saving it,
``"raise"`` fails the try with an exception and ``"sigkill"`` kills the task's own process (what an OOM kill
or a lost node does). Two tasks do the same on two stores: ``to_default_store`` uses ``[stateful]
backend_url`` and ``to_local_store`` a local directory (``STATEFUL_DEMO_LOCAL_URL``, default
``file://$AIRFLOW_HOME/stateful-local``), so one run shows both.

The consumer appends one ``task,name,sha256,size,try_number`` row per output it fetched and verified to
``STATEFUL_DEMO_OUTPUTS_LEDGER`` (default ``$AIRFLOW_HOME/published_outputs.ledger``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, dag, get_current_context, task

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

PARTS = 3
OUTPUTS_ASSET = Asset("stateful-demo://published_outputs/report")


def _home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME", "."))


def local_store_url() -> str:
    return os.environ.get("STATEFUL_DEMO_LOCAL_URL") or (_home() / "stateful-local").resolve().as_uri()


def ledger_path() -> Path:
    return Path(os.environ.get("STATEFUL_DEMO_OUTPUTS_LEDGER") or _home() / "published_outputs.ledger")


def write_part(workdir: Path, n: int, try_number: int) -> Path:
    """Part ``n`` of the report. Its content names the try, so a reader can tell which try's part it got."""
    path = workdir / f"part-{n:04d}.csv"
    rows = "".join(f"{n},{row},{n * 1000 + row}\n" for row in range(2000))
    path.write_text(f"# written by try {try_number}\npart,row,value\n{rows}")
    return path


def produce(state: TaskState) -> dict[str, Any]:
    """Write, publish and commit one part at a time; on try 1, optionally die between publish and save."""
    context = get_current_context()
    try_number = context["ti"].try_number
    interrupt = str(context["params"]["interrupt"])
    done = state.value or {"parts": 0}
    with tempfile.TemporaryDirectory(prefix="report-") as workdir:
        for n in range(done["parts"], PARTS):
            name = f"part-{n:04d}"
            state.publish(name, write_part(Path(workdir), n, try_number))
            if try_number == 1 and n == 1 and interrupt != "none":
                log.warning("try 1: %s is staged, not committed; interrupting (%s)", name, interrupt)
                if interrupt == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"interrupted on purpose after publishing {name}")
            done = {"parts": n + 1}
            state.save(done)  # commits the checkpoint and makes the part visible, atomically
    return {"parts": done["parts"], "outputs": sorted(state.outputs())}


@dag(
    dag_id="published_outputs",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"interrupt": "none"},
    tags=["stateful", "example"],
)
def published_outputs() -> None:
    @stateful_task(retries=1, retry_delay=timedelta(seconds=0), outlets=[OUTPUTS_ASSET])
    def to_default_store(state: TaskState) -> dict[str, Any]:
        return produce(state)

    @stateful_task(
        retries=1, retry_delay=timedelta(seconds=0), outlets=[OUTPUTS_ASSET], backend_url=local_store_url()
    )
    def to_local_store(state: TaskState) -> dict[str, Any]:
        return produce(state)

    to_default_store()
    to_local_store()


@dag(
    dag_id="consume_published_outputs",
    schedule=[OUTPUTS_ASSET],
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example"],
)
def consume_published_outputs() -> None:
    @task
    def fetch(**context: Any) -> int:
        """Fetch every output the triggering asset events list, each verified, and check its SHA-256."""
        from airflow_stateful.core import CheckpointStore, Identity
        from airflow_stateful.hooks.state import StateHook

        fetched = 0
        for events in context["triggering_asset_events"].values():
            for event in events:
                about = (event.extra or {}).get("stateful_outputs")
                if not about:
                    continue
                hook = StateHook(backend_url=about["store"])
                store = CheckpointStore(store=hook.get_store(), identity=Identity.parse(about["identity"]))
                with tempfile.TemporaryDirectory(prefix="fetched-") as dest:
                    for name, info in sorted(about["outputs"].items()):
                        (path,) = store.restore_output(name, dest)
                        sha = hashlib.sha256(path.read_bytes()).hexdigest()
                        if sha != info["sha256"]:
                            raise ValueError(f"{name}: fetched {sha}, the event said {info['sha256']}")
                        task_id = Identity.parse(about["identity"]).task_parts["task_id"]
                        row = f"{task_id},{name},{sha},{info['size']},{info.get('try_number')}\n"
                        with open(ledger_path(), "a") as ledger:
                            ledger.write(row)
                        fetched += 1
                hook.close()
        log.info("fetched and verified %d output(s)", fetched)
        return fetched

    fetch()


dag_object = published_outputs()
consumer = consume_published_outputs()

if __name__ == "__main__":
    dag_object.test(run_conf={"interrupt": "raise"})
