"""A checkpoint value comes back exactly as it was saved, or is refused before anything is written.

``json.dumps`` accepts values it cannot give back: ``{1: "a"}`` returns as ``{"1": "a"}``, a tuple as a list,
an enum as its plain value. A retry resuming from such a value would silently see something else than the
try saved (a dict lookup by ``1`` misses; a tuple compare fails), so the save is refused, naming where.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="etl", task_id="values", run_id="manual__1")


class Colour(str, enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({1: "a"}, r"value has the int key 1, which JSON stores as the string '1'"),
        (
            {"done": {None: 3}},
            r"value\['done'\] has the NoneType key None, which JSON stores as the string 'null'",
        ),
        ({"pos": (3, 4)}, r"value\['pos'\] is a tuple \(\(3, 4\)\), which JSON gives back as a plain list"),
        ({"c": [Colour.RED]}, r"value\['c'\]\[0\] is a Colour .* plain str"),
        ({"s": {1, 2}}, r"not JSON-serializable"),
        ([float("nan")], r"not JSON-serializable"),
    ],
)
def test_a_value_json_would_change_is_refused_naming_where(tmp_path: Path, value: Any, where: str) -> None:
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        lease = cs.acquire()
        cs.commit(lease, {"n": 0})
        before = {info.key: store.get(info.key).data for info in store.list_objects("")}
        with pytest.raises(InvalidValueError, match=where):
            cs.commit(lease, value)
        assert {info.key: store.get(info.key).data for info in store.list_objects("")} == before
        assert cs.latest().value == {"n": 0}  # type: ignore[union-attr]


def test_plain_json_values_come_back_exactly(tmp_path: Path) -> None:
    value = {"n": 2**53, "f": 0.1, "t": True, "z": None, "s": "naïve ☃", "l": [[], {}, [1, "2"]]}
    with LocalObjectStore(root=tmp_path / "state") as store:
        cs = CheckpointStore(store=store, identity=IDENTITY)
        cs.commit(cs.acquire(), value)
        back = CheckpointStore(store=store, identity=IDENTITY).latest()
        assert back is not None and back.value == value
        assert type(back.value["t"]) is bool and type(back.value["n"]) is int
