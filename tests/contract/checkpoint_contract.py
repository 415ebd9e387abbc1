"""The commit protocol's contract, run on every store: atomic visibility, checksums, fencing, leases,
retention, and a crash injected at every step of a commit. Subclasses provide a ``store`` fixture."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from maintenance import read_tree, tree

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, collect_garbage
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    FencedError,
    FormatVersionError,
    InvalidValueError,
    LeaseHeldError,
)
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.canonical import canonical_json, sha256_hex
from airflow_stateful.core.records.formats import FORMAT_VERSION, HEAD_NAME, PACKS_FORMAT
from airflow_stateful.core.stores.base import ObjectStore
from contract.faults import CrashingStore, FakeClock, SimulatedCrash

IDENTITY = Identity.for_task(dag_id="etl", task_id="enrich", run_id="manual__2026-11-30T08:00:00+00:00")
MIB = 1024 * 1024


def make(store: ObjectStore, **kwargs: Any) -> CheckpointStore:
    kwargs.setdefault("identity", IDENTITY)
    return CheckpointStore(store=store, **kwargs)


def objects(store: ObjectStore, identity: Identity = IDENTITY) -> set[str]:
    return {info.key for info in store.list_objects(f"{identity.key}/")}


def referenced(cs: CheckpointStore) -> set[str]:
    """Exactly the objects the head makes reachable: the head, each kept manifest object, tree and chunk."""
    keys = {f"{cs.identity.key}/{HEAD_NAME}"}
    for entry in cs.history():
        manifest = cs.get(entry.seq)
        if entry.manifest is not None:
            keys.add(entry.manifest)
        if manifest.tree is not None:
            keys.add(manifest.tree.key)
        keys.update(key for f in cs.files(manifest) for key in f.keys)
    return keys


class CheckpointStoreContract:
    atomic_cas = True

    # -- commit and read -----------------------------------------------------------------------------------
    def test_nothing_committed_reads_as_none(self, store: ObjectStore) -> None:
        cs = make(store)
        assert cs.latest() is None
        assert cs.history() == []

    def test_commit_value_files_and_metadata_round_trip(self, store: ObjectStore, tmp_path: Path) -> None:
        cs = make(store)
        writer = WriterInfo.current(dag_id="etl", run_id="r1", try_number=2, dag_version_id="v-123")
        lease = cs.acquire(holder=writer)
        files = tree(tmp_path / "src", {"a.txt": b"alpha", "sub/b.bin": bytes(range(256)) * 10, "empty": b""})
        committed = cs.commit(lease, {"next": 30, "rows": ["x", "y"]}, files=files, schema_version=2)

        latest = make(store).latest()
        assert latest is not None
        assert latest.seq == committed.seq == 1
        assert latest.value == {"next": 30, "rows": ["x", "y"]}
        assert latest.schema_version == 2
        assert latest.format == PACKS_FORMAT and latest.library_version  # small files: packed
        assert (latest.writer.try_number, latest.writer.dag_version_id, latest.writer.host) == (
            2,
            "v-123",
            writer.host,
        )
        assert {f.path: f.size for f in make(store).files(latest)} == {
            "a.txt": 5,
            "empty": 0,
            "sub/b.bin": 2560,
        }
        # Content-addressed: each chunk is recorded by its SHA-256; small ones share one pack object.
        chunks = [c for f in make(store).tree(latest).files for c in f.chunks]  # type: ignore[union-attr]
        for path in ("a.txt", "sub/b.bin"):
            assert hashlib.sha256((files / path).read_bytes()).hexdigest() in {c.sha256 for c in chunks}
        assert {c.key for c in chunks} == {f"{IDENTITY.key}/~packs/{committed.commit_id}-000000"}
        assert all(c.packed for c in chunks)
        restored = tmp_path / "restored"
        make(store).restore_files(latest, restored)
        assert read_tree(restored) == read_tree(files)

    def test_single_file_checkpoint_restores_under_its_name(self, store: ObjectStore, tmp_path: Path) -> None:
        cs = make(store)
        lease = cs.acquire()
        (tmp_path / "weights.bin").write_bytes(b"w" * 1000)
        cs.commit(lease, {"epoch": 3}, files=tmp_path / "weights.bin")
        out = tmp_path / "out"
        latest = cs.latest()
        assert latest is not None
        cs.restore_files(latest, out)
        assert (out / "weights.bin").read_bytes() == b"w" * 1000

    def test_sequence_numbers_increase_and_history_is_newest_first(self, store: ObjectStore) -> None:
        cs = make(store, keep_last=10)
        lease = cs.acquire()
        for i in range(4):
            assert cs.commit(lease, {"i": i}).seq == i + 1
        assert [e.seq for e in cs.history()] == [4, 3, 2, 1]
        assert cs.get(2).value == {"i": 1}
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint 9"):
            cs.get(9)

    # -- bad input fails before anything is written ---------------------------------------------------------
    @pytest.mark.parametrize(
        ("value", "kwargs", "match"),
        [
            ({"x": {1, 2}}, {}, "not JSON-serializable"),
            ({"x": float("nan")}, {}, "not JSON-serializable"),
            ({"x": 1}, {"schema_version": 0}, "schema_version must be an integer >= 1, not 0"),
            ({"x": 1}, {"files": "/definitely/not/here"}, "/definitely/not/here"),
        ],
    )
    def test_bad_input_is_rejected_before_any_write(
        self, store: ObjectStore, value: Any, kwargs: dict[str, Any], match: str
    ) -> None:
        cs = make(store)
        lease = cs.acquire()
        before = {i.key: i.size for i in store.list_objects("")}
        with pytest.raises(InvalidValueError, match=match):
            cs.commit(lease, value, **kwargs)
        assert {i.key: i.size for i in store.list_objects("")} == before

    # -- checksums -----------------------------------------------------------------------------------------
    def test_a_value_changed_after_its_commit_never_changes_the_checkpoint(self, store: ObjectStore) -> None:
        """Inline manifests live in the head this process caches: the caller's objects must not alias them."""
        cs = make(store, keep_last=5)
        lease = cs.acquire()
        value = {"rows": [1, 2]}
        cs.commit(lease, value)
        value["rows"].append(3)  # the task goes on mutating its own dict
        read = cs.get(1)
        read.value["rows"].append(99)  # and whoever reads may mutate what it got (a migration does)
        cs.commit(lease, {"rows": "next"})  # written from the cached head: must carry the original entry
        assert make(store).get(1).value == {"rows": [1, 2]}

    def test_corrupt_manifest_is_named_and_never_returned(self, store: ObjectStore) -> None:
        cs = make(store)
        lease = cs.acquire()
        cs.commit(lease, {"balance": 100, "ledger": ["x" * 100] * 100})  # too big to ride inline: an object
        entry = cs.history()[0]
        assert entry.manifest is not None
        body = store.get(entry.manifest).data
        store.put(entry.manifest, body.replace(b'"balance":100', b'"balance":999'))
        with pytest.raises(CheckpointCorruptError, match=entry.manifest):
            cs.latest()

    def test_corrupt_file_is_named_and_destination_left_untouched(
        self, store: ObjectStore, tmp_path: Path
    ) -> None:
        cs = make(store)
        lease = cs.acquire()
        cs.commit(lease, {}, files=tree(tmp_path / "src", {"a": b"good a", "b": b"good b"}))
        manifest = cs.latest()
        assert manifest is not None
        victim = make(store).files(manifest)[1].keys[0]
        store.put(victim, b"evil b")
        dest = tree(tmp_path / "dest", {"a": b"previous a"})
        with pytest.raises(CheckpointCorruptError, match=victim):
            cs.restore_files(manifest, dest)
        assert read_tree(dest) == {"a": b"previous a"}, "a failed restore must not change the destination"

    def test_corrupt_head_is_detected(self, store: ObjectStore) -> None:
        cs = make(store)
        cs.commit(cs.acquire(), {"v": 1})
        key = f"{IDENTITY.key}/{HEAD_NAME}"
        store.put(key, store.get(key).data.replace(b'"next_seq":2', b'"next_seq":7'))
        with pytest.raises(CheckpointCorruptError, match="checksum"):
            cs.latest()

    def test_newer_format_is_refused_not_guessed(self, store: ObjectStore) -> None:
        key = f"{IDENTITY.key}/{HEAD_NAME}"
        newer = FORMAT_VERSION + 1
        body = {
            "format": newer,
            "identity": IDENTITY.key,
            "epoch": 1,
            "next_seq": 1,
            "lease": None,
            "checkpoints": [],
        }
        body["checksum"] = sha256_hex(canonical_json(body))
        store.put(key, canonical_json(body))
        with pytest.raises(FormatVersionError, match=f"format {newer}"):
            make(store).latest()

    # -- leases and fencing --------------------------------------------------------------------------------
    def test_stale_epoch_is_fenced_and_newer_state_survives(self, store: ObjectStore, tmp_path: Path) -> None:
        zombie_cs, retry_cs = make(store), make(store)
        zombie = zombie_cs.acquire(holder=WriterInfo(try_number=1))
        zombie_cs.commit(zombie, {"next": 10})
        retry = retry_cs.acquire(holder=WriterInfo(try_number=2), steal=True)
        assert retry.epoch == zombie.epoch + 1
        retry_cs.commit(retry, {"next": 20})
        before = objects(store)
        with pytest.raises(FencedError, match=r"epoch 1.*epoch 2.*try 2"):
            zombie_cs.commit(zombie, {"next": 999}, files=tree(tmp_path / "z", {"f": b"zombie bytes"}))
        latest = make(store).latest()
        assert latest is not None and latest.value == {"next": 20} and latest.writer.try_number == 2
        assert objects(store) == before, "a fenced writer fails before uploading anything"
        assert zombie_cs.release(zombie) is False
        with pytest.raises(FencedError):
            zombie_cs.renew(zombie)

    def test_writer_fenced_during_upload_makes_nothing_visible(
        self, store: ObjectStore, tmp_path: Path
    ) -> None:
        """The retry takes the lease while the zombie is between uploading data and advancing the head."""
        zombie_cs = make(store)
        zombie = zombie_cs.acquire()
        zombie_cs.commit(zombie, {"next": 10})
        steal_once = threading.Event()
        real_put = store.put

        def put_and_get_fenced(key: str, data: bytes, **kw: Any) -> str:
            if "~trees/" in key and not steal_once.is_set():  # the last upload before the head
                steal_once.set()
                make(store).acquire(steal=True)  # the retry starts right now
            return real_put(key, data, **kw)

        store.put = put_and_get_fenced  # type: ignore[method-assign]
        try:
            with pytest.raises(FencedError):
                zombie_cs.commit(zombie, {"next": 999}, files=tree(tmp_path / "z", {"f": b"zombie"}))
        finally:
            del store.put
        latest = make(store).latest()
        assert latest is not None and latest.value == {"next": 10}

    def test_live_lease_blocks_until_expiry_or_steal(self, store: ObjectStore) -> None:
        clock = FakeClock()
        first = make(store, clock=clock, lease_ttl=60)
        held = first.acquire(holder=WriterInfo(pod="pod-a"))
        with pytest.raises(LeaseHeldError, match="pod pod-a"):
            make(store, clock=clock, lease_ttl=60).acquire()
        clock.advance(30)
        first.renew(held)  # renewal pushes expiry to now + 60
        clock.advance(45)
        with pytest.raises(LeaseHeldError):
            make(store, clock=clock, lease_ttl=60).acquire()
        clock.advance(16)
        second = make(store, clock=clock, lease_ttl=60).acquire()
        assert second.epoch == held.epoch + 1
        with pytest.raises(FencedError):
            first.commit(held, {"late": True})

    def test_commit_renews_the_lease(self, store: ObjectStore) -> None:
        clock = FakeClock()
        cs = make(store, clock=clock, lease_ttl=60)
        lease = cs.acquire()
        for _ in range(3):
            clock.advance(50)
            cs.commit(lease, {"t": clock.now})
        with pytest.raises(LeaseHeldError):
            make(store, clock=clock, lease_ttl=60).acquire()

    def test_release_keeps_epoch_and_break_fences(self, store: ObjectStore) -> None:
        cs = make(store)
        lease = cs.acquire()
        assert cs.release(lease) is True
        lease2 = cs.acquire()  # no steal needed after release
        assert lease2.epoch == lease.epoch + 1
        broken = make(store).break_lease()
        assert broken is not None and broken.epoch == lease2.epoch + 1 and broken.lease is None
        with pytest.raises(FencedError, match="broken"):
            cs.commit(lease2, {"x": 1})

    def test_concurrent_writers_never_interleave_stale_commits(self, store: ObjectStore) -> None:
        """Writers keep stealing the lease from each other and committing; every visible commit is fenced right."""
        if not self.atomic_cas:
            pytest.skip(
                "threaded moto (STATEFUL_TEST_MOTO_THREADED=1) checks If-Match without a lock; "
                "the default serialized moto, local and real S3 run this race"
            )
        cs_keep = make(store, keep_last=1000)
        outcomes: list[tuple[str, int]] = []
        lock = threading.Lock()

        def writer(name: str) -> None:
            cs = make(store, keep_last=1000)
            for i in range(6):
                lease = cs.acquire(holder=WriterInfo(pod=name), steal=True)
                try:
                    cs.commit(lease, {"writer": name, "i": i, "epoch": lease.epoch})
                    with lock:
                        outcomes.append(("ok", lease.epoch))
                except FencedError:
                    with lock:
                        outcomes.append(("fenced", lease.epoch))

        threads = [threading.Thread(target=writer, args=(f"w{n}",)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        history = list(reversed(cs_keep.history()))
        assert [e.seq for e in history] == list(range(1, len(history) + 1))
        epochs = [e.epoch for e in history]
        assert epochs == sorted(epochs), "a commit with an older epoch landed after a newer one"
        assert len(set(epochs)) == len(epochs), (
            "two commits share one epoch although each writer commits once"
        )
        assert sorted(epochs) == sorted(e for status, e in outcomes if status == "ok")

    # -- retention -----------------------------------------------------------------------------------------
    def test_keep_last_prunes_history_and_deletes_old_objects(
        self, store: ObjectStore, tmp_path: Path
    ) -> None:
        cs = make(store, keep_last=2)
        lease = cs.acquire()
        for i in range(5):
            cs.commit(lease, {"i": i}, files=tree(tmp_path / f"s{i}", {"f.bin": bytes([i]) * 100}))
        assert [e.seq for e in cs.history()] == [5, 4]
        assert objects(store) > referenced(cs), "deletes are off the commit path: nothing deleted yet"
        assert cs.cleanup_due == 3, "three dropped checkpoints have objects of their own to delete"
        deleted = cs.sweep(lease)
        assert deleted and objects(store) == referenced(cs), "pruned checkpoints must leave no objects behind"
        with pytest.raises(CheckpointNotFoundError):
            cs.get(3)

    def test_kept_files_survive_retention_while_a_checkpoint_refers_to_them(
        self, store: ObjectStore, tmp_path: Path
    ) -> None:
        cs = make(store, keep_last=2)
        lease = cs.acquire()
        weights = tree(tmp_path / "w1", {"weights.bin": b"w1" * 5000, "opt/state": b"adam"})
        manifest = first = cs.commit(lease, {"epoch": 1}, files=weights)
        for step in range(5):  # progress checkpoints that keep the epoch's files by reference
            manifest = cs.commit(lease, {"epoch": 1, "step": step}, keep_files_from=manifest)
        latest = make(store).latest()
        assert latest is not None and latest.value == {"epoch": 1, "step": 4}
        assert latest.tree is not None and latest.tree == first.tree, (
            "files are referenced (one tree), not copied"
        )
        out = tmp_path / "out1"
        cs.restore_files(latest, out)
        assert read_tree(out) == read_tree(weights)
        first_keys = {k for f in cs.files(first) for k in f.keys} | {first.tree.key}
        cs.sweep(lease)
        assert objects(store) >= first_keys, "retention must not delete referenced data"

        cs.commit(lease, {"epoch": 2}, files=tree(tmp_path / "w2", {"weights.bin": b"w2" * 5000}))
        cs.commit(lease, {"epoch": 3}, files=tree(tmp_path / "w3", {"weights.bin": b"w3" * 5000}))
        cs.sweep(lease)
        cs.release(lease)
        assert objects(store) == referenced(cs), "data no kept checkpoint refers to is deleted"
        assert not objects(store) & (first_keys - {k for f in cs.files(cs.latest()) for k in f.keys})

    def test_small_commits_ride_inline_and_leave_no_objects(self, store: ObjectStore) -> None:
        """A small value is committed in the head itself: one conditional write, no manifest object at all."""
        cs = make(store, keep_last=2)
        lease = cs.acquire()
        for i in range(40):
            cs.commit(lease, {"i": i})
        assert [e.seq for e in cs.history()] == [40, 39]
        assert all(e.inline is not None and e.manifest is None for e in cs.history())
        assert objects(store) == {f"{IDENTITY.key}/{HEAD_NAME}"} == referenced(cs)
        assert cs.cleanup_due == 0, "nothing to clean up after inline commits"

    def test_everyday_operations_take_the_fewest_requests(self, store: ObjectStore, tmp_path: Path) -> None:
        """Resume, small saves and value-only saves cost what the protocol needs and no more.

        A task start is the acquire (read the head, write it) and nothing else when the newest manifest is
        inline; a small save is one conditional write of the head; a value-only save after a save with files
        is one write too (it references the same tree); a save with files reads the previous tree once and
        skips every chunk it holds.
        """
        src = tree(tmp_path / "src", {"a.bin": b"a" * 5000, "b.bin": b"b" * 7000})
        counter = CrashingStore(store)
        cs = make(counter)
        first = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False).open()
        first.commit({"step": 1}, files=src)
        first.commit({"step": 2})
        first.close()

        counter.calls.clear()
        resumed = WriterSession(
            checkpoints=make(counter), writer=WriterInfo(try_number=2), steal=True, heartbeat=False
        ).open()
        assert counter.calls == ["get", "put"], f"task start: {counter.calls}"
        assert resumed.value == {"step": 2}

        counter.calls.clear()
        resumed.commit({"step": 3})
        assert counter.calls == ["put"], f"small save: {counter.calls}"
        assert resumed.latest is not None and resumed.latest.file_count == 2, (
            "the files are kept by reference"
        )

        counter.calls.clear()
        resumed.commit({"step": 4}, files=src)
        # Unchanged files: the previous tree is read (once per process) and nothing but the head is written.
        assert counter.calls == ["get", "get", "put"], f"re-save of unchanged files: {counter.calls}"
        assert resumed.latest.tree == first.latest.tree  # type: ignore[union-attr]
        resumed.close(release=False)

    # -- the writer's file index: re-saves read only what changed ---------------------------------------
    @staticmethod
    def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The files a commit reads (spies on the real readers, the chunker and the small files' whole read:
        every read still happens)."""
        from airflow_stateful.core.data import transfer

        read: list[str] = []
        real, real_whole = transfer.iter_chunks, transfer._read_whole

        def spy(path: Path, size: int) -> Any:
            read.append(Path(path).name)
            return real(path, size)

        def spy_whole(local: Any, status: Any) -> Any:
            read.append(Path(local.path).name)
            return real_whole(local, status)

        monkeypatch.setattr(transfer, "iter_chunks", spy)
        monkeypatch.setattr(transfer, "_read_whole", spy_whole)
        return read

    def test_a_resave_reads_only_the_files_whose_status_changed(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Files settled before a save are not read again by the same writer while their status holds; a
        changed file is read, uploaded and restored with its new bytes."""
        from airflow_stateful.core.data import file_index

        monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
        src = tree(tmp_path / "src", {"a.bin": b"a" * 5000, "b.bin": b"b" * 7000, "c.bin": b"c" * 300})
        time.sleep(0.1)  # settled: older than RACY_SECONDS when hashed
        reads = self._reads(monkeypatch)
        cs = make(store)
        lease = cs.acquire()
        cs.commit(lease, {"step": 1}, files=src)
        assert sorted(reads) == ["a.bin", "b.bin", "c.bin"]

        reads.clear()
        unchanged = cs.commit(lease, {"step": 2}, files=src)
        assert reads == [], "nothing changed: no file is read"

        (src / "b.bin").write_bytes(b"B" * 7001)
        time.sleep(0.1)
        reads.clear()
        changed = cs.commit(lease, {"step": 3}, files=src)
        assert reads == ["b.bin"]
        assert changed.tree != unchanged.tree
        out = tmp_path / "out"
        cs.restore_files(changed, out)
        assert read_tree(out) == {"a.bin": b"a" * 5000, "b.bin": b"B" * 7001, "c.bin": b"c" * 300}

    def test_a_file_rewritten_with_the_same_size_and_mtime_is_still_saved(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``touch -r``/``cp -p`` put the old modification time back; the change time still moves, so the
        new bytes are read and committed, never the old chunks."""
        from airflow_stateful.core.data import file_index

        monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
        src = tree(tmp_path / "src", {"w.bin": b"old weights!" * 100})
        st = (src / "w.bin").stat()
        time.sleep(0.1)
        cs = make(store)
        lease = cs.acquire()
        cs.commit(lease, {"step": 1}, files=src)
        time.sleep(0.05)  # the rewrite gets a later change time whatever the clock's tick
        (src / "w.bin").write_bytes(b"new weights!" * 100)
        os.utime(src / "w.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
        assert (src / "w.bin").stat().st_mtime_ns == st.st_mtime_ns
        time.sleep(0.1)
        latest = cs.commit(lease, {"step": 2}, files=src)
        cs.restore_files(latest, tmp_path / "out")
        assert (tmp_path / "out" / "w.bin").read_bytes() == b"new weights!" * 100

    def test_a_racily_clean_file_is_read_again(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A file modified just before it was hashed may change again within its time stamp's tick: the index
        does not vouch for it, the next save reads it again."""
        src = tree(tmp_path / "src", {"fresh.bin": b"f" * 1000})  # just written: within RACY_SECONDS (2 s)
        reads = self._reads(monkeypatch)
        cs = make(store)
        lease = cs.acquire()
        cs.commit(lease, {"step": 1}, files=src)
        cs.commit(lease, {"step": 2}, files=src)
        assert reads == ["fresh.bin", "fresh.bin"]
        assert len(cs.file_index) == 0

    def test_a_new_writer_reads_only_the_files_whose_recorded_status_changed(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A retry in a new process (nothing in memory) trusts the status the previous tree recorded for each
        settled file, as restic trusts its parent snapshot: it reads the rewritten file only, and the checkpoint
        restores every file's current bytes."""
        from airflow_stateful.core.data import file_index

        monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
        src = tree(tmp_path / "src", {"a.bin": b"a" * 5000, "d/b.bin": b"b" * 7000, "c.bin": b"c" * 300})
        time.sleep(0.1)
        reads = self._reads(monkeypatch)
        first = make(store)
        first.commit(first.acquire(), {"step": 1}, files=src)
        assert sorted(reads) == ["a.bin", "b.bin", "c.bin"]
        recorded = first.content.tree(first.latest())
        assert recorded is not None and all(f.seen is not None for f in recorded.files)

        (src / "d" / "b.bin").write_bytes(b"B" * 7000)  # the same size
        time.sleep(0.1)
        reads.clear()
        retry = make(store)
        latest = retry.commit(retry.acquire(steal=True), {"step": 2}, files=src)
        assert reads == ["b.bin"]
        out = tmp_path / "out"
        retry.restore_files(latest, out)
        assert read_tree(out) == {"a.bin": b"a" * 5000, "d/b.bin": b"B" * 7000, "c.bin": b"c" * 300}

    def test_a_new_writer_reads_a_file_whose_status_moved_however_little(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """What a recorded status can never vouch for: a file rewritten with its old mtime put back (its change
        time moves), a file replaced by a rename with the same size and mtime (another inode), the same files
        restored into another directory (all new statuses), and files still settling when they were saved (no
        status recorded). Each is read, and the checkpoint holds the new bytes."""
        from airflow_stateful.core.data import file_index

        monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
        src = tree(
            tmp_path / "src", {"touched.bin": b"old!" * 100, "renamed.bin": b"old?" * 100, "same": b"s"}
        )
        old = {name: (src / name).stat() for name in ("touched.bin", "renamed.bin")}
        time.sleep(0.1)
        first = make(store)
        first.commit(first.acquire(), {"step": 1}, files=src)
        time.sleep(0.05)
        (src / "touched.bin").write_bytes(b"new!" * 100)
        os.utime(src / "touched.bin", ns=(old["touched.bin"].st_atime_ns, old["touched.bin"].st_mtime_ns))
        (tmp_path / "next.bin").write_bytes(b"new?" * 100)
        os.utime(tmp_path / "next.bin", ns=(old["renamed.bin"].st_atime_ns, old["renamed.bin"].st_mtime_ns))
        os.replace(tmp_path / "next.bin", src / "renamed.bin")
        time.sleep(0.1)
        reads = self._reads(monkeypatch)
        retry = make(store)
        lease = retry.acquire(steal=True)
        latest = retry.commit(lease, {"step": 2}, files=src)
        assert sorted(reads) == ["renamed.bin", "touched.bin"]
        out = tmp_path / "out"
        retry.restore_files(latest, out)
        assert read_tree(out) == {"touched.bin": b"new!" * 100, "renamed.bin": b"new?" * 100, "same": b"s"}

        time.sleep(0.1)
        reads.clear()
        again = make(store)
        again.commit(again.acquire(steal=True), {"step": 3}, files=out)  # the same bytes, other files
        assert sorted(reads) == ["renamed.bin", "same", "touched.bin"]

        monkeypatch.setattr(file_index, "RACY_SECONDS", 3600.0)  # every file is still settling
        settling_dir = tree(tmp_path / "settling", {"x.bin": b"x" * 10, "y.bin": b"y" * 20})
        fresh = make(store)
        settling = fresh.commit(fresh.acquire(steal=True), {"step": 4}, files=settling_dir)
        recorded = fresh.content.tree(settling)
        assert recorded is not None and [f.seen for f in recorded.files] == [None, None]
        reads.clear()
        last = make(store)
        last.commit(last.acquire(steal=True), {"step": 5}, files=settling_dir)
        assert sorted(reads) == ["x.bin", "y.bin"]

    def test_the_index_never_vouches_for_chunks_the_identity_no_longer_holds(
        self, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After the checkpoint the index came from is gone (another writer's newer checkpoint, retention), an
        unchanged file is read and its chunks uploaded again: every checkpoint holds its own chunks."""
        from airflow_stateful.core.data import file_index

        monkeypatch.setattr(file_index, "RACY_SECONDS", 0.05)
        src = tree(tmp_path / "src", {"a.bin": b"a" * 5000})
        other = tree(tmp_path / "other", {"z.bin": b"z" * 10})
        time.sleep(0.1)
        reads = self._reads(monkeypatch)
        cs = make(store, keep_last=1)
        lease = cs.acquire()
        cs.commit(lease, {"step": 1}, files=src)
        cs.commit(lease, {"step": 2}, files=other)  # keep_last=1: the checkpoint holding a.bin is dropped
        cs.sweep(lease)
        reads.clear()
        latest = cs.commit(lease, {"step": 3}, files=src)
        assert "a.bin" in reads
        cs.restore_files(latest, tmp_path / "out")
        assert read_tree(tmp_path / "out") == {"a.bin": b"a" * 5000}

    def test_restoring_more_files_than_the_descriptor_limit(self, store: ObjectStore, tmp_path: Path) -> None:
        """A worker's soft limit is often 1,024 descriptors: a restore of more files than it allows still
        succeeds (staging files are closed as they complete, at most MAX_OPEN_FILES at once)."""
        import resource

        from airflow_stateful.core.data.download import MAX_OPEN_FILES

        src = tree(tmp_path / "src", {f"d{i % 7}/f{i:04d}.txt": f"file {i}".encode() for i in range(600)})
        cs = make(store)
        lease = cs.acquire()
        manifest = cs.commit(lease, {"files": 600}, files=src)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir("/proc/self/fd"))
        limit = in_use + MAX_OPEN_FILES + 64  # room for the pool's sockets, far fewer than 600 files
        assert limit < 600 <= soft
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            restored = cs.restore_files(manifest, tmp_path / "out")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert len(restored) == 600
        assert read_tree(tmp_path / "out") == read_tree(src)

    # -- crashes -------------------------------------------------------------------------------------------
    @pytest.mark.parametrize("after", [False, True], ids=["before-call", "after-call"])
    def test_crash_at_every_step_keeps_last_good_checkpoint(
        self, store: ObjectStore, tmp_path: Path, after: bool
    ) -> None:
        """Kill the writer at each store call of a commit (before it is sent, or after it took effect)."""
        clock = FakeClock()
        src_old = tree(tmp_path / "old", {"w.bin": b"old weights" * 100, "cfg": b"old"})
        src_new = tree(tmp_path / "new", {"w.bin": b"new weights" * 100, "cfg": b"new", "extra": b"x"})

        def seeded(name: str) -> CheckpointStore:
            identity = Identity.for_task(dag_id="crash", task_id=name, run_id=f"after-{after}")
            cs = make(store, identity=identity, keep_last=1, clock=clock)
            lease = cs.acquire()
            cs.commit(lease, {"version": "old"}, files=src_old)
            cs.release(lease)
            return cs

        # The store calls of one clean commit, retention of the previous checkpoint included.
        counter = CrashingStore(store)
        counting = make(counter, identity=seeded("probe").identity, keep_last=1, clock=clock)
        lease = counting.acquire()
        counter.calls.clear()
        counting.commit(lease, {"version": "new"}, files=src_new)
        steps = list(counter.calls)
        # The head read, the previous checkpoint's tree (chunks it holds are not sent again), one pack holding
        # the three new small chunks, the new tree, the head: deletes are off the commit path.
        assert steps == ["get", "get", "put", "put", "put"], steps

        for crash_at, call in enumerate(steps):
            where = f"crash {'after' if after else 'before'} {call} (step {crash_at})"
            reader = seeded(f"step{crash_at}")
            crashing = CrashingStore(store)
            writer = make(crashing, identity=reader.identity, keep_last=1, clock=clock)
            lease = writer.acquire()
            crashing.crash_at, crashing.after = len(crashing.calls) + crash_at, after
            with pytest.raises(SimulatedCrash):
                writer.commit(lease, {"version": "new"}, files=src_new)

            latest = reader.latest()
            assert latest is not None, f"{where}: no checkpoint visible"
            assert latest.value in ({"version": "old"}, {"version": "new"}), where
            expected = src_new if latest.value == {"version": "new"} else src_old
            restored = tmp_path / f"restored-{after}-{crash_at}"
            reader.restore_files(latest, restored)
            assert read_tree(restored) == read_tree(expected), f"{where}: files differ from the value's"

            # The dead writer's lease expires; GC removes what it left behind, and only that.
            clock.advance(reader.lease_ttl + 61)
            report = collect_garbage(reader, min_age=timedelta(0), grace=60)
            assert report.skipped_reason is None, where
            assert objects(store, reader.identity) == referenced(reader), where
            # And the identity is fully usable again.
            reader.commit(reader.acquire(), {"version": "after"})
            assert reader.latest().value == {"version": "after"}  # type: ignore[union-attr]

    def test_gc_never_robs_a_held_lease_and_keeps_young_objects(self, store: ObjectStore) -> None:
        """Garbage from before the lease goes at once; what the holder wrote stays until its lease is dead."""
        earlier = f"{IDENTITY.key}/~chunks/{'0d' * 32}"
        store.put(earlier, b"left by a try that crashed before this lease was taken")
        time.sleep(2.2)  # the store stamps objects by the second on some endpoints: let the grace (1 s) pass
        clock = FakeClock()  # the real time now; moved by hand from here on
        cs = make(store, clock=clock)
        lease = cs.acquire()
        cs.commit(lease, {"v": 1})
        uploaded = f"{IDENTITY.key}/~chunks/{'de' * 32}"
        store.put(uploaded, b"an upload of the holder, not committed yet")

        live = collect_garbage(cs, min_age=timedelta(0), grace=1)
        assert live.skipped_reason and "live lease" in live.skipped_reason
        assert uploaded in objects(store), "what the holder wrote may still be committed by it"
        assert earlier not in objects(store), "garbage from before the lease is nobody's: it goes at once"
        clock.advance(cs.lease_ttl + 0.5)  # expired, but within the grace: maybe a renewal in flight
        within_grace = collect_garbage(cs, min_age=timedelta(0), grace=1)
        assert within_grace.deleted == [] and uploaded in objects(store)
        clock.advance(1)  # unrenewed for longer than ttl + grace: the lease is dead
        young = collect_garbage(cs, min_age=timedelta(days=1), grace=1)  # real mtimes are seconds old
        assert young.deleted == []
        dry = collect_garbage(cs, min_age=timedelta(0), grace=1, dry_run=True)
        assert dry.deleted == [uploaded]
        assert uploaded in objects(store)
        real = collect_garbage(cs, min_age=timedelta(0), grace=1)
        assert real.deleted == dry.deleted
        assert objects(store) == referenced(cs)
        with pytest.raises(FencedError, match="broken"):
            cs.commit(lease, {"v": 2})  # GC fenced the dead holder before deleting what it wrote
