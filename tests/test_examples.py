"""The example DAGs of docs run under real Airflow (``dag.test()`` on SQLite) and do what they say.

Each test loads its DAG file from the session's DAG folder (``dags_folder``), points ``[stateful]`` at a
fresh local directory and reads back what the tasks really did: a ledger of side effects written by the
task code, and the checkpoints in the store.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from dag_helpers import AIRFLOW_VERSION, NEEDS_33, dagbag, import_errors_outside_33_examples, load_dag_module

if TYPE_CHECKING:
    from airflow_stateful.core import CheckpointStore

pytestmark = pytest.mark.airflow
REPO_DAGS = Path(__file__).resolve().parent.parent / "dags"
# Where an example's snippets are when not in its DAG file: the maintenance DAG's file only calls the factory the
# package ships (a user's DAG folder holds the same one call), so the snippets are in the factory's body.
SNIPPET_FILES = {"stateful_maintenance": REPO_DAGS.parent / "airflow_stateful" / "maintenance.py"}


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.csv"
    monkeypatch.setenv("STATEFUL_DEMO_LEDGER", str(path))
    return path


@pytest.fixture
def state_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh state directory per test, so named state of an earlier test cannot leak in."""
    url = (tmp_path / "state").as_uri()
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", url)
    return url


def checkpoint_store(url: str, key: str) -> CheckpointStore:
    from airflow_stateful.core import CheckpointStore, Identity, store_from_url

    return CheckpointStore(store=store_from_url(url), identity=Identity.parse(key))


def ledger_rows(path: Path) -> list[list[str]]:
    return [line.split(",") for line in path.read_text().splitlines() if line]


def returned(run: Any) -> Any:
    """What the run's (only) task returned, read back from Airflow's XCom table."""
    from airflow import settings
    from airflow.models.xcom import XComModel

    with settings.Session() as session:
        query = XComModel.get_many(run_id=run.run_id, dag_ids=run.dag_id, key="return_value")
        return XComModel.deserialize_value(session.scalars(query).one())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


EXAMPLES = {
    "durable_watermark": ["durable_watermark"],
    "file_checkpoint": ["file_checkpoint"],
    "upgrade_with_migration": ["upgrade_with_migration", "upgrade_with_migration_migration"],
    "task_state_store": ["task_state_store"],
    "checkpoint_sensor": ["checkpoint_sensor", "lease_released_sensor"],
    "kubernetes_training": ["kubernetes_training_wrapped", "kubernetes_training_sidecar"],
    "stateful_maintenance": ["stateful_maintenance", "stateful_stuck_check"],
}


def test_example_dag_files_import_cleanly_with_their_doc_snippets(airflow_home: Path) -> None:
    bag = dagbag(REPO_DAGS)
    assert import_errors_outside_33_examples(bag) == {}
    assert {name for name in EXAMPLES if f"{name}.py" not in NEEDS_33 or AIRFLOW_VERSION >= (3, 3)} <= set(
        bag.dag_ids
    )
    for name, snippets in EXAMPLES.items():
        path = SNIPPET_FILES.get(name, REPO_DAGS / f"{name}.py")
        lines = [line.strip() for line in path.read_text().splitlines()]
        for snippet in snippets:
            start, end = lines.index(f"# [START {snippet}]"), lines.index(f"# [END {snippet}]")
            assert start < end, f"{path.name}: snippet {snippet} is empty or its markers are swapped"


# -- durable_watermark --------------------------------------------------------------------------------------
def test_durable_watermark_next_run_starts_after_the_previous_runs_watermark(
    dags_folder: Path, ledger: Path, state_url: str, tmp_path: Path
) -> None:
    module = load_dag_module(dags_folder / "durable_watermark.py")
    first = module.dag_object.test(logical_date=datetime(2026, 1, 3, tzinfo=timezone.utc))
    second = module.dag_object.test(logical_date=datetime(2026, 1, 5, tzinfo=timezone.utc))
    assert (first.state, second.state) == ("success", "success")
    assert first.run_id != second.run_id

    # The source has a row every 3 hours from 2026-01-01 00:00; a run loads rows up to its data interval's end.
    assert (first.data_interval_end, second.data_interval_end) == (first.logical_date, second.logical_date)
    loaded: dict[str, list[int]] = {}
    for try_number, row_id, run_id in ledger_rows(ledger):
        assert try_number == "1"
        loaded.setdefault(run_id, []).append(int(row_id))
    assert loaded[first.run_id] == list(range(17)), "the first run starts from an empty watermark"
    assert loaded[second.run_id] == list(range(17, 33)), (
        "the second run loads only the rows after the first run's watermark (row 16, 2026-01-03 00:00)"
    )
    first_result, second_result = returned(first), returned(second)
    assert first_result["started_after"] is None
    assert first_result["watermark"] == "2026-01-03T00:00:00+00:00"
    assert second_result["started_after"] == first_result["watermark"], "run 2 read run 1's final value"

    # The state is the task's, not a run's: one named identity, no per-run identity.
    key = "durable_watermark/load_new_rows/name=nightly-watermark/map=-1"
    task_dir = tmp_path / "state" / "durable_watermark" / "load_new_rows"
    assert sorted(p.name for p in task_dir.iterdir()) == ["name=nightly-watermark"]
    checkpoints = checkpoint_store(state_url, key)
    latest = checkpoints.latest()
    assert latest is not None and latest.identity == key
    assert latest.value == {"watermark": "2026-01-05T00:00:00+00:00", "last_id": 32, "loaded": 33}, (
        "the second run carried the first run's value forward (its 'loaded' counter continues)"
    )
    assert latest.writer.run_id == second.run_id
    writers = [checkpoints.get(entry.seq).writer.run_id for entry in checkpoints.history()]
    assert set(writers) == {second.run_id}, "the newest checkpoints are the second run's"

    # A late re-run of the first date finds nothing new: the watermark is already past it.
    before = ledger.read_text()
    again = module.dag_object.test(logical_date=datetime(2026, 1, 3, tzinfo=timezone.utc))
    assert again.state == "success"
    assert ledger.read_text() == before, "no row was loaded twice"
    assert checkpoints.latest() == latest


# -- file_checkpoint ----------------------------------------------------------------------------------------
def test_file_checkpoint_retry_restores_value_and_files_byte_identical(
    dags_folder: Path, ledger: Path, state_url: str, tmp_path: Path
) -> None:
    module = load_dag_module(dags_folder / "file_checkpoint.py")
    run = module.dag_object.test()
    assert run.state == "success"

    saved: dict[tuple[int, int], dict[str, str]] = {}  # (try, epoch) -> {file: sha256}
    restored: dict[tuple[int, int], dict[str, str]] = {}
    for try_number, epoch, event, rel, sha in ledger_rows(ledger):
        target = saved if event == "saved" else restored
        target.setdefault((int(try_number), int(epoch)), {})[rel] = sha
    assert sorted(saved) == [(1, 1), (1, 2), (2, 3), (2, 4)], "try 2 continues with epoch 3, not 1"
    assert sorted(restored) == [(2, 2)], "try 2 restores the files of epoch 2 once, before training"
    assert restored[(2, 2)] == saved[(1, 2)], "every restored file is byte-identical to what try 1 saved"
    assert sorted(saved[(1, 2)]) == ["config.json", "optimizer/adam.bin", "weights.bin"]

    # Recompute the weights from the seed: epoch 3 was trained on exactly epoch 2's weights.
    model_dir = tmp_path / "recomputed"
    for epoch in range(1, module.EPOCHS + 1):
        module.train_epoch(model_dir, epoch)
        expected = {
            p.relative_to(model_dir).as_posix(): sha256_of(p) for p in model_dir.rglob("*") if p.is_file()
        }
        try_number = 1 if epoch <= module.FAIL_AFTER_EPOCH else 2
        assert saved[(try_number, epoch)] == expected, f"epoch {epoch} weights differ from the seed's"
    assert (model_dir / "weights.bin").stat().st_size >= 32 * 1024 * 1024

    from airflow_stateful.core import Identity

    key = Identity.for_task(dag_id="file_checkpoint", task_id="train", run_id=run.run_id).key
    checkpoints = checkpoint_store(state_url, key)
    latest = checkpoints.latest()
    assert latest is not None
    assert latest.value == {"epoch": 4, "loss": 0.25}
    assert latest.writer.try_number == 2
    sizes = {f.path: f.size for f in checkpoints.files(latest)}
    assert sizes["weights.bin"] == 32 * 1024 * 1024
    final = tmp_path / "final"
    checkpoints.restore_files(latest, final)
    assert {rel: sha256_of(final / rel) for rel in sizes} == saved[(2, 4)]
    assert [e.seq for e in checkpoints.history()] == [4, 3, 2], "one checkpoint per epoch, keep_last=3"


# -- upgrade_with_migration ---------------------------------------------------------------------------------
V1_SOURCE = '''"""Version 1 of upgrade_with_migration (written by tests/test_examples.py): state {"done": [ids]}."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task

INVOICES = 20
CHECKPOINT_EVERY = 5
FAIL_AT = 12


def record(event: str, number: int) -> None:
    try_number = get_current_context()["ti"].try_number
    with open(Path(os.environ["STATEFUL_DEMO_LEDGER"]), "a") as ledger:
        ledger.write(f"v1,{try_number},{event},{number}\\n")


@dag(dag_id="upgrade_with_migration", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def upgrade_with_migration() -> None:
    @stateful_task(retries=0)  # schema_version=1
    def bill_invoices(state: TaskState) -> dict:
        try_number = get_current_context()["ti"].try_number
        record("start", state.checkpoint.seq if state.checkpoint else 0)
        done = list((state.value or {"done": []})["done"])
        for n in range(INVOICES):
            if n in done:
                continue
            if try_number == 1 and n == FAIL_AT:
                raise RuntimeError(f"version 1 crashed at invoice {n}")
            record("billed", n)
            done.append(n)
            if len(done) % CHECKPOINT_EVERY == 0:
                state.save({"done": done})
        state.save({"done": done})
        return {"done": len(done)}

    bill_invoices()


dag_object = upgrade_with_migration()
'''


def billed(ledger: Path, version: str) -> list[int]:
    return [int(n) for v, _, event, n in ledger_rows(ledger) if v == version and event == "billed"]


def starts(ledger: Path, version: str) -> list[int]:
    return [int(n) for v, _, event, n in ledger_rows(ledger) if v == version and event == "start"]


def test_upgrade_with_migration_resumes_a_v1_run_from_the_migrated_state(
    dags_folder: Path,
    ledger: Path,
    state_url: str,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow_stateful.core import Identity

    # dag.test() re-serializes a changed DAG file only 30 s after the last write by default; a deployment
    # must show as a new DAG version at once.
    monkeypatch.setenv("AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL", "0")

    path = dags_folder / "upgrade_with_migration.py"
    session_copy = path.read_bytes()
    v2_source = (REPO_DAGS / "upgrade_with_migration.py").read_text()
    # dag.test() names its run after run_after (default: now): fix both to re-run the same run_id.
    when = datetime(2026, 3, 1, tzinfo=timezone.utc)
    try:
        # Version 1 is deployed; its run dies at invoice 12, after checkpointing invoices 0..9.
        path.write_text(V1_SOURCE)
        v1_run = load_dag_module(path).dag_object.test(logical_date=when, run_after=when)
        assert v1_run.state == "failed"
        key = Identity.for_task(
            dag_id="upgrade_with_migration", task_id="bill_invoices", run_id=v1_run.run_id
        ).key
        checkpoints = checkpoint_store(state_url, key)
        v1_latest = checkpoints.latest()
        assert v1_latest is not None
        assert (v1_latest.schema_version, v1_latest.value) == (1, {"done": list(range(10))})
        assert billed(ledger, "v1") == list(range(12))

        # Version 2 is deployed; the same run is retried by the new code.
        path.write_text(v2_source)
        module = load_dag_module(path)
        v2_run = module.dag_object.test(logical_date=when, run_after=when)
        assert v2_run.run_id == v1_run.run_id, "the same DAG run, so the same per-run identity"
        assert v2_run.state == "success"

        assert billed(ledger, "v2") == list(range(10, 20)), (
            "v2 resumes after v1's last checkpoint: nothing v1 checkpointed is billed again"
        )
        assert set(billed(ledger, "v1")) & set(billed(ledger, "v2")) == {10, 11}, (
            "only what v1 did after its last checkpoint is redone"
        )
        # The migrated value was committed, with schema 2, before v2's code ran: that code started from it.
        assert starts(ledger, "v2") == [v1_latest.seq + 1]
        migrated = checkpoints.get(v1_latest.seq + 1)
        assert migrated.schema_version == 2
        expected_totals: dict[str, int] = {}
        for n in range(10):
            currency, cents = module.invoice(n)
            expected_totals[currency] = expected_totals.get(currency, 0) + cents
        assert migrated.value == {"cursor": 10, "totals": expected_totals}
        # Before 3.3 the new code runs, but under the run's first dag_version_id.
        if AIRFLOW_VERSION >= (3, 3):
            assert migrated.writer.dag_version_id and migrated.writer.dag_version_id != (
                v1_latest.writer.dag_version_id
            ), "the migrated checkpoint was written by the new DAG version"
        history = checkpoints.history()
        assert [e.seq for e in history] == [
            v1_latest.seq + 3,
            v1_latest.seq + 2,
            v1_latest.seq + 1,
        ]
        assert {e.schema_version for e in history} == {2}
        all_totals: dict[str, int] = {}
        for n in range(module.INVOICES):
            currency, cents = module.invoice(n)
            all_totals[currency] = all_totals.get(currency, 0) + cents
        assert checkpoints.latest().value == {"cursor": 20, "totals": all_totals}, "each invoice counted once"

        # Without the migration, version 2 refuses the version 1 checkpoint and leaves it as it was.
        other = when + timedelta(days=1)
        path.write_text(V1_SOURCE)
        v1_again = load_dag_module(path).dag_object.test(logical_date=other, run_after=other)
        assert v1_again.state == "failed"
        key = Identity.for_task(
            dag_id="upgrade_with_migration", task_id="bill_invoices", run_id=v1_again.run_id
        ).key
        checkpoints = checkpoint_store(state_url, key)
        v1_latest = checkpoints.latest()
        v1_history = checkpoints.history()
        assert v1_latest is not None and v1_latest.schema_version == 1
        no_migration = v2_source.replace("migrations={1: upgrade_v1_to_v2},", "")
        assert no_migration.count("upgrade_v1_to_v2") == v2_source.count("upgrade_v1_to_v2") - 1
        path.write_text(no_migration)
        ledger_before = ledger.read_text()
        capfd.readouterr()
        broken = load_dag_module(path).dag_object.test(logical_date=other, run_after=other)
        assert broken.state == "failed"
        assert ledger.read_text() == ledger_before, "no code of the task ran: nothing was billed"
        assert checkpoints.latest() == v1_latest, "the version 1 checkpoint is unchanged and still readable"
        assert checkpoints.history() == v1_history
        log = capfd.readouterr().out
        refusal = f"IncompatibleStateError: cannot resume from checkpoint {v1_latest.seq} (written by try 1, "
        assert refusal in log, "the task log says which checkpoint was refused"
        assert (
            "the checkpoint has schema_version 1 but this task expects 2, and there is no migration from "
            "version 1 (add migrations={1: fn} that turns a version 1 value into a version 2 one), or set "
            "on_incompatible='restart'. The checkpoint is untouched."
        ) in log, "the error names both versions and what to do"
    finally:
        path.write_bytes(session_copy)
