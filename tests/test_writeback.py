"""A restore starts writing each chunk to disk as it lands, and still fsyncs every file before it moves it in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_stateful.core.data import download, writeback
from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.local import LocalObjectStore

MIB = 1024 * 1024


def test_start_writeback_accepts_any_range_of_an_open_file(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * 10_000, 0)
        writeback.start_writeback(fd, 0, 10_000)
        writeback.start_writeback(fd, 5_000, 0)
        writeback.start_writeback(fd, 20_000, 4_096)  # past the end: nothing to write, no error
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"x" * 10_000


def test_a_durable_restore_writes_every_chunk_back_early_and_syncs_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``durable=True`` (the CLI's ``cat --files``): each file is fsynced before it is moved into place."""
    (tmp_path / "files").mkdir()
    data = os.urandom(12 * MIB)
    (tmp_path / "files" / "big.bin").write_bytes(data)
    (tmp_path / "files" / "small.txt").write_bytes(b"small")
    cs = CheckpointStore(store=LocalObjectStore(root=tmp_path / "store"), identity=Identity.parse("wb/a"))
    manifest = cs.commit(cs.acquire(), {}, files=tmp_path / "files")
    started: list[tuple[int, int]] = []
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        download, "start_writeback", lambda fd, offset, length: started.append((offset, length))
    )

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(download.os, "fsync", fsync)
    cs.restore_files(manifest, tmp_path / "out", durable=True)
    chunks = [c for f in cs.tree(manifest).files for c in f.chunks]  # type: ignore[union-attr]
    assert len(chunks) >= 3
    assert sorted(length for _, length in started) == sorted(c.size for c in chunks)
    assert len(synced) >= 3  # one per staged file, before any is moved into place, and the journal
    assert (tmp_path / "out" / "big.bin").read_bytes() == data


def test_a_task_restore_syncs_only_its_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default (a task's restore) no restored file is fsynced: its retry restores them all again. The
    journal, which the next restore trusts to undo an interrupted swap, still is (docs/adr/0006-packs.md)."""
    (tmp_path / "files").mkdir()
    for n in range(20):
        (tmp_path / "files" / f"f{n}.txt").write_bytes(os.urandom(4096))
    cs = CheckpointStore(store=LocalObjectStore(root=tmp_path / "store"), identity=Identity.parse("wb/b"))
    manifest = cs.commit(cs.acquire(), {}, files=tmp_path / "files")
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    cs.restore_files(manifest, tmp_path / "out")
    restored = [p for p in synced if "/out/" in p]
    assert len(restored) == 1 and restored[0].endswith("journal.json"), synced
    assert all(
        (tmp_path / "out" / f"f{n}.txt").read_bytes() == (tmp_path / "files" / f"f{n}.txt").read_bytes()
        for n in range(20)
    )
