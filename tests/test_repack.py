"""Repacking (issue 32): GC rewrites a mostly-dead pack's live chunks into a new pack, swaps the kept
checkpoints to name the copies in one fenced head write, and deletes the old pack; every kept checkpoint then
restores byte for byte as before. SIGKILLs at every step of a repack, a save of packs and a restore of packs
lose nothing and leave only garbage the next GC pass removes.

Run on the local store and on SeaweedFS (a real S3 server the suite starts from the package index); the kill
tests kill a real process (tests/pack_victim.py) on the local store, at each of its store writes in turn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from maintenance import missing_references, read_tree, tree
from test_cli import backend, cli, open_cs  # noqa: F401 - `backend` is a fixture used by the CLI tests
from test_packs import commit as commit_manifest
from test_packs import store  # noqa: F401 - the fixture: the local store, and SeaweedFS

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.fleet.gc import REPACK, apply_gc, plan_gc
from airflow_stateful.core.protocol.retention import references, unreferenced
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

KIB = 1024
HERE = Path(__file__).parent
VICTIM_IDENTITY = Identity.for_task(
    dag_id="packs", task_id="kill", run_id="manual__2026-12-06T20:00:00+00:00"
)
IDENTITY = Identity.for_task(dag_id="parts", task_id="repack", run_id="manual__2026-12-06T12:00:00+00:00")
BALLAST = ["x" * 100] * 200  # a value whose manifest is too big to ride inline in the head: an object


@dataclass
class History:
    """Three checkpoints of 200 small files: the first's pack is 3/4 dead once only the last two are kept."""

    files: dict[int, dict[str, bytes]]  # seq -> the files it saved
    values: dict[int, Any]
    src: Path


def commit(cs: CheckpointStore, files: Path, value: Any) -> int:
    return int(commit_manifest(cs, files, value).seq)


def rewrite(src: Path, count: int) -> None:
    for path in sorted(src.rglob("*.bin"))[:count]:
        path.write_bytes(os.urandom(4 * KIB))


def history(cs: CheckpointStore, root: Path) -> History:
    src = tree(root / "src", {f"part={n // 100:03d}/f{n:05d}.bin": os.urandom(4 * KIB) for n in range(200)})
    h = History(files={}, values={}, src=src)
    for value, changed in (({"n": 1}, 0), ({"n": 2, "ballast": BALLAST}, 150), ({"n": 3}, 150)):
        rewrite(src, changed)
        seq = commit(cs, src, value)
        h.files[seq], h.values[seq] = read_tree(src), value
    return h


def identity_keys(where: ObjectStore, identity: Identity, folder: str) -> set[str]:
    return {i.key for i in where.list_objects(f"{identity.key}/{folder}/")}


def check_restores(where: ObjectStore, identity: Identity, h: History, out: Path, seqs: list[int]) -> None:
    """A fresh reader restores each checkpoint of ``seqs`` byte for byte, with its value."""
    reader = CheckpointStore(store=where, identity=identity)
    assert sorted(e.seq for e in reader.history()) == seqs
    for seq in seqs:
        manifest = reader.get(seq)
        assert manifest.value == h.values[seq], seq
        dest = out / f"restored-{seq}-{os.urandom(4).hex()}"
        reader.restore_files(manifest, dest)
        assert read_tree(dest) == h.files[seq], f"checkpoint {seq} restored other bytes"


def leftovers(where: ObjectStore, identity: Identity) -> list[str]:
    cs = CheckpointStore(store=where, identity=identity)
    head = cs.head()
    infos = list(where.list_objects(f"{identity.key}/"))
    return sorted(
        i.key
        for i in unreferenced(identity.key, infos, head, refs=references(head, trees=cs.content.tree_of))
    )


def gc(where: ObjectStore, *, keep_last: int | None = 2) -> Any:
    plan = plan_gc(where, min_age=timedelta(0), grace=0.0, keep_last=keep_last, expired_state=False)
    return plan, apply_gc(plan)


def test_gc_repacks_a_mostly_dead_pack_and_every_kept_checkpoint_restores_as_before(
    store: ObjectStore,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    h = history(cs, tmp_path)
    first_pack = {c.key for f in cs.tree(cs.get(1)).files for c in f.chunks}  # type: ignore[union-attr]
    old_trees = identity_keys(store, IDENTITY, "~trees")
    old_manifests = identity_keys(store, IDENTITY, "~manifests")
    assert len(old_manifests) == 1, (
        "checkpoint 2's value is too big to ride inline: its manifest is an object"
    )

    plan, result = gc(store)
    [item] = [p for p in plan.identities if p.identity == IDENTITY.key]
    assert item.repack is not None and set(item.repack.packs) == first_pack, item.reasons
    assert (item.repack.live_bytes, item.repack.dead_bytes) == (50 * 4 * KIB, 150 * 4 * KIB)
    assert result.skipped == {}, result.skipped

    packs = identity_keys(store, IDENTITY, "~packs")
    assert not packs & first_pack, "the mostly-dead pack is deleted"
    assert len(packs) == 3, "checkpoint 2's pack, checkpoint 3's, and the repacked live quarter of the first"
    sizes = sorted(i.size for i in store.list_objects(f"{IDENTITY.key}/~packs/"))
    assert sizes == [50 * 4 * KIB, 150 * 4 * KIB, 150 * 4 * KIB], sizes
    assert not identity_keys(store, IDENTITY, "~trees") & old_trees, "both kept trees were written again"
    assert not identity_keys(store, IDENTITY, "~manifests") & old_manifests, "and checkpoint 2's manifest"
    assert leftovers(store, IDENTITY) == [] and missing_references(store, IDENTITY) == []
    check_restores(store, IDENTITY, h, tmp_path, [2, 3])

    # A re-save deduplicates against the repacked trees: one new pack with the one changed file.
    rewrite(h.src, 1)
    writer = CheckpointStore(store=store, identity=IDENTITY)
    seq = commit(writer, h.src, {"n": 4})
    new = identity_keys(store, IDENTITY, "~packs") - packs
    assert len(new) == 1 and [i.size for i in store.list_objects(next(iter(new)))] == [4 * KIB]
    h.files[seq], h.values[seq] = read_tree(h.src), {"n": 4}
    check_restores(store, IDENTITY, h, tmp_path, [2, 3, 4])

    plan, _ = gc(store)
    assert all(REPACK not in p.reasons for p in plan.identities), "nothing is mostly dead any more"


def test_gc_dry_run_shows_the_repack_and_a_real_pass_does_what_it_showed(
    backend: str,  # noqa: F811 - the fixture imported above
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    cs = open_cs(backend, IDENTITY)
    history(cs, tmp_path)
    code, out, _ = cli(capsys, backend, "gc", "--dry-run", "--keep-last", "2", "--min-age", "0s", "--json")
    assert code == 0, out
    [planned] = [r for r in json.loads(out) if r["identity"] == IDENTITY.key]
    assert "repack" in planned["reasons"].split(","), planned
    assert (planned["repacked_packs"], planned["repack_copied_bytes"]) == (1, 50 * 4 * KIB), planned
    # After the pass: the packs of checkpoints 2 and 3, and the new one; no dead byte left in any.
    assert (planned["packs"], planned["pack_bytes"], planned["dead_pack_bytes"]) == (3, 350 * 4 * KIB, 0)
    before = identity_keys(cs.store, IDENTITY, "~packs")
    assert len(before) == 3, "a dry run changes nothing: the packs of checkpoints 1, 2 and 3 are all there"

    code, out, _ = cli(capsys, backend, "gc", "--keep-last", "2", "--min-age", "0s", "--json")
    assert code == 0, out
    [done] = [r for r in json.loads(out) if r["identity"] == IDENTITY.key]
    assert done["action"] == "deleted" and set(done["keys"]) == set(planned["keys"]), done
    assert {k: done[k] for k in ("packs", "pack_bytes", "dead_pack_bytes")} == {
        k: planned[k] for k in ("packs", "pack_bytes", "dead_pack_bytes")
    }
    packs = sorted(i.size for i in cs.store.list_objects(f"{IDENTITY.key}/~packs/"))
    assert packs == [50 * 4 * KIB, 150 * 4 * KIB, 150 * 4 * KIB]
    code, out, _ = cli(capsys, backend, "du", "--packs", "--json")
    assert json.loads(out)[0]["dead_pack_bytes"] == 0


def test_a_corrupt_chunk_stops_the_repack_and_changes_nothing(
    store: ObjectStore,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    cs = CheckpointStore(store=store, identity=IDENTITY)
    h = history(cs, tmp_path)
    tree2 = cs.tree(cs.get(2))
    assert tree2 is not None
    [victim] = next(f for f in tree2.files if f.path.endswith("f00199.bin")).chunks  # still in the first pack
    data = bytearray(store.get(victim.key).data)
    data[(victim.offset or 0) + 7] ^= 0x01
    store.put(victim.key, bytes(data))
    before = {i.key for i in store.list_objects(f"{IDENTITY.key}/")}

    plan, result = gc(store)
    assert "corrupt" in result.skipped[IDENTITY.key] and victim.sha256 in result.skipped[IDENTITY.key]
    head = CheckpointStore(store=store, identity=IDENTITY).head()
    assert head is not None and [e.seq for e in head.checkpoints] == [2, 3], "retention itself went through"
    after = {i.key for i in store.list_objects(f"{IDENTITY.key}/")}
    assert victim.key in after, "the damaged pack is kept: the checkpoints that name it still do"
    # Nothing the repack wrote is named: the new pack and trees are garbage that a later pass takes (min age).
    assert missing_references(store, IDENTITY) == []
    assert head.checkpoints == plan.identities[0].head.checkpoints[1:], "the kept entries are not swapped"  # type: ignore[union-attr]
    assert not [k for k in after - before if "/~manifests/" in k or "/~trees/" in k], (
        "stopped before any tree"
    )
    reader = CheckpointStore(store=store, identity=IDENTITY)
    with pytest.raises(CheckpointCorruptError, match=victim.sha256):
        reader.restore_files(reader.get(3), tmp_path / "out")
    del h


def test_a_writer_that_takes_the_lease_mid_repack_wins_and_nothing_is_lost(
    store: ObjectStore,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """The repack's head write is fenced: a writer that commits while the new pack is being written makes the
    swap fail; its checkpoint stands, and what the repack wrote is garbage."""
    cs = CheckpointStore(store=store, identity=IDENTITY)
    h = history(cs, tmp_path)
    plan = plan_gc(store, min_age=timedelta(0), grace=0.0, keep_last=2, expired_state=False)
    put = store.put
    raced: list[int] = []

    def racing_put(key: str, data: bytes, **kwargs: Any) -> str:
        if "/~trees/" in key and not raced:  # the repack's first tree: its pack is written, the head not yet
            raced.append(0)  # the writer's own tree write passes through here too
            rewrite(h.src, 5)
            raced[0] = commit(CheckpointStore(store=store, identity=IDENTITY), h.src, {"n": "writer"})
            h.files[raced[0]], h.values[raced[0]] = read_tree(h.src), {"n": "writer"}
        return put(key, data, **kwargs)

    store.put = racing_put  # type: ignore[method-assign]
    try:
        result = apply_gc(plan)
    finally:
        store.put = put  # type: ignore[method-assign]
    assert raced, "the writer ran while the repack was in flight"
    assert "not repacked" in result.skipped[IDENTITY.key], result.skipped
    check_restores(store, IDENTITY, h, tmp_path, [2, 3, raced[0]])
    assert missing_references(store, IDENTITY) == []
    # The next pass (the writer gone) repacks from the head as it is now.
    _, result = gc(store, keep_last=3)
    assert result.skipped == {}
    assert leftovers(store, IDENTITY) == [] and missing_references(store, IDENTITY) == []
    check_restores(store, IDENTITY, h, tmp_path, [2, 3, raced[0]])


# -- SIGKILL at every step ------------------------------------------------------------------------------------
def victim(mode: str, root: Path, arg: str, kill_at: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "pack_victim.py"), mode, str(root), arg, kill_at],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )


def steps_of(mode: str, root: Path, arg: str) -> int:
    """How many kill points a run has: a dry copy runs to the end and counts them."""
    dry = root.with_name(root.name + "-count")
    shutil.copytree(root, dry)
    done = victim(mode, dry, arg if mode != "restore" else str(dry / "out"), "-")
    assert done.returncode == 0, done.stderr
    shutil.rmtree(dry)
    return int(done.stdout.splitlines()[0].removeprefix("steps="))


def kill_points(count: int) -> list[str]:
    return ["before:0", *(f"after:{n}" for n in range(count))]


def killed_runs(mode: str, root: Path, arg: str, *, min_steps: int) -> Iterator[tuple[str, Path]]:
    """At each kill point of a run in turn: a copy of the store that a process was SIGKILLed in at that point
    (the last point, after the last step, is a whole run: left out)."""
    count = steps_of(mode, root, arg)
    assert count >= min_steps, f"{mode}: {count} steps"
    for point in kill_points(count)[:-1]:
        run = root.with_name(f"kill-{mode}-{point.replace(':', '-')}")
        shutil.copytree(root, run)
        killed = victim(mode, run, arg, point)
        assert killed.returncode == -9, (point, killed.stdout, killed.stderr)
        yield point, run
        shutil.rmtree(run)


def test_sigkill_at_every_step_of_a_repack_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "state"
    with LocalObjectStore(root=root) as local:
        cs = CheckpointStore(store=local, identity=VICTIM_IDENTITY)
        h = history(cs, tmp_path)
        first_pack = {c.key for f in cs.tree(cs.get(1)).files for c in f.chunks}  # type: ignore[union-attr]
    # A repack writes a pack, two trees, a manifest and the head, then deletes (after retention's head write).
    for point, run in killed_runs("gc", root, "2", min_steps=6):
        with LocalObjectStore(root=run) as local:
            seqs = sorted(e.seq for e in CheckpointStore(store=local, identity=VICTIM_IDENTITY).history())
            assert seqs in ([1, 2, 3], [2, 3]), (point, seqs)
            assert missing_references(local, VICTIM_IDENTITY) == [], point
            check_restores(local, VICTIM_IDENTITY, h, run, seqs)
            _, result = gc(local)  # the next pass finishes the job and leaves no garbage
            assert result.skipped == {}, (point, result.skipped)
            assert leftovers(local, VICTIM_IDENTITY) == [], point
            assert not identity_keys(local, VICTIM_IDENTITY, "~packs") & first_pack, point
            check_restores(local, VICTIM_IDENTITY, h, run, [2, 3])


def test_sigkill_at_every_step_of_a_save_of_packs_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "state"
    with LocalObjectStore(root=root) as local:
        h = history(CheckpointStore(store=local, identity=VICTIM_IDENTITY), tmp_path)
    # 2,400 files of 4 KiB more: two packs of new chunks, then the tree and the head.
    (h.src / "more").mkdir()
    for n in range(2400):
        (h.src / "more" / f"m{n:05d}.bin").write_bytes(os.urandom(4 * KIB))
    for point, run in killed_runs("save", root, str(h.src), min_steps=4):
        with LocalObjectStore(root=run) as local:
            reader = CheckpointStore(store=local, identity=VICTIM_IDENTITY)
            seqs = sorted(e.seq for e in reader.history())
            if seqs == [2, 3, 4]:  # killed after the head write: the save is whole (keep_last 3)
                h.files[4], h.values[4] = read_tree(h.src), {"saved": str(h.src)}
            else:
                assert seqs == [1, 2, 3], (point, seqs)
            assert missing_references(local, VICTIM_IDENTITY) == [], point
            check_restores(local, VICTIM_IDENTITY, h, run, seqs)
            # The killed writer's lease stands until its ttl runs out (GC never breaks a live one); as a retry
            # or `airflow-stateful unlock --force` would, break it: then what the writer left is GC's.
            reader.break_lease()
            gc(local, keep_last=None)
            assert leftovers(local, VICTIM_IDENTITY) == [], point
            check_restores(local, VICTIM_IDENTITY, h, run, seqs)


def test_sigkill_at_every_ranged_get_of_a_restore_leaves_the_directory_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "state"
    with LocalObjectStore(root=root) as local:
        h = history(CheckpointStore(store=local, identity=VICTIM_IDENTITY), tmp_path)
    count = steps_of("restore", root, "")
    assert count >= 2, "the newest checkpoint's chunks live in more than one pack"
    for point in kill_points(count)[:-1]:  # the store is only read: one copy serves every kill
        dest = tmp_path / f"dest-{point.replace(':', '-')}"
        dest.mkdir()
        killed = victim("restore", root, str(dest), point)
        assert killed.returncode == -9, (point, killed.stdout, killed.stderr)
        rels = (p.relative_to(dest) for p in dest.rglob("*") if p.is_file())
        visible = {r.as_posix() for r in rels if not any(part.startswith(".") for part in r.parts)}
        assert visible <= set(h.files[3]), point
        for name in visible:
            assert (dest / name).read_bytes() == h.files[3][name], f"{point}: {name} holds other bytes"
        done = victim("restore", root, str(dest), "-")  # the next restore finishes or undoes, then restores
        assert done.returncode == 0, done.stderr
        assert read_tree(dest) == h.files[3], point
        shutil.rmtree(dest)
