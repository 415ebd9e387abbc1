"""Packs under faults: the ranged GETs of a packed restore broken by every fault the proxy knows, and a
commit's pack uploads broken too. Through the same fault proxy and judge as tests/test_s3_faults.py (real
boto3, moto's server over HTTP).

What users rely on: a restore returns exactly the checkpoint's files or raises a StatefulError naming what
failed and leaves the destination as it was; a commit whose pack upload failed leaves the previous checkpoint
readable and whole; never a wrong or partial read.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from maintenance import read_tree, tree
from s3_endpoint import S3Endpoint
from s3_fault_proxy import FAULTS, FaultSchedule, Rule
from test_s3_faults import SEED, Outcomes, restore_through_faults, rig

from airflow_stateful.core import CheckpointStore, Identity

pytestmark = [pytest.mark.s3, pytest.mark.slow]

IDENTITY = Identity.for_task(dag_id="faults", task_id="packs", run_id="manual__1")


def small_tree(root: Path, rng: random.Random, count: int = 400) -> Path:
    """A tree whose chunks all go into packs: about 4 MiB in one pack, read by one or two ranged GETs."""
    return tree(
        root, {f"p{n // 50}/f{n:04d}.bin": rng.randbytes(rng.randrange(1, 20_000)) for n in range(count)}
    )


@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_on_a_pack_range_read_gives_the_whole_checkpoint_or_a_clear_error(
    fault: str, s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    src = small_tree(tmp_path / "src", rng)
    outcomes = Outcomes()
    with rig(s3_endpoint, s3_prefix, FaultSchedule(seed=SEED)) as r:
        with r.quiet():
            writer = CheckpointStore(store=r.clean, identity=IDENTITY)
            lease = writer.acquire()
            manifest = writer.commit(lease, {"n": 1}, files=src)
            writer.release(lease)
        packs = {c.key for f in writer.tree(manifest).files for c in f.chunks}  # type: ignore[union-attr]
        assert len(packs) == 1 and all("/~packs/" in k for k in packs)
        # The faulty client gives up after two attempts: two faults in a row exhaust it, one is retried.
        for times in (1, 2):
            r.schedule.add(Rule(kind="get_object", fault=fault, times=times, key_suffix="-000000"))
            dest = tmp_path / f"out-{times}"
            dest.mkdir()
            reader = CheckpointStore(store=r.faulty, identity=IDENTITY)
            restore_through_faults(
                r, reader, manifest, dest, read_tree(src), outcomes, what=f"{fault} x{times} on a pack range"
            )
            assert not r.schedule.pending_rules(), (
                f"{fault} x{times}: the pack's range GET never met the fault"
            )
    assert not outcomes.violations, "\n".join(outcomes.violations)
    assert outcomes.restores["restored"] >= 1, f"{fault}: one fault on a range read is retried: {outcomes}"


def test_seeded_faults_on_packed_saves_and_restores(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """Twenty rounds of save-then-restore of a changing tree of small files, with faults on a fifth of the
    pack uploads and range reads: every save is all or nothing, every restore whole or refused."""
    rng = random.Random(SEED + 32)
    schedule = FaultSchedule(seed=SEED, rates={"get_object": 0.2, "put_conditional": 0.2})
    outcomes = Outcomes()
    with rig(s3_endpoint, s3_prefix, schedule) as r:
        cs = CheckpointStore(store=r.faulty, identity=IDENTITY)
        with r.quiet():
            lease = cs.acquire()
        src = small_tree(tmp_path / "src", rng, count=200)
        committed = None
        for round_ in range(20):
            for path in rng.sample(sorted(src.rglob("*.bin")), 10):
                path.write_bytes(rng.randbytes(rng.randrange(1, 20_000)))
            expected = read_tree(src)
            try:
                committed = cs.commit(lease, {"round": round_}, files=src)
                outcomes.commits["committed"] += 1
                committed_files = expected
            except Exception as exc:
                outcomes.commits[outcomes.error(f"round {round_}, commit", exc, where=r.clean.url)] += 1
                with r.quiet():
                    lease = cs.acquire(steal=True)  # a lost head answer may have fenced us: start again
            if committed is None:
                continue
            judge = CheckpointStore(store=r.clean, identity=IDENTITY).latest()
            assert judge is not None
            if judge.commit_id != committed.commit_id:
                continue  # the last commit failed: the judge's latest is an earlier one, checked then
            dest = tmp_path / f"out-{round_}"
            dest.mkdir()
            reader = CheckpointStore(store=r.faulty, identity=IDENTITY)
            restore_through_faults(
                r, reader, committed, dest, committed_files, outcomes, what=f"round {round_}"
            )
        stats = r.proxy.stats
    report = f"seed {SEED}: commits {dict(outcomes.commits)}, restores {dict(outcomes.restores)}, {stats.by_request_kind()}"
    print(report)
    assert not outcomes.violations, report + "\n" + "\n".join(outcomes.violations)
    assert outcomes.restores["restored"] >= 3 and outcomes.commits["committed"] >= 3, report
