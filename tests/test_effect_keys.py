"""Effect keys: the same in every try of one task instance, different across runs, tasks and map indexes.

The Airflow test runs a real mapped ``@stateful_task`` with ``dag.test()``: try 1 of each map index records
its key and crashes, try 2 records it again; a second DAG run records its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_stateful_tasks import run_dag, write_dag

from airflow_stateful.core import Identity
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.protocol.effects import effect_key

KEY = re.compile(r"^stateful-[0-9a-f]{40}$")
IDENTITY = Identity.for_task(dag_id="billing", task_id="charge", run_id="manual__1")


def test_a_key_depends_on_the_identity_and_the_name_only() -> None:
    key = effect_key(IDENTITY, "invoice-7")
    assert KEY.match(key)
    assert effect_key(Identity.parse(IDENTITY.key), "invoice-7") == key, "a fresh process computes the same"
    others = {
        effect_key(IDENTITY, "invoice-8"),
        effect_key(Identity.for_task(dag_id="billing", task_id="charge", run_id="manual__2"), "invoice-7"),
        effect_key(Identity.for_task(dag_id="billing", task_id="refund", run_id="manual__1"), "invoice-7"),
        effect_key(
            Identity.for_task(dag_id="billing", task_id="charge", run_id="manual__1", map_index=0),
            "invoice-7",
        ),
    }
    assert key not in others and len(others) == 4
    # Pinned: a key must never change between releases, or every retry after an upgrade repeats its effects.
    # The literal was computed once (before the first release) and must never be recomputed from the code under
    # test.
    assert key == "stateful-a07cce2fa10fae5f5813fbbe724cdcfc88b9b18e"


@pytest.mark.parametrize("name", ["", "a\nb", "x" * 513, 7, None])
def test_a_bad_name_is_refused_naming_it(name: object) -> None:
    with pytest.raises(InvalidValueError, match="effect name"):
        effect_key(IDENTITY, name)  # type: ignore[arg-type]


MAPPED = """\
import json

@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0))
    def charge(shard: int, state: TaskState):
        ti = current_ti()
        with open(LEDGER, "a") as ledger:
            ledger.write(json.dumps([ti.try_number, ti.map_index, ti.run_id, state.effect_key("invoice")]) + "\\n")
        if ti.try_number == 1:
            raise RuntimeError("crashed after the effect, before the checkpoint")

    charge.expand(shard=[0, 1])


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_every_try_of_a_task_instance_gets_the_same_key(dags_folder: Path, tmp_path: Path) -> None:
    import json

    dag_file = write_dag(dags_folder, tmp_path, MAPPED)
    for _ in range(2):  # two DAG runs
        _, run = run_dag(dag_file)
        assert run.state == "success"
    rows = [json.loads(line) for line in dag_file.ledger.read_text().splitlines()]
    keys: dict[tuple[str, int], set[str]] = {}
    tries: dict[tuple[str, int], list[int]] = {}
    for try_number, map_index, run_id, key in rows:
        assert KEY.match(key)
        keys.setdefault((run_id, map_index), set()).add(key)
        tries.setdefault((run_id, map_index), []).append(try_number)
    assert len(rows) == 8 and all(sorted(t) == [1, 2] for t in tries.values()), (
        "2 runs x 2 map indexes x 2 tries"
    )
    assert all(len(found) == 1 for found in keys.values()), f"a retry got another key: {keys}"
    assert len({next(iter(found)) for found in keys.values()}) == 4, "runs and map indexes differ"
