"""A rollback leaves a trace (issue 33, point 6): the copy's manifest names its original (``copy_of``), and
``history``, ``show`` and the Checkpoints tab say ``copy of seq N``, even once retention dropped the original.

The command is the real console script in a process of its own (what the user sees is the point), on a local
``file://`` store; the tab is the view's FastAPI app driven in-process, authenticated as Airflow authenticates.
The lineage is read from storage, so a malformed one is refused by name, never shown as something it is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from checkpoint_history import forge_head
from fastapi.testclient import TestClient

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.formats import PLAIN_FORMAT
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.plugins.view.app import create_app

SCRIPT = str(Path(sys.executable).parent / "airflow-stateful")
RUN = "scheduled__2027-01-15T08:00:00+00:00"
IDENTITY = Identity.for_task(dag_id="etl", task_id="enrich", run_id=RUN)


def stateful(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``airflow-stateful ARGS --backend BACKEND``, as a user runs it."""
    return subprocess.run(
        [SCRIPT, *args, "--backend", backend],
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ.copy(),
    )


def three_checkpoints(root: Path) -> tuple[CheckpointStore, list[Manifest]]:
    """Checkpoints 1 to 3, kept as the CLI keeps them (the default: the newest 3)."""
    cs = CheckpointStore(store=LocalObjectStore(root=root, fsync=False), identity=IDENTITY)
    lease = cs.acquire(holder=WriterInfo(run_id=RUN, try_number=1))
    made = [cs.commit(lease, {"n": n}, extra={"cursors": {"items": n * 10}}) for n in (1, 2, 3)]
    cs.release(lease)
    return cs, made


@pytest.fixture(scope="module")
def admin(airflow_home: Path) -> dict[str, str]:
    from airflow.api_fastapi.app import init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = init_auth_manager().generate_jwt(SimpleAuthManagerUser(username="admin", role="admin"))
    return {"Authorization": f"Bearer {token}"}


def tab(cs: CheckpointStore, headers: dict[str, str], *, api: bool) -> Any:
    """The task instance's Checkpoints tab (its JSON answer with ``api``)."""
    view = TestClient(create_app(cs.store), headers=headers)
    parts = IDENTITY.task_parts
    assert parts is not None
    path = "/".join(quote(str(parts[k]), safe="") for k in ("dag_id", "scope", "task_id"))
    answer = view.get(f"{'/api' if api else ''}/ti/{path}?map_index=-1")
    assert answer.status_code == 200, answer.text[:300]
    return answer.json() if api else answer.text


def test_history_show_json_and_the_tab_say_the_rolled_back_head_is_a_copy_of_seq_2(
    tmp_path: Path, admin: dict[str, str]
) -> None:
    cs, (_, second, _) = three_checkpoints(tmp_path / "state")
    backend = (tmp_path / "state").as_uri()
    rolled = stateful(backend, "rollback", "--to", "2", IDENTITY.key, "--json")
    assert rolled.returncode == 0, rolled.stderr
    assert json.loads(rolled.stdout) == [{"identity": IDENTITY.key, "seq": 4, "copy_of": 2}]
    copy = cs.latest()
    assert copy is not None and copy.seq == 4 and copy.value == {"n": 2}
    assert copy.copy_of is not None and (copy.copy_of.seq, copy.copy_of.commit_id) == (2, second.commit_id)
    assert copy.extra == second.extra, "the original's metadata, without an untyped mark of its own"
    assert copy.format == PLAIN_FORMAT, "an optional field older readers ignore: no format bump"

    table = stateful(backend, "history", IDENTITY.key)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert "COPY_OF" in header.split()
    by_seq = {line.split()[0]: line for line in lines}
    assert "copy of seq 2" in by_seq["4"]
    assert sorted(by_seq) == ["2", "3", "4"], "the CLI keeps 3: the copy made seq 1 go"
    assert all("copy of" not in by_seq[seq] for seq in ("2", "3"))

    rows = json.loads(stateful(backend, "history", IDENTITY.key, "--json").stdout)
    assert {r["seq"]: r["copy_of"] for r in rows} == {
        2: None,
        3: None,
        4: {"seq": 2, "commit_id": second.commit_id, "kept": True},
    }

    shown = stateful(backend, "show", IDENTITY.key)
    assert shown.returncode == 0 and "lineage:   copy of seq 2\n" in shown.stdout, shown.stdout
    latest = json.loads(stateful(backend, "show", IDENTITY.key, "--json").stdout)["latest"]
    assert latest["seq"] == 4 and latest["copy_of"] == {"seq": 2, "commit_id": second.commit_id, "kept": True}

    answer = tab(cs, admin, api=True)
    (ident,) = answer["identities"]
    assert {r["seq"]: r["copy_of"] for r in ident["checkpoints"]} == {
        4: {"seq": 2, "commit_id": second.commit_id},
        3: None,
        2: None,
    }
    page = tab(cs, admin, api=False)
    assert page.count(">copy of seq 2</span>") == 1
    assert f'title="committed again from commit {second.commit_id}"' in page


def test_the_lineage_names_seq_and_commit_id_after_retention_dropped_the_original(
    tmp_path: Path, admin: dict[str, str]
) -> None:
    """The copy is the newest, so the original is an old checkpoint like any other: rolling back to the oldest
    kept one evicts it in the same commit (the CLI keeps 3). The copy still says which commit its state came
    from, and a commit after it changes nothing of that."""
    cs, (first, _, _) = three_checkpoints(tmp_path / "state")
    backend = (tmp_path / "state").as_uri()
    assert stateful(backend, "rollback", "--to", "1", IDENTITY.key).returncode == 0
    lease = cs.acquire(holder=WriterInfo(run_id=RUN, try_number=2))
    cs.commit(lease, {"n": 5})
    cs.release(lease)
    head = cs.head()
    assert head is not None and [e.seq for e in head.checkpoints] == [3, 4, 5]

    table = stateful(backend, "history", IDENTITY.key)
    assert table.returncode == 0, table.stderr
    (line,) = [line for line in table.stdout.splitlines() if line.split()[0] == "4"]
    assert f"copy of seq 1 (no longer kept, commit {first.commit_id})" in line
    rows = {r["seq"]: r for r in json.loads(stateful(backend, "history", IDENTITY.key, "--json").stdout)}
    assert rows[4]["copy_of"] == {"seq": 1, "commit_id": first.commit_id, "kept": False}
    assert rows[5]["copy_of"] is None, "a commit after the copy is no copy"
    page = tab(cs, admin, api=False)
    assert f'title="committed again from commit {first.commit_id}; no longer kept"' in page


BAD_LINEAGE = [
    pytest.param("2", "'copy_of' must be a JSON object", id="not-an-object"),
    pytest.param({"commit_id": "0" * 32}, "field 'seq' must be an integer", id="no-seq"),
    pytest.param({"seq": True, "commit_id": "0" * 32}, "field 'seq' must be an integer", id="bool-seq"),
    pytest.param({"seq": "2", "commit_id": "0" * 32}, "field 'seq' must be an integer", id="text-seq"),
    pytest.param({"seq": 2}, "field 'commit_id' must be a string", id="no-commit-id"),
    pytest.param(
        {"seq": 2, "commit_id": "<script>alert(1)</script>" + "x" * 2000},
        "field 'commit_id' must be a string of at most 32",
        id="hostile-commit-id",
    ),
    pytest.param(
        {"seq": 3, "commit_id": "0" * 32}, "a copy is always newer than what it copies", id="itself"
    ),
    pytest.param({"seq": 9, "commit_id": "0" * 32}, "a copy is always newer than what it copies", id="later"),
]


@pytest.mark.parametrize(("lineage", "message"), BAD_LINEAGE)
def test_a_malformed_lineage_is_refused_by_name_in_the_cli_and_the_tab(
    tmp_path: Path, admin: dict[str, str], lineage: Any, message: str
) -> None:
    """A head rewritten by anyone who can write the bucket: the newest checkpoint's (inline) manifest gets a
    ``copy_of`` this library never writes. Every reader refuses the record, naming it and the field; the tab
    shows the error as text, in the identity's own section."""
    cs, _ = three_checkpoints(tmp_path / "state")

    def forged(body: dict[str, Any]) -> None:
        body["checkpoints"][-1]["inline"]["copy_of"] = lineage

    forge_head(cs.store, IDENTITY, forged)
    backend = (tmp_path / "state").as_uri()
    for verb in ("history", "show"):
        done = stateful(backend, verb, IDENTITY.key)
        assert done.returncode == 1 and done.stdout == "", (verb, done.stdout)
        assert "checkpoint 2 inline manifest" in done.stderr and "copy_of" in done.stderr, done.stderr
        assert message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    with pytest.raises(CheckpointCorruptError, match="copy_of"):
        cs.latest()
    page = tab(cs, admin, api=False)
    assert "CheckpointCorruptError" in page and "copy_of" in page
    assert "<script" not in page.lower()
