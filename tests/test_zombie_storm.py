"""A short zombie storm in ``make test`` (``make storm`` runs it for minutes): writer processes stealing one
identity's lease in turns, on the local store and on S3: moto serialized (atomic conditional writes) and SeaweedFS,
a real S3 server.

See tests/soak/zombie_storm.py for what each writer does and what the checker verifies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from s3_endpoint import both_servers_when_long, main_kind

sys.path.insert(0, str(Path(__file__).resolve().parent / "soak"))
import zombie_storm

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize(
    ("kind", "server"),
    [("local", ""), *both_servers_when_long("s3", marks=(pytest.mark.s3,))],
)
def test_writers_stealing_one_lease_in_turns_lose_no_acknowledged_update(kind: str, server: str) -> None:
    before = dict(os.environ)
    result = zombie_storm.storm(
        kind, writers=3, seconds=3, seed=7, server="env" if server == "main" else server
    )
    expected = "local" if kind == "local" else f"s3 ({main_kind() if server == 'main' else server})"
    assert result["store"] == expected
    # The storm's server is gone: its endpoint left in this process's environment sent a later test's
    # `airflow-stateful gc` to a dead port (STATEFUL_S3_ENDPOINT_URL overrides the connection's endpoint).
    assert dict(os.environ) == before, "the storm left its settings in the environment"
    print({k: v for k, v in result.items() if k != "problems"})
    assert result["problems"] == []
    # The storm really stormed: many hand-overs, each ending with a writer told it was fenced.
    assert result["acquisitions"] >= 5 and result["fenced"] >= 4 and result["acknowledged"] >= 12
    assert result["history_checked"] == result["acknowledged"]


def test_the_checker_sees_a_lost_update_and_a_late_upload(tmp_path: Path) -> None:
    """The storm's verdict is not vacuous: two acknowledgements of one seq and an upload after being told."""
    from airflow_stateful.core.stores.local import LocalObjectStore

    events = [
        {"t": 1.0, "writer": "w0", "event": "acquired", "epoch": 1},
        {"t": 2.0, "writer": "w0", "event": "ack", "epoch": 1, "seq": 1, "commit_id": "a" * 32, "value": {}},
        {"t": 3.0, "writer": "w1", "event": "ack", "epoch": 2, "seq": 1, "commit_id": "b" * 32, "value": {}},
        {"t": 4.0, "writer": "w0", "event": "fenced", "epoch": 1},
        {"t": 5.0, "writer": "w0", "event": "upload", "epoch": 1, "key": "x/~chunks/c"},
    ]
    with LocalObjectStore(root=tmp_path / "state") as store:
        problems = zombie_storm.check(store, events, tmp_path)["problems"]
    assert any("seq 1 acknowledged 2 times" in p for p in problems)
    assert any("after it was told it was fenced" in p for p in problems)
    assert any("is not in the history" in p for p in problems)
