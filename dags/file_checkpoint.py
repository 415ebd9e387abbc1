"""File checkpoint: a training task saves its model weights every epoch and a retry continues from them.

Each epoch of ``train`` "trains" a model whose weights are a directory of files (one of 32 MiB) and
commits them, together with the value ``{"epoch": n, ...}``, as one checkpoint:
``state.save(value, files=model_dir)``. The value and the files are committed atomically: a retry never
sees the epoch number of one checkpoint with the weights of another.

Training happens in a scratch directory that does not outlive the try (as on a new worker or pod). The
first try dies after epoch 2 ("out of memory"); the retry finds ``state.value == {"epoch": 2, ...}``,
restores the weights of epoch 2 with ``state.restore_files(model_dir)`` (every file verified against the
SHA-256 recorded when it was saved) and continues with epoch 3.

Training is simulated but honest about its inputs: epoch ``n``'s weights are pseudo-random bytes seeded
by the SHA-256 of epoch ``n - 1``'s weights, so continuing from wrong or missing weights gives different
final weights. Every saved and restored file is recorded with its SHA-256 in a ledger file.

Run it alone (writes about 150 MiB of checkpoints to ``$AIRFLOW_HOME/stateful``; the task keeps the last 3)::

    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/file_checkpoint.py
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

log = logging.getLogger(__name__)

EPOCHS = 4
FAIL_AFTER_EPOCH = 2
SEED = 20260101
WEIGHTS_BYTES = 32 * 1024 * 1024
OPTIMIZER_BYTES = 256 * 1024


def ledger_path() -> Path:
    """Where saved and restored files are recorded: ``STATEFUL_DEMO_LEDGER`` or a file in AIRFLOW_HOME."""
    default = Path(os.environ.get("AIRFLOW_HOME", ".")) / "file_checkpoint.ledger"
    return Path(os.environ.get("STATEFUL_DEMO_LEDGER", default))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()


def train_epoch(model_dir: Path, epoch: int) -> float:
    """One epoch of "training": new weights derived from the current ones (or the seed). Returns a loss."""
    weights = model_dir / "weights.bin"
    parent = sha256_of(weights) if weights.exists() else f"seed-{SEED}"
    rng = random.Random(f"{parent}:{epoch}")  # a str seed is hashed with SHA-512: the same on every run
    model_dir.mkdir(parents=True, exist_ok=True)
    weights.write_bytes(rng.randbytes(WEIGHTS_BYTES))
    (model_dir / "optimizer").mkdir(exist_ok=True)
    (model_dir / "optimizer" / "adam.bin").write_bytes(rng.randbytes(OPTIMIZER_BYTES))
    (model_dir / "config.json").write_text(json.dumps({"epoch": epoch, "parent": parent}, sort_keys=True))
    return round(1.0 / epoch, 6)


def record(event: str, epoch: int, model_dir: Path) -> None:
    """Ledger lines ``try,epoch,event,relative_path,sha256`` for every file of ``model_dir``."""
    try_number = get_current_context()["ti"].try_number
    with open(ledger_path(), "a") as ledger:
        for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
            rel = path.relative_to(model_dir).as_posix()
            ledger.write(f"{try_number},{epoch},{event},{rel},{sha256_of(path)}\n")


@dag(
    dag_id="file_checkpoint",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["stateful", "example"],
)
def file_checkpoint() -> None:
    # [START file_checkpoint]
    @stateful_task(retries=2, retry_delay=timedelta(seconds=0))
    def train(state: TaskState) -> dict[str, Any]:
        try_number = get_current_context()["ti"].try_number
        with tempfile.TemporaryDirectory(prefix="train-") as scratch:  # gone when the try ends
            model_dir = Path(scratch) / "model"
            done = 0
            if state.value is not None:
                state.restore_files(model_dir)  # the weights of the last saved epoch, verified
                done = state.value["epoch"]
                record("restored", done, model_dir)
                log.info("resuming after epoch %d (loss %s)", done, state.value["loss"])
            for epoch in range(done + 1, EPOCHS + 1):
                loss = train_epoch(model_dir, epoch)
                state.save({"epoch": epoch, "loss": loss}, files=model_dir)  # value + weights, atomically
                record("saved", epoch, model_dir)
                if try_number == 1 and epoch == FAIL_AFTER_EPOCH:
                    raise RuntimeError(f"simulated out-of-memory after epoch {epoch} on try {try_number}")
            return {"epochs": EPOCHS, "loss": state.value["loss"]}

    # [END file_checkpoint]
    train()


dag_object = file_checkpoint()


if __name__ == "__main__":
    dag_object.test()
