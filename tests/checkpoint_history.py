"""A task instance's state as four tries leave it, written through the real CheckpointStore on a fake clock.

Used by the Checkpoints tab tests (tests/test_checkpoints_tab.py) and the real api-server test
(tests/test_ui_auth.py), which also take the screenshots in docs/img/.

* try 1 (epoch 1) commits 4 checkpoints, 100 items each, then dies (its lease expires);
* try 2 (epoch 2) takes the expired lease, resumes at 400 items, commits 3 checkpoints, publishes the output
  ``summary.json``; then try 3 (epoch 3) takes the lease and dies before its first commit;
* try 4 (epoch 4) resumes at 700 items, commits 3 checkpoints, publishes ``report.csv``, and still holds the lease
  (renewed at its last commit; declared ``expected_checkpoint_interval`` 10 minutes).

Each commit is 60 s after the one before; ``hostile`` makes try 4's host and pod markup. :func:`forge_head`
rewrites a head as anyone who can write the bucket could (also used by tests/test_stateful_view.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import HEAD_NAME
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore

START = 1_800_000_000.0  # 2027-01-15T08:00:00Z
HOSTILE_HOST = "<script>alert(1)</script>"
HOSTILE_POD = '"><img src=x onerror=alert(2)>'
STEP = 60.0
LEASE_TTL = 600.0


@dataclass
class History:
    identity: Identity
    #: the time of the last commit (try 4's lease was renewed then)
    last_commit: float
    #: try 4's lease: acquired at, expires at
    acquired: float
    expires: float


def write_history(
    store: ObjectStore, identity: Identity, files: Path, *, start: float = START, hostile: bool = False
) -> History:
    now = [start]
    cs = CheckpointStore(
        store=store, identity=identity, keep_last=20, lease_ttl=LEASE_TTL, clock=lambda: now[0]
    )
    parts = identity.task_parts or {}
    base = {"dag_id": parts.get("dag_id"), "task_id": parts.get("task_id"), "run_id": parts.get("scope")}
    files.mkdir(parents=True, exist_ok=True)
    items = 0

    def commit(lease: object, try_number: int, **kw: object) -> None:
        nonlocal items
        now[0] += STEP
        items += 100
        cs.commit(lease, {"items": items}, extra={"cursors": {"items": items}}, **kw)  # type: ignore[arg-type]

    one = cs.acquire(holder=WriterInfo(**base, try_number=1, host="worker-1", pid=101))
    for _ in range(4):
        commit(one, 1)
    now[0] += LEASE_TTL + 30  # try 1 was killed: its lease expired
    two = cs.acquire(holder=WriterInfo(**base, try_number=2, host="worker-2", pid=202))
    for n in range(3):
        if n == 2:
            (files / "summary.json").write_text('{"rows": 600}\n')
            staged = cs.stage_output(two, "summary.json", files / "summary.json")
            commit(two, 2, outputs={"summary.json": staged})
        else:
            commit(two, 2)
    now[0] += STEP
    cs.acquire(holder=WriterInfo(**base, try_number=3, host="worker-3", pid=303), steal=True)  # dies at once
    now[0] += STEP
    host, pod = (HOSTILE_HOST, HOSTILE_POD) if hostile else ("worker-4", "etl-enrich-try4")
    four = cs.acquire(
        holder=WriterInfo(**base, try_number=4, host=host, pod=pod, node="node-a", pid=404),
        steal=True,
        expected_interval=600.0,
    )
    acquired = now[0]
    for n in range(3):
        if n == 1:
            (files / "report.csv").write_text("id,value\n" + "".join(f"{i},{i * i}\n" for i in range(50)))
            staged = cs.stage_output(four, "report.csv", files / "report.csv")
            commit(four, 4, outputs={"report.csv": staged})
        else:
            commit(four, 4)
    head = cs.head()
    assert head is not None and head.lease is not None
    return History(
        identity=identity,
        last_commit=now[0],
        acquired=acquired,
        expires=now[0] + LEASE_TTL,
    )


def write_run(
    store: ObjectStore, dag_id: str, run_id: str, files: Path, *, now: float
) -> dict[str, Identity]:
    """A DAG run with one task instance in each status, as seen at ``now``; returns them by name.

    ``enrich``: :func:`write_history` (active; four tries); ``score`` mapped: [0] active, [1] stuck (renews its
    lease, commits nothing for 40 minutes against a declared 10), [2] dead (its lease expired 20 minutes ago);
    ``publish``: idle (finished, lease released); ``watermark``: named state whose lease holder works on this
    run; and, not of this run, ``load`` of another run and named state another run wrote last.
    """
    ids = {
        "enrich": Identity.for_task(dag_id=dag_id, task_id="enrich", run_id=run_id),
        "score-0": Identity.for_task(dag_id=dag_id, task_id="score", map_index=0, run_id=run_id),
        "score-1": Identity.for_task(dag_id=dag_id, task_id="score", map_index=1, run_id=run_id),
        "score-2": Identity.for_task(dag_id=dag_id, task_id="score", map_index=2, run_id=run_id),
        "publish": Identity.for_task(dag_id=dag_id, task_id="publish", run_id=run_id),
        "watermark": Identity.for_task(dag_id=dag_id, task_id="watermark", name="nightly"),
        "other-run": Identity.for_task(dag_id=dag_id, task_id="load", run_id="manual__other"),
        "other-named": Identity.for_task(dag_id=dag_id, task_id="watermark", name="weekly"),
    }
    write_history(store, ids["enrich"], files / "enrich", start=now - 1410)
    clock = [0.0]

    def at(identity: Identity, moment: float) -> CheckpointStore:
        clock[0] = moment
        return CheckpointStore(store=store, identity=identity, lease_ttl=LEASE_TTL, clock=lambda: clock[0])

    def holder(task: str, map_index: int = -1, run: str = run_id, try_number: int = 1) -> WriterInfo:
        return WriterInfo(
            dag_id=dag_id,
            task_id=task,
            run_id=run,
            map_index=map_index,
            try_number=try_number,
            host="worker-5",
        )

    lease = at(ids["score-0"], now - 300).acquire(holder=holder("score", 0), expected_interval=600)
    at(ids["score-0"], now - 120).commit(lease, 1, extra={"cursors": {"items": 50}})
    lease = at(ids["score-1"], now - 3000).acquire(holder=holder("score", 1), expected_interval=600)
    at(ids["score-1"], now - 2400).commit(lease, 1, extra={"cursors": {"items": 20}})
    at(ids["score-1"], now - 60).renew(lease)
    lease = at(ids["score-2"], now - 2000).acquire(holder=holder("score", 2, try_number=2))
    at(ids["score-2"], now - 1900).commit(lease, 1, extra={"cursors": {"items": 70}})
    publish = at(ids["publish"], now - 900)
    lease = publish.acquire(holder=holder("publish"))
    publish.commit(lease, {"done": True})
    publish.release(lease)
    lease = at(ids["watermark"], now - 200).acquire(holder=holder("watermark"))
    at(ids["watermark"], now - 100).commit(lease, {"watermark": "2027-01-14"})
    other = at(ids["other-run"], now - 5000)
    other.commit(other.acquire(holder=holder("load", run="manual__other")), 1)
    weekly = at(ids["other-named"], now - 4000)
    lease = weekly.acquire(holder=holder("watermark", run="manual__other"))
    weekly.commit(lease, 1)
    weekly.release(lease)
    return ids


def forge_head(store: ObjectStore, identity: Identity, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``identity``'s head as anyone who can write the bucket could: ``change`` edits the parsed JSON,
    and the (unkeyed) checksum is recomputed, so only the record's own checks can refuse it."""
    key = f"{identity.key}/{HEAD_NAME}"
    body = json.loads(store.get(key).data)
    body.pop("checksum")
    change(body)
    body["checksum"] = sha256_hex(canonical_json(body))
    store.put(key, canonical_json(body) + b"\n")
