"""S3 fault injection: commits, restores and GC through a proxy that breaks requests by a seeded schedule.

Real parts only: the real boto3 client of :class:`S3ObjectStore`, moto's server over HTTP, and
:class:`s3_fault_proxy.FaultProxy` between them injecting what S3 and networks do (500, 503 SlowDown,
connection resets before and after the request landed, delays past the read timeout, truncated bodies with and
without a matching Content-Length) on every request kind. A second store on a clean connection (straight to
moto) is the judge of what really happened.

What users rely on, asserted here:

* every commit returns or raises a :class:`StatefulError` subclass with a message (never a raw botocore or
  urllib3 exception);
* after each commit a fresh reader sees the committed checkpoint if the commit returned, the previous one if
  it raised, never a partial one; in particular, when the answer of the head write was lost, the commit is
  reported as committed exactly when the head shows it;
* a restore through the faulty path returns complete, verified files or raises, leaving the destination as it
  was;
* GC (plan, then apply) leaves no object that no checkpoint references, and none that one needs is missing;
* a hung endpoint (accepts, never answers) fails a commit in bounded time.

``STATEFUL_FAULT_SEED=<n>`` reruns the seeded test with another seed; every failure names the seed. See
docs/reliability.md for the figures of a run.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from maintenance import missing_references, read_tree, tree
from s3_endpoint import S3Endpoint
from s3_fault_proxy import FAULTS, HANG, KINDS, FaultProxy, FaultSchedule, Rule

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession, errors
from airflow_stateful.core.errors import StatefulError, StoreError
from airflow_stateful.core.fleet.gc import apply_gc, plan_gc
from airflow_stateful.core.protocol.retention import references, unreferenced
from airflow_stateful.core.records.codecs import decode_value
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.stores.s3 import MIB, S3ObjectStore

pytestmark = [pytest.mark.s3, pytest.mark.slow]

DEFAULT_SEED = 1202
SEED = int(os.environ.get("STATEFUL_FAULT_SEED", DEFAULT_SEED))
READ_TIMEOUT = 1.0
"""The faulty client's read timeout: short, so a delay fault costs about a second, not the default 20 s."""
DELAY = READ_TIMEOUT * 1.5
"""How long a delay fault holds a request or an answer: past the read timeout."""
ATTEMPTS = 2
"""Total attempts per request of the faulty client (the library's default is 6): with two, faults exhaust
botocore's retries often enough that the library's own error paths run, not only botocore's retries."""
FAULTY_CLIENT = {
    "connect_timeout": 1,
    "read_timeout": READ_TIMEOUT,
    "retries": {"mode": "standard", "total_max_attempts": ATTEMPTS},
}
LEASE_TTL = 30.0
RATES = {
    "put_head_conditional": 0.35,
    "put_conditional": 0.15,
    "get_object": 0.15,
    "head_object": 0.2,
    "list_objects": 0.3,
    "delete_object": 0.3,
    "delete_objects": 0.5,
    "create_multipart": 0.3,
    "upload_part": 0.15,
    "complete_multipart": 0.3,
    "abort_multipart": 0.3,
}
"""Per request kind, the probability of a fault. Kinds with few requests per run get more, so every fault
meets every kind in a run of a minute."""


@dataclass
class Rig:
    """The endpoint seen two ways: through the fault proxy, and on a clean connection."""

    endpoint: S3Endpoint
    prefix: str
    proxy: FaultProxy
    faulty: S3ObjectStore
    clean: S3ObjectStore

    @property
    def schedule(self) -> FaultSchedule:
        return self.proxy.schedule

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No faults for a while (setting up, tearing down)."""
        self.schedule.enabled = False
        try:
            yield
        finally:
            self.schedule.enabled = True


def make_rig(endpoint: S3Endpoint, prefix: str, schedule: FaultSchedule, **client: Any) -> Rig:
    if not endpoint.endpoint_url or not endpoint.endpoint_url.startswith("http://"):
        pytest.skip("the fault proxy speaks plain HTTP: needs moto's server (or another http:// endpoint)")
    proxy = FaultProxy(endpoint.endpoint_url, schedule, delay=DELAY, key_prefix=prefix)
    options = {**endpoint.options(), "endpoint_url": proxy.url}
    faulty = S3ObjectStore(
        bucket=endpoint.bucket,
        prefix=prefix,
        part_size=5 * MIB,
        config_kwargs=client or FAULTY_CLIENT,
        **options,
    )
    return Rig(endpoint=endpoint, prefix=prefix, proxy=proxy, faulty=faulty, clean=endpoint.store(prefix))


@contextlib.contextmanager
def rig(endpoint: S3Endpoint, prefix: str, schedule: FaultSchedule, **client: Any) -> Iterator[Rig]:
    made = make_rig(endpoint, prefix, schedule, **client)
    try:
        yield made
    finally:
        made.faulty.close()
        made.clean.close()
        made.proxy.close()


@dataclass
class Outcomes:
    """What the commits and restores of a run did, and every violation of what users rely on."""

    commits: Counter[str] = field(default_factory=Counter)
    restores: Counter[str] = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def error(self, what: str, exc: BaseException, *, where: str) -> str:
        """Check an error users would see; return its class name."""
        if not isinstance(exc, StatefulError):
            self.violations.append(
                f"{what}: a raw {type(exc).__module__}.{type(exc).__name__} escaped: {exc!r}\n"
                + "".join(traceback.format_exception(exc))
            )
            return f"raw {type(exc).__name__}"
        message = str(exc)
        if len(message) < 20 or (where not in message and "identity" not in message):
            self.violations.append(f"{what}: {type(exc).__name__} with an unclear message: {message!r}")
        self.messages.append(f"{type(exc).__name__}: {message}")
        return type(exc).__name__


def check_message(exc: BaseException) -> None:
    assert isinstance(exc, StatefulError), f"a raw {type(exc).__name__} escaped: {exc!r}"
    assert len(str(exc)) >= 20, f"unclear message: {exc!r}"


def latest_seen_by_fresh_reader(clean: S3ObjectStore, identity: Identity) -> Manifest | None:
    """The newest checkpoint, read on a clean connection by a reader that shares nothing with the writer."""
    return CheckpointStore(store=clean, identity=identity).latest()


def restored_by_fresh_reader(
    clean: S3ObjectStore, identity: Identity, manifest: Manifest, dest: Path
) -> dict[str, bytes]:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    CheckpointStore(store=clean, identity=identity).restore_files(manifest, dest)
    return read_tree(dest)


def kept_numbers(clean: S3ObjectStore, identity: Identity) -> set[int]:
    """The ``n`` of every checkpoint the head keeps (each commit of the seeded run has its own ``n``)."""
    cs = CheckpointStore(store=clean, identity=identity)
    return {cs.get(entry.seq).value["n"] for entry in cs.history()}


def leftover_objects(clean: S3ObjectStore, identity: Identity) -> list[str]:
    """Objects of the identity that no kept checkpoint references (what GC must have deleted)."""
    cs = CheckpointStore(store=clean, identity=identity)
    head = cs.head()
    infos = list(clean.list_objects(f"{identity.key}/"))
    refs = references(head, trees=cs.content.tree_of)
    return sorted(info.key for info in unreferenced(identity.key, infos, head, refs=refs))


def gc_through(store: S3ObjectStore, outcomes: Outcomes, *, passes: int = 8) -> int:
    """Store-wide GC, plan then apply (as tests/maintenance.py's GcLoop), until a pass finds nothing to do."""
    for number in range(passes):
        try:
            plan = plan_gc(store, min_age=timedelta(0), grace=0.0, expired_state=False)
            if not plan.keys:
                return number
            apply_gc(plan)
        except Exception as exc:
            outcomes.error(f"GC pass {number}", exc, where=store.url)
    return passes


# -- the seeded run ---------------------------------------------------------------------------------------------
def test_seeded_faults_on_every_request_kind(s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path) -> None:
    started = time.monotonic()
    # The first batch delete of the run (a writer's retention sweep or GC) meets a fault whatever the draws:
    # packs leave so few objects that only two or three batch deletes may be sent in all, the seeded draws for
    # them can all miss, and GC may find nothing left to delete (both happened in CI).
    schedule = FaultSchedule(seed=SEED, rates=RATES, rules=[Rule("delete_objects", "http_500")])
    identity = Identity.parse("faults/seeded/run=r1/map=-1")
    rng = random.Random(SEED)
    outcomes = Outcomes()
    where = f"seed {SEED}"
    big = bytearray(rng.randbytes(9 * MIB))  # several chunks (FastCDC, 2 MiB on average)
    with rig(s3_endpoint, s3_prefix, schedule) as r:
        cs = CheckpointStore(store=r.faulty, identity=identity, keep_last=3, lease_ttl=LEASE_TTL)
        with r.quiet():
            session = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1)).open()
        files_of: dict[str, dict[str, bytes]] = {}
        failed: set[int] = set()
        restore_dest = tmp_path / "restore-here"
        restore_dest.mkdir()
        (restore_dest / "mine.txt").write_bytes(b"the user's own file, never touched by a failed restore")
        try:
            for number in range(20):
                step = number % 6
                value: Any = {"n": number, "seed": SEED}
                files: dict[str, bytes] | None = None
                if step == 1:
                    value["ballast"] = ["x" * 100] * 100  # a manifest too big to ride in the head
                elif step in (2, 4):
                    files = {f"small/{i}.txt": rng.randbytes(rng.randint(1, 5000)) for i in range(3)}
                    files["small/n.txt"] = str(number).encode()
                elif step == 3:
                    start = rng.randrange(0, len(big) - 4096)
                    big[start : start + 4096] = rng.randbytes(4096)  # one region changes: a chunk or two
                    files = {"big.bin": bytes(big), "note.txt": f"commit {number}".encode()}
                source = None
                if files is not None:
                    source = tmp_path / f"src-{number}"
                    tree(source, files)
                before = latest_seen_by_fresh_reader(r.clean, identity)
                base = session.latest
                what = f"{where}, commit {number} (step {step})"
                try:
                    manifest = session.commit(value, files=source)
                except Exception as exc:
                    failed.add(number)
                    outcomes.commits[outcomes.error(what, exc, where=r.clean.url)] += 1
                    after = latest_seen_by_fresh_reader(r.clean, identity)
                    if (after and after.commit_id) != (before and before.commit_id):
                        outcomes.violations.append(
                            f"{what}: raised {type(exc).__name__} ({exc}) but the head shows a new checkpoint "
                            f"{after and after.seq}: a commit that landed was reported as failed"
                        )
                    if session.latest is not base:
                        outcomes.violations.append(f"{what}: a failed commit changed the session's latest")
                    continue
                finally:
                    if source is not None:
                        shutil.rmtree(source)
                outcomes.commits["committed"] += 1
                late = kept_numbers(r.clean, identity) & failed
                if late:
                    outcomes.violations.append(
                        f"{what}: commit(s) {sorted(late)} raised, yet the head now keeps them: a head write "
                        "that was held up landed after its commit was reported as failed"
                    )
                    failed -= late
                files_of[manifest.commit_id] = (
                    files if files is not None else files_of.get(base.commit_id, {}) if base else {}
                )
                after = latest_seen_by_fresh_reader(r.clean, identity)
                if after is None or after.commit_id != manifest.commit_id:
                    outcomes.violations.append(
                        f"{what}: returned checkpoint {manifest.seq} but a fresh reader sees "
                        f"{after and after.seq}: a commit reported as done is not in the head"
                    )
                    continue
                if decode_value(after.value, after.value_codec, allowed="json", where=what) != value:
                    outcomes.violations.append(f"{what}: a fresh reader sees another value")
                expected = files_of[manifest.commit_id]
                got = (
                    restored_by_fresh_reader(r.clean, identity, after, tmp_path / "verify")
                    if expected
                    else {}
                )
                if got != expected:
                    outcomes.violations.append(
                        f"{what}: a fresh reader restores {sorted(got)}, not the committed {sorted(expected)}"
                    )
                if step in (3, 5) and expected:
                    restore_through_faults(r, cs, manifest, restore_dest, expected, outcomes, what=what)
        finally:
            with r.quiet():
                session.close(release=False)  # the writer dies here: no last sweep, no release
        assert r.proxy.wait_idle(timeout=30), "requests still held by the proxy"
        late = kept_numbers(r.clean, identity) & failed
        if late:
            outcomes.violations.append(
                f"{where}: commit(s) {sorted(late)} raised, yet the head keeps them in the end: a head write that "
                "was held up landed after its commit was reported as failed"
            )
        # As `airflow-stateful unlock --force` would (GC itself waits for the lease to be dead past its ttl):
        # then everything the writer left unreferenced is GC's to find.
        CheckpointStore(store=r.clean, identity=identity).break_lease()
        garbage = leftover_objects(r.clean, identity)
        passes = gc_through(r.faulty, outcomes)
        leftovers = leftover_objects(r.clean, identity)
        missing = missing_references(r.clean, identity)
        with r.quiet():
            uploads = r.endpoint.client().list_multipart_uploads(Bucket=r.endpoint.bucket, Prefix=r.prefix)
        stats = r.proxy.stats
    elapsed = time.monotonic() - started
    report = (
        f"seed {SEED}: {sum(outcomes.commits.values())} commits {dict(outcomes.commits)}, restores "
        f"{dict(outcomes.restores)}, {stats.total_faults} faults of {sum(stats.requests.values())} requests, "
        f"by fault {stats.by_fault()}, by request kind {stats.by_request_kind()}, GC: {len(garbage)} unreferenced objects, "
        f"{passes} pass(es) through the faults, "
        f"{elapsed:.1f} s\n{stats.table()}\n" + "\n".join(sorted(set(outcomes.messages)))
    )
    print(report)
    assert not outcomes.violations, f"{report}\n" + "\n".join(outcomes.violations)
    assert not leftovers, f"{where}: GC left objects no checkpoint references: {leftovers}"
    assert not missing, f"{where}: objects a kept checkpoint needs are missing: {missing}"
    assert not uploads.get("Uploads"), f"{where}: incomplete multipart uploads left: {uploads['Uploads']}"
    assert outcomes.commits["committed"] >= 12, f"too few commits went through to judge anything: {report}"
    assert outcomes.restores["restored"] >= 1, report
    if (
        SEED == DEFAULT_SEED
    ):  # the default run covers every fault and the main request kinds; other seeds may not
        hit = {fault for fault, _kind in stats.injected}
        assert hit == set(FAULTS), f"faults never injected in this run: {set(FAULTS) - hit}"
        for kind in (
            "put_head_conditional",
            "put_conditional",
            "get_object",
            "list_objects",
            "delete_objects",
        ):
            assert stats.by_request_kind().get(kind), (
                f"no fault on {kind} requests in this run ({stats.requests[kind]} sent)"
            )


def restore_through_faults(
    r: Rig,
    cs: CheckpointStore,
    manifest: Manifest,
    dest: Path,
    expected: dict[str, bytes],
    outcomes: Outcomes,
    *,
    what: str,
) -> None:
    """Restore through the faulty path into a directory that holds files already: all or nothing, and (mode
    "exact", the default) exactly the checkpoint's files once it returned: the user's file, put back before each
    restore, is kept by every failed one and removed by every one that returned."""
    (dest / "mine.txt").write_bytes(b"the user's own file, never touched by a failed restore")
    before = read_tree(dest)
    try:
        cs.restore_files(manifest, dest)
    except Exception as exc:
        outcomes.restores[outcomes.error(f"{what}, restore", exc, where=r.clean.url)] += 1
        if read_tree(dest) != before:
            outcomes.violations.append(f"{what}: a failed restore changed the destination")
        return
    outcomes.restores["restored"] += 1
    if read_tree(dest) != expected:
        outcomes.violations.append(f"{what}: a restore that returned left other bytes than the checkpoint's")


# -- multipart uploads and ranged downloads --------------------------------------------------------------------
def test_multipart_uploads_and_ranged_downloads_under_faults(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path
) -> None:
    """``upload_file`` (multipart above the part size) and ``download_file`` (parallel ranged GETs): every call
    returns whole, verified bytes or raises a StatefulError; a failed upload never leaves a partial object."""
    schedule = FaultSchedule(seed=SEED, rates=RATES)
    rng = random.Random(SEED + 1)
    outcomes = Outcomes()
    with rig(s3_endpoint, s3_prefix, schedule) as r:
        for number in range(6):
            data = rng.randbytes(11 * MIB + rng.randrange(MIB))  # three parts of 5 MiB
            source = tmp_path / "up.bin"
            source.write_bytes(data)
            key = f"multipart/{number}.bin"
            what = f"seed {SEED}, upload {number}"
            try:
                stored = r.faulty.upload_file(key, source)
                outcomes.commits["uploaded"] += 1
                assert stored.size == len(data)
            except Exception as exc:
                outcomes.commits[outcomes.error(what, exc, where=r.clean.url)] += 1
            present = {info.key: info.size for info in r.clean.list_objects("multipart/")}
            if key in present:
                if r.clean.get(key).data != data:
                    outcomes.violations.append(f"{what}: the stored object differs from the file")
                    continue
                dest = tmp_path / "down.bin"
                try:
                    import hashlib

                    r.faulty.download_file(key, dest, size=len(data), sha256=hashlib.sha256(data).hexdigest())
                except Exception as exc:
                    outcomes.restores[outcomes.error(f"{what}, download", exc, where=r.clean.url)] += 1
                    if dest.exists():
                        outcomes.violations.append(f"{what}: a failed download left {dest}")
                    continue
                outcomes.restores["downloaded"] += 1
                if dest.read_bytes() != data:
                    outcomes.violations.append(f"{what}: a download that returned holds other bytes")
                dest.unlink()
        with r.quiet():
            uploads = r.endpoint.client().list_multipart_uploads(Bucket=r.endpoint.bucket, Prefix=r.prefix)
        stats = r.proxy.stats
    report = (
        f"seed {SEED}: uploads {dict(outcomes.commits)}, downloads {dict(outcomes.restores)}, "
        f"faults by fault {stats.by_fault()}, by request kind {stats.by_request_kind()}\n{stats.table()}\n"
        + "\n".join(sorted(set(outcomes.messages)))
    )
    print(report)
    assert not outcomes.violations, f"{report}\n" + "\n".join(outcomes.violations)
    left = [(u["Key"], u["UploadId"]) for u in uploads.get("Uploads", [])]
    assert not left, f"seed {SEED}: incomplete multipart uploads left (no GC lists them): {left}\n{report}"


@pytest.mark.parametrize("fault", ["reset_after", "delay_after", "truncate_keep_length"])
def test_lost_create_multipart_answer_leaves_no_orphan_upload(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path, fault: str
) -> None:
    """CreateMultipartUpload lands but its answer is lost; botocore's retry creates a second upload, which the
    store completes. The first upload id is known to nobody: unless something aborts it, its parts stay (and are
    billed) for ever, and no listing of objects (so no GC) shows them."""
    with rig(s3_endpoint, s3_prefix, FaultSchedule(seed=SEED, rules=[Rule("create_multipart", fault)])) as r:
        data = random.Random(SEED).randbytes(11 * MIB)
        source = tmp_path / "up.bin"
        source.write_bytes(data)
        r.faulty.upload_file("multipart/once.bin", source)
        assert not r.schedule.pending_rules()
        assert r.clean.get("multipart/once.bin").data == data
        uploads = r.endpoint.client().list_multipart_uploads(Bucket=r.endpoint.bucket, Prefix=r.prefix)
    left = [(u["Key"], u["UploadId"]) for u in uploads.get("Uploads", [])]
    assert not left, f"{fault} on CreateMultipartUpload left an incomplete upload no GC lists: {left}"


# -- the lost answer of the head write ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "times"),
    [
        pytest.param("reset_after", 1, id="reset-after-once"),
        pytest.param("reset_after", ATTEMPTS, id="reset-after-every-attempt"),
        pytest.param("delay_after", ATTEMPTS, id="delay-after-every-attempt"),
        pytest.param("reset_before", ATTEMPTS, id="reset-before-every-attempt"),
    ],
)
@pytest.mark.parametrize("ballast", [False, True], ids=["inline", "manifest"])
def test_lost_head_write_answer_is_resolved_by_the_head(
    s3_endpoint: S3Endpoint, s3_prefix: str, fault: str, times: int, ballast: bool
) -> None:
    """The conditional head write of a commit loses its answer (or, for ``reset_before``, never lands) on
    ``times`` attempts in a row. The commit is reported as committed exactly when the head shows it."""
    identity = Identity.parse("faults/lost-answer/run=r1/map=-1")
    with rig(s3_endpoint, s3_prefix, FaultSchedule(seed=SEED)) as r:
        cs = CheckpointStore(store=r.faulty, identity=identity, lease_ttl=LEASE_TTL)
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
            first = session.commit({"n": 0})
            r.schedule.add(Rule("put_head_conditional", fault, times=times))
            value = {"n": 1, "ballast": ["x" * 100] * 100 if ballast else None}
            try:
                manifest: Manifest | None = session.commit(value)
                error: BaseException | None = None
            except Exception as exc:
                manifest, error = None, exc
            assert not r.schedule.pending_rules(), "the fault was not injected"
            head = latest_seen_by_fresh_reader(r.clean, identity)
            assert head is not None
            landed = head.commit_id != first.commit_id
            if fault != "reset_before":
                assert landed, "the head write was forwarded, so it landed"
            if error is not None:
                check_message(error)
            assert (manifest is not None) == landed, (
                f"{fault} x{times}: the commit {'returned' if manifest else f'raised {error!r}'} but the head "
                f"{'shows' if landed else 'does not show'} it"
            )
            if manifest is not None:
                assert manifest.commit_id == head.commit_id
                assert session.latest is manifest
            # The writer goes on: its next commit follows whatever the head holds.
            following = session.commit({"n": 2})
            assert following.seq == head.seq + 1
        assert not missing_references(r.clean, identity)


def test_head_write_landing_after_its_commit_failed(s3_endpoint: S3Endpoint, s3_prefix: str) -> None:
    """Every attempt of the head write is held up (``delay_before``) longer than the attempts and the read-back
    take together, then lands: a request stuck in a queue that the client gave up on. A commit reported as
    failed must not become the newest checkpoint afterwards (nor may one reported as done be missing)."""
    identity = Identity.parse("faults/late-landing/run=r1/map=-1")
    held = ATTEMPTS * READ_TIMEOUT + 2.0
    with rig(s3_endpoint, s3_prefix, FaultSchedule(seed=SEED)) as r:
        cs = CheckpointStore(store=r.faulty, identity=identity, lease_ttl=LEASE_TTL)
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
            first = session.commit({"n": 0})
            r.schedule.add(Rule("put_head_conditional", "delay_before", times=ATTEMPTS, delay=held))
            try:
                manifest: Manifest | None = session.commit({"n": 1})
                error: BaseException | None = None
            except Exception as exc:
                manifest, error = None, exc
            assert r.proxy.wait_idle(timeout=ATTEMPTS * held + 10), "the held requests never landed"
            head = latest_seen_by_fresh_reader(r.clean, identity)
            assert head is not None
            landed = head.commit_id != first.commit_id
            if error is not None:
                check_message(error)
            assert (manifest is not None) == landed, (
                f"the commit {'returned' if manifest else f'raised {error!r}'}, and once the held head writes "
                f"landed the head {'shows' if landed else 'does not show'} it"
            )


def test_lost_head_write_answer_and_unreadable_head_is_a_clear_error(
    s3_endpoint: S3Endpoint, s3_prefix: str
) -> None:
    """The head write lands but its answer is lost on every attempt, and the head cannot be read back either:
    the commit cannot know whether it landed, and must say so with a StoreError rather than claim either."""
    identity = Identity.parse("faults/cannot-tell/run=r1/map=-1")
    with rig(s3_endpoint, s3_prefix, FaultSchedule(seed=SEED)) as r:
        cs = CheckpointStore(store=r.faulty, identity=identity, lease_ttl=LEASE_TTL)
        with WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1), heartbeat=False) as session:
            first = session.commit({"n": 0})
            r.schedule.add(
                Rule("put_head_conditional", "reset_after", times=ATTEMPTS),
                Rule("get_object", "reset_before", times=10 * ATTEMPTS, key_suffix="~head.json"),
            )
            with pytest.raises(StoreError) as raised:
                session.commit({"n": 1})
            check_message(raised.value)
            unknown = getattr(errors, "CommitOutcomeUnknownError", None)  # the lead's change (issue 14)
            if unknown is not None:
                assert isinstance(raised.value, unknown), f"not said to be unknown: {raised.value!r}"
            print(f"cannot tell: {raised.value}")
            while r.schedule.pending_rules():
                with contextlib.suppress(StatefulError):
                    cs.head()
            head = latest_seen_by_fresh_reader(r.clean, identity)
            assert head is not None and head.commit_id != first.commit_id, "the head write did land"
            assert session.latest is first, "a commit that raised must not change what the session reports"
            following = session.commit({"n": 2})
            assert following.seq == head.seq + 1


# -- a hung endpoint ------------------------------------------------------------------------------------------------
HUNG_CLIENT = {"connect_timeout": 0.3, "read_timeout": 0.3}
"""The library's retries (standard mode, 6 attempts); only the timeouts shortened so the test takes seconds."""


@pytest.mark.parametrize("with_files", [False, True], ids=["value", "files"])
def test_hung_endpoint_fails_a_commit_in_bounded_time(
    s3_endpoint: S3Endpoint, s3_prefix: str, tmp_path: Path, with_files: bool
) -> None:
    """An endpoint that accepts connections and never answers: the commit fails with a clear StatefulError,
    and closing the session returns too, each well within 10x the time botocore may spend on one request."""
    identity = Identity.parse(f"faults/hung/run=r1/map={int(with_files)}")
    schedule = FaultSchedule(seed=SEED, rate=1.0, faults=(HANG,))
    with rig(s3_endpoint, s3_prefix, schedule, **HUNG_CLIENT) as r:
        config: Any = r.faulty.client.meta.config  # botocore sets its options as attributes at runtime
        attempts = config.retries["total_max_attempts"]
        per_request = attempts * (config.connect_timeout + config.read_timeout)
        bound = 10 * per_request
        cs = CheckpointStore(store=r.faulty, identity=identity, lease_ttl=LEASE_TTL)
        with r.quiet():
            session = WriterSession(checkpoints=cs, writer=WriterInfo(try_number=1)).open()
            session.commit({"n": 0})
        source = (
            tree(tmp_path / "src", {"a.txt": b"a" * 1000, "b.bin": os.urandom(3 * MIB)})
            if with_files
            else None
        )
        outcome: list[BaseException | Manifest] = []

        def commit() -> None:
            try:
                outcome.append(session.commit({"n": 1}, files=source))
            except BaseException as exc:
                outcome.append(exc)

        started = time.monotonic()
        thread = threading.Thread(target=commit, name="hung-commit", daemon=True)
        thread.start()
        thread.join(timeout=bound)
        took = time.monotonic() - started
        assert not thread.is_alive(), f"the commit still hangs after {took:.0f} s (bound {bound:.0f} s)"
        assert len(outcome) == 1 and isinstance(outcome[0], BaseException), f"the commit returned: {outcome}"
        check_message(outcome[0])
        print(
            f"hung endpoint: {type(outcome[0]).__name__} after {took:.1f} s (bound {bound:.0f} s): {outcome[0]}"
        )
        closing = threading.Thread(target=session.close, name="hung-close", daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(timeout=bound)
        assert not closing.is_alive(), f"closing the session still hangs after {bound:.0f} s"
        assert r.proxy.stats.injected, "the proxy never held a request"
    assert set(r.proxy.stats.requests) <= set(KINDS)
