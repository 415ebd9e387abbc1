"""The short kill -9 soak of ``make test`` (the long one is ``make soak``): see ``tests/soak/kill_soak.py``.

Real processes SIGKILLed at random moments (seeded) on the local store and on S3 over HTTP (a serialized moto
server on 127.0.0.1, and SeaweedFS, a real S3 server); after each kill a fresh reader must find the latest checkpoint whole and verified, not
older than the last acknowledged commit, with no missing reference; a killed restore must leave its
destination exactly as before (its extra file included) or complete (exactly the checkpoint's files). The last tests show that those checks do fail when what they
guard is broken (a lost acknowledged commit, a corrupt chunk, a destination left half restored, an exact
restore that kept a file the checkpoint does not have).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from s3_endpoint import both_servers_when_long, main_kind
from soak import kill_soak
from soak.kill_soak import Soak, Tally

from airflow_stateful.core import CheckpointStore
from airflow_stateful.core.data import restore as restore_module

pytestmark = pytest.mark.slow


def no_soak_children() -> list[str]:
    """Command lines of this process's children that are soak writers or restores still running."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "soak/writer.py" in cmdline:
            alive.append(cmdline[:200])
    return alive


def check(tally: Tally, *, kills: int, restore_kills: int) -> None:
    print(kill_soak.summary([tally]))
    assert tally.violations == []
    assert tally.kills >= kills
    assert tally.restore_kills == restore_kills, tally.restore_kills_skipped
    assert tally.reads_checked == tally.kills  # the first checkpoint goes in before the first kill
    assert tally.unexpected_exits == 0
    assert tally.commits_acknowledged > 0
    # The kills landed in several steps of a commit, not all in one (the aims and the random moments work).
    assert len(tally.faults) >= 3, tally.faults
    if restore_kills:
        assert tally.outcome_before + tally.outcome_complete == restore_kills
    assert no_soak_children() == []


def test_kill_soak_local() -> None:
    tally = kill_soak.run(store="local", kills=10, restore_kills=8, seed=14)
    check(tally, kills=10, restore_kills=8)


@pytest.mark.s3
@pytest.mark.parametrize("server", both_servers_when_long())
def test_kill_soak_s3(server: str) -> None:
    """On SeaweedFS, a real S3 server, and under ``make soak`` on the suite's main endpoint too (moto by
    default; ``make soak`` also runs the long soak there)."""
    tally = kill_soak.run(
        store="s3", kills=6, restore_kills=4, seed=15, s3_server_kind="env" if server == "main" else server
    )
    assert tally.store == f"s3 ({main_kind() if server == 'main' else server})"
    check(tally, kills=6, restore_kills=4)


# -- the checks can fail -----------------------------------------------------------------------------------
@pytest.fixture
def soak(tmp_path: Path) -> Iterator[Soak]:
    """A soak on the local store whose identity holds a few checkpoints (one writer round done)."""
    soak = Soak(store="local", seed=3, run_dir=tmp_path)
    try:
        soak.ensure_history(0)
        assert soak.tally.violations == []
        yield soak
    finally:
        soak.children.kill_all()
    assert no_soak_children() == []


def acks(soak: Soak) -> list[dict[str, Any]]:
    return soak.read_acks()


def test_the_reader_check_catches_a_lost_acknowledged_commit(soak: Soak) -> None:
    latest = max(a["seq"] for a in acks(soak))
    # A commit acknowledged in the log that the store does not have: as if the store had dropped it.
    fake = {**acks(soak)[-1], "seq": latest + 1, "counter": latest + 1, "commit_id": uuid.uuid4().hex}
    with open(soak.ack_log, "a") as f:
        f.write(json.dumps(fake) + "\n")
    soak.check_store("tampered", acks(soak))
    assert soak.tally.acknowledged_lost == 1
    assert any("acknowledged commit lost" in v for v in soak.tally.violations)


def test_the_reader_check_catches_a_corrupt_chunk(soak: Soak) -> None:
    with soak.open_store() as store:
        checkpoints = CheckpointStore(store=store, identity=soak.identity)
        latest = checkpoints.latest()
        assert latest is not None
        tree = checkpoints.tree(latest)
        assert tree is not None
        chunk = max((c for f in tree.files for c in f.chunks), key=lambda c: c.size)
    path = Path(soak.store_spec["root"]) / chunk.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit-flipped byte in the middle of the largest chunk
    path.write_bytes(bytes(data))
    soak.check_store("tampered", acks(soak))
    assert soak.tally.corrupt_or_partial_reads == 1
    assert any("corrupt or partial read" in v for v in soak.tally.violations)


def test_the_restore_check_catches_a_destination_left_half_restored(
    soak: Soak, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = restore_module.recover_interrupted

    def recover_then_lose_a_file(dest: str | Path) -> bool:
        found = real(dest)
        victim = Path(dest) / "model.bin"
        if victim.exists():  # a recovery that loses a file: neither as before nor complete
            victim.unlink()
        return found

    monkeypatch.setattr(restore_module, "recover_interrupted", recover_then_lose_a_file)
    soak.restore_round(0)
    assert soak.tally.outcome_mixed == 1
    assert any("neither as before nor complete" in v for v in soak.tally.violations)
    shutil.rmtree(soak.run_dir / "restore-0", ignore_errors=True)


def test_the_restore_check_catches_an_exact_restore_that_keeps_a_file_not_in_the_checkpoint(
    soak: Soak, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's restores are exact: one that left the user's extra file beside the checkpoint's (what a merge
    does) is a violation."""
    real = CheckpointStore.restore_files

    def merge_instead(self: CheckpointStore, manifest: Any, dest: Any, **kwargs: Any) -> Any:
        return real(self, manifest, dest, **{**kwargs, "mode": "merge"})

    monkeypatch.setattr(CheckpointStore, "restore_files", merge_instead)
    soak.restore_round(0)
    assert any("an uninterrupted restore" in v and kill_soak.USER_FILE in v for v in soak.tally.violations), (
        soak.tally.violations
    )
    shutil.rmtree(soak.run_dir / "restore-0", ignore_errors=True)
