"""Outputs published with a checkpoint: invisible until the commit, exactly once across a kill, collected if never
committed. On the local store and on S3 over HTTP (moto's server by default), with the real writer session.

The kill test runs the writer in a child process that stages an output and SIGKILLs itself before committing
(what an OOM kill or a lost node does between ``publish`` and ``save``); the parent is the retry.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from maintenance import missing_references
from s3_endpoint import S3Endpoint

from airflow_stateful.core import CheckpointStore, Identity
from airflow_stateful.core.data.packs import PACK_BELOW
from airflow_stateful.core.errors import CheckpointNotFoundError, FencedError, InvalidValueError
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.formats import HEAD_NAME, OUTPUTS_FORMAT, PACKS_FORMAT, PLAIN_FORMAT
from airflow_stateful.core.records.writer import WriterInfo
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore

IDENTITY = Identity.for_task(dag_id="reports", task_id="daily", run_id="manual__1")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(root=tmp_path / "state")
        return
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    with endpoint.store(request.getfixturevalue("s3_prefix")) as s3:
        yield s3


def open_session(store: ObjectStore, *, try_number: int = 1, keep_last: int = 3) -> WriterSession:
    cs = CheckpointStore(store=store, identity=IDENTITY, keep_last=keep_last)
    writer = WriterInfo.current(dag_id="reports", task_id="daily", run_id="manual__1", try_number=try_number)
    return WriterSession(checkpoints=cs, writer=writer, heartbeat=False).open()


def reader(store: ObjectStore) -> CheckpointStore:
    return CheckpointStore(store=store, identity=IDENTITY)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def keys(store: ObjectStore) -> set[str]:
    return {info.key for info in store.list_objects(f"{IDENTITY.key}/")}


def test_an_output_is_invisible_until_the_commit_then_listed_with_its_hash(
    store: ObjectStore, tmp_path: Path
) -> None:
    report = write(tmp_path / "work" / "report.csv", b"day,total\n2026-12-01,42\n" * 1000)
    session = open_session(store)
    session.commit({"n": 0})
    session.publish("daily-report", report)
    assert reader(store).outputs() == {}, "a staged output must not be visible before the commit"
    report.write_bytes(b"changed after publish")  # what is published is the content at publish()

    manifest = session.commit({"n": 1})
    outputs = reader(store).outputs()
    assert list(outputs) == ["daily-report"]
    info = outputs["daily-report"]
    expected = b"day,total\n2026-12-01,42\n" * 1000
    assert (info.kind, info.size, info.file_count, info.seq) == ("file", len(expected), 1, manifest.seq)
    assert info.sha256 == hashlib.sha256(expected).hexdigest()
    assert info.try_number == 1 and info.run_id == "manual__1"
    assert info.location.startswith(store.url.rstrip("/")) and info.location.endswith("#daily-report")

    dest = tmp_path / "fetched"
    assert list(reader(store).restore_output("daily-report", dest)) == [dest / "daily-report"]
    assert (dest / "daily-report").read_bytes() == expected
    session.close()


def test_a_directory_output_hashes_its_listing_and_restores_whole(store: ObjectStore, tmp_path: Path) -> None:
    model = tmp_path / "model"
    write(model / "weights.bin", os.urandom(300_000))
    write(model / "meta" / "config.json", b'{"layers": 3}')
    session = open_session(store)
    session.publish("model", model)
    session.commit({"epoch": 1})
    info = reader(store).outputs()["model"]
    listing = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.stat().st_size}  {rel}\n"
        for rel, p in sorted((str(p.relative_to(model)), p) for p in model.rglob("*") if p.is_file())
    )
    assert (info.kind, info.file_count) == ("directory", 2)
    assert info.sha256 == hashlib.sha256(listing.encode()).hexdigest()
    reader(store).restore_output("model", tmp_path / "out")
    assert (tmp_path / "out" / "model" / "weights.bin").read_bytes() == (model / "weights.bin").read_bytes()
    assert (tmp_path / "out" / "model" / "meta" / "config.json").read_bytes() == b'{"layers": 3}'
    session.close()


def test_outputs_carry_over_and_a_name_published_again_is_replaced(
    store: ObjectStore, tmp_path: Path
) -> None:
    session = open_session(store, keep_last=1)  # retention drops every older checkpoint at once
    session.publish("a", write(tmp_path / "a1", b"first a"))
    session.publish("b", write(tmp_path / "b1", b"only b"))
    first = session.commit({"n": 1})
    for n in range(2, 5):  # later commits publish nothing: the outputs stay
        session.commit({"n": n})
    session.publish("a", write(tmp_path / "a2", b"second a"))
    last = session.commit({"n": 5})
    session.checkpoints.sweep(session.lease)  # what retention dropped is deleted; the outputs must survive
    outputs = reader(store).outputs()
    assert sorted(outputs) == ["a", "b"]
    assert (outputs["a"].seq, outputs["b"].seq) == (last.seq, first.seq)
    reader(store).restore_output("a", tmp_path / "out")
    reader(store).restore_output("b", tmp_path / "out")
    assert (tmp_path / "out" / "a").read_bytes() == b"second a"
    assert (tmp_path / "out" / "b").read_bytes() == b"only b"
    assert missing_references(store, IDENTITY) == []
    session.close()


def test_a_sweep_between_publish_and_commit_keeps_the_staged_upload(
    store: ObjectStore, tmp_path: Path
) -> None:
    session = open_session(store, keep_last=1)
    session.commit({"n": 0})
    session.publish("big", write(tmp_path / "big", os.urandom(200_000)))
    session._sweep_quietly()  # the writer's background cleanup may run at any time
    session.commit({"n": 1})
    assert missing_references(store, IDENTITY) == []
    reader(store).restore_output("big", tmp_path / "out")
    assert (tmp_path / "out" / "big").read_bytes() == (tmp_path / "big").read_bytes()
    session.close()


def test_a_fenced_writers_staged_output_never_becomes_visible_and_is_collected(
    store: ObjectStore, tmp_path: Path
) -> None:
    zombie = open_session(store, try_number=1)
    zombie.publish("report", write(tmp_path / "zombie.csv", b"written by the zombie"))
    retry = open_session(store, try_number=2)  # steals the lease: the zombie is fenced
    with pytest.raises(FencedError):
        zombie.commit({"by": "zombie"})
    with pytest.raises(FencedError):
        zombie.publish("other", write(tmp_path / "other.csv", b"x"))
    assert reader(store).outputs() == {}
    retry.publish("report", write(tmp_path / "retry.csv", b"written by the retry"))
    retry.commit({"by": "retry"})
    retry.close()  # a clean end sweeps what no checkpoint references: the zombie's upload
    reader(store).restore_output("report", tmp_path / "out")
    assert (tmp_path / "out" / "report").read_bytes() == b"written by the retry"
    assert reader(store).outputs()["report"].try_number == 2
    assert keys(store) - referenced_keys(store) == set(), "the zombie's staged chunks were left"


def referenced_keys(store: ObjectStore) -> set[str]:
    cs = reader(store)
    head = cs.head()
    assert head is not None
    found = {f"{IDENTITY.key}/{HEAD_NAME}"}
    for entry in head.checkpoints:
        manifest = cs.get(entry.seq)
        found |= {e.manifest for e in [entry] if e.manifest} | {
            ref.key for ref in (entry.tree, entry.outputs_tree) if ref
        }
        found |= {key for f in cs.files(manifest) for key in f.keys}
        found |= {
            c.key for name in manifest.outputs for f in cs.output_files(manifest, name) for c in f.chunks
        }
    return found


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_outputs import open_session, store_for
    store = store_for({spec!r})
    session = open_session(store, try_number=1)
    session.commit({{"n": 1}})
    session.publish("part-0001", {path!r})
    print("staged", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # between publish and the commit that would have made it visible
    """
)


def store_for(spec: dict[str, str]) -> ObjectStore:
    """A store from a JSON-able spec, so a child process reaches the same one."""
    if spec["kind"] == "local":
        return LocalObjectStore(root=Path(spec["root"]))
    from airflow_stateful.core.stores.s3 import S3ObjectStore

    return S3ObjectStore(
        bucket=spec["bucket"],
        prefix=spec["prefix"],
        endpoint_url=spec["endpoint_url"] or None,
        region_name=spec["region"],
        aws_access_key_id=spec.get("aws_access_key_id"),
        aws_secret_access_key=spec.get("aws_secret_access_key"),
    )


def test_kill_9_between_publish_and_commit_then_a_retry_yields_each_output_once(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    for kind in ("local", "s3"):
        if kind == "local":
            spec = {"kind": "local", "root": str(tmp_path / "state")}
        else:
            endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
            spec = {
                "kind": "s3",
                "bucket": endpoint.bucket,
                "prefix": request.getfixturevalue("s3_prefix"),
                "endpoint_url": endpoint.endpoint_url or "",
                "region": endpoint.region,
                **endpoint.credentials,
            }
        part = write(tmp_path / kind / "part-0001.parquet", os.urandom(100_000) + b"try 1")
        code = _CHILD.format(tests=str(Path(__file__).parent), spec=spec, path=str(part))
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, child.stderr
        assert "staged" in child.stdout
        store = store_for(spec)
        staged_chunks = {k for k in keys(store) if "/~chunks/" in k or "/~packs/" in k}
        assert staged_chunks, "the killed try had uploaded its output's chunks"
        assert reader(store).outputs() == {}, f"{kind}: a killed try's staged output became visible"

        retry = open_session(store, try_number=2)
        assert retry.value == {"n": 1}
        part.write_bytes(os.urandom(100_000) + b"try 2")
        retry.publish("part-0001", part)
        retry.commit({"n": 2})
        retry.close()
        outputs = reader(store).outputs()
        assert list(outputs) == ["part-0001"] and outputs["part-0001"].try_number == 2, kind
        reader(store).restore_output("part-0001", tmp_path / kind / "out")
        assert (tmp_path / kind / "out" / "part-0001").read_bytes() == part.read_bytes()
        assert keys(store) - referenced_keys(store) == set(), (
            f"{kind}: the killed try's upload was not collected"
        )
        assert not staged_chunks & keys(store), kind


def test_bad_names_and_paths_are_refused_before_anything_is_sent(store: ObjectStore, tmp_path: Path) -> None:
    session = open_session(store)
    before = keys(store)
    good = write(tmp_path / "good", b"x")
    for bad in ["", "../up", "a/b", ".hidden", "x" * 201, "sp ace", None, 7]:
        with pytest.raises(InvalidValueError, match="output name"):
            session.publish(bad, good)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="does it exist"):
        session.publish("missing", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidValueError, match="holds no files"):
        session.publish("empty", tmp_path / "empty")
    assert keys(store) == before
    assert session.staged_outputs == {}
    with pytest.raises(CheckpointNotFoundError, match="no output 'nope'"):
        session.commit({"n": 1})
        reader(store).restore_output("nope", tmp_path / "out")
    session.close()


def test_a_head_with_outputs_is_written_in_the_format_older_releases_refuse(
    store: ObjectStore, tmp_path: Path
) -> None:
    session = open_session(store)
    session.commit({"n": 1})
    head = reader(store).head()
    assert head is not None and head.format == PLAIN_FORMAT, "no outputs: still readable by format-2 releases"
    # An output of one chunk too large to pack: format 3 is enough.
    session.publish("o", write(tmp_path / "o", os.urandom(PACK_BELOW)))
    session.commit({"n": 2})
    head = reader(store).head()
    assert head is not None and head.format == OUTPUTS_FORMAT == 3
    body = json.loads(store.get(f"{IDENTITY.key}/{HEAD_NAME}").data)
    assert body["format"] == 3 and body["checkpoints"][-1]["outputs_tree"]["key"].startswith(IDENTITY.key)
    # A small output is packed: format 5, which releases that do not know packs refuse.
    session.publish("small", write(tmp_path / "small", b"s"))
    session.commit({"n": 3})
    head = reader(store).head()
    assert head is not None and head.format == PACKS_FORMAT == 5
    session.close()


def test_gc_collects_the_staged_output_of_a_writer_that_never_came_back(
    store: ObjectStore, tmp_path: Path
) -> None:
    """No retry ever runs (the task was abandoned): once its lease is gone, store-wide GC deletes the upload of an
    output that was staged and never committed, and nothing the kept checkpoint needs."""
    from datetime import timedelta

    from airflow_stateful.core.fleet.gc import apply_gc, plan_gc

    session = open_session(store)
    session.commit({"n": 1})
    before = keys(store)
    session.publish("orphan", write(tmp_path / "orphan.bin", os.urandom(150_000)))
    staged = keys(store) - before
    assert staged, "publish uploaded the output's chunks"
    session._stop_heartbeat()  # the process is gone: nothing renews, nothing commits
    reader(store).break_lease()  # `airflow-stateful unlock`, or GC once the lease is dead past its grace
    deleted = apply_gc(plan_gc(store, min_age=timedelta(0), grace=0.0)).deleted
    assert staged <= set(deleted), "GC must collect the output that was staged but never committed"
    assert not staged & keys(store)
    assert missing_references(store, IDENTITY) == [] and reader(store).outputs() == {}
    assert reader(store).latest().value == {"n": 1}  # type: ignore[union-attr]
