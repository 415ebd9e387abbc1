"""Zombie storm: N writer processes steal one identity's lease from each other in turns, for as long as asked.

Every writer loops: take the lease (``steal=True``, as an Airflow retry does), commit as fast as it can (a
value each time, a few fresh files every third commit) until it is fenced, then wait a moment and steal the
lease back. So at any moment up to N-1 writers are zombies that still believe they hold the lease. Each
writer appends to its own fsync'd log, one JSON line per event: ``acquired`` (epoch), ``ack`` (a commit
returned: seq, commit id, value), ``fenced`` (it was told), and ``upload`` (every object it sent, with the
epoch of the session that sent it).

The driver then checks what users rely on, on the local store and on S3 (moto serialized, so conditional
writes are atomic):

* no acknowledged update lost: no two acknowledged commits share a seq, and every one of them is still in
  the identity's history (keep_last is raised above the number of commits) with the value it acknowledged;
* fenced writers never commit: every checkpoint in the history was acknowledged by the writer holding that
  epoch;
* every fenced writer is told before it uploads more: after a writer's ``fenced`` line no upload of that
  session follows; and the uploads a session sent after its lease was stolen but before it was told are
  counted (they are bounded by one renewal interval: the heartbeat or the commit's fail-fast check tells it);
* nothing it uploaded while fenced is referenced: the final checkpoint restores and verifies, and GC finds no
  missing reference.

Run ``python tests/soak/zombie_storm.py --store local --writers 4 --seconds 120`` (``make storm`` runs both
stores for minutes); tests/test_zombie_storm.py runs a short storm in ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
S3_SERVERS = ("env", "moto", "seaweedfs")
KEY = "storm/writers/run=manual__1/map=-1"
TTL = 2.0
RENEW_EVERY = 0.5
KEEP = 1000


# -- the writer (a child process) -----------------------------------------------------------------------------
def writer(url: str, name: str, seconds: float, log_path: Path, seed: int) -> None:
    from airflow_stateful.core import CheckpointStore, Identity, WriterInfo, WriterSession
    from airflow_stateful.core.errors import FencedError
    from airflow_stateful.core.stores.registry import store_from_url

    rng = random.Random(seed)
    log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole life of the process

    def note(**event: Any) -> None:
        log.write(json.dumps({"t": time.time(), "writer": name, **event}) + "\n")
        log.flush()
        os.fsync(log.fileno())

    endpoint = os.environ.get("STATEFUL_S3_ENDPOINT_URL")
    inner = store_from_url(url, **({"endpoint_url": endpoint} if url.startswith("s3://") else {}))
    epoch = {"now": 0}

    def recorded(method: str) -> Any:
        real = getattr(inner, method)

        def call(key: str, *args: Any, **kwargs: Any) -> Any:
            note(event="upload", epoch=epoch["now"], key=key)
            return real(key, *args, **kwargs)

        return call

    for method in ("put", "upload_file"):
        setattr(inner, method, recorded(method))
    identity = Identity.parse(KEY)
    work = Path(tempfile.mkdtemp(prefix=f"storm-{name}-"))
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        cs = CheckpointStore(store=inner, identity=identity, keep_last=KEEP, lease_ttl=TTL)
        epoch["now"] = -1  # taking the lease: no session yet
        session = WriterSession(
            checkpoints=cs, writer=WriterInfo(pod=name), steal=True, renew_every=RENEW_EVERY
        ).open()
        epoch["now"] = session.lease.epoch
        note(event="acquired", epoch=session.lease.epoch)
        try:
            while time.monotonic() < deadline:
                n += 1
                value = {"writer": name, "n": n, "epoch": session.lease.epoch}
                files = None
                if n % 3 == 0:
                    files = work / f"c{n}"
                    files.mkdir()
                    for i in range(3):
                        (files / f"part{i}.bin").write_bytes(rng.randbytes(rng.randint(1, 200_000)))
                manifest = session.commit(value, files=files)
                note(
                    event="ack",
                    epoch=session.lease.epoch,
                    seq=manifest.seq,
                    commit_id=manifest.commit_id,
                    value=value,
                )
        except FencedError as exc:
            note(event="fenced", epoch=epoch["now"], error=str(exc)[:200])
        finally:
            with contextlib.suppress(Exception):
                session.close(release=False)
        time.sleep(rng.uniform(0.05, 0.4))
    note(event="done")


# -- the driver -------------------------------------------------------------------------------------------------
def read_events(logs: list[Path]) -> list[dict[str, Any]]:
    events = []
    for path in logs:
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):  # a line cut by the end of the run
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def check(store: Any, events: list[dict[str, Any]], scratch: Path) -> dict[str, Any]:
    """The storm's verdict: counts and the list of violations (empty when every promise held)."""
    sys.path.insert(0, str(REPO / "tests"))
    from maintenance import missing_references

    from airflow_stateful.core import CheckpointStore, Identity
    from airflow_stateful.core.errors import StatefulError

    identity = Identity.parse(KEY)
    problems: list[str] = []
    acks = [e for e in events if e["event"] == "ack"]
    seqs = Counter(a["seq"] for a in acks)
    problems += [f"seq {s} acknowledged {c} times (a lost update)" for s, c in seqs.items() if c > 1]
    cs = CheckpointStore(store=store, identity=identity, keep_last=KEEP)
    head = cs.head()
    kept = {e.commit_id: e for e in head.checkpoints} if head else {}
    oldest_kept = min((e.seq for e in kept.values()), default=0)
    for ack in acks:
        if ack["seq"] >= oldest_kept and ack["commit_id"] not in kept:
            problems.append(f"acknowledged commit {ack['seq']} by {ack['writer']} is not in the history")
    by_commit = {a["commit_id"]: a for a in acks}
    for entry in kept.values():
        acked = by_commit.get(entry.commit_id)
        if acked is None:
            problems.append(f"checkpoint {entry.seq} was never acknowledged (a zombie's commit landed?)")
        elif acked["epoch"] != entry.epoch:
            problems.append(
                f"checkpoint {entry.seq}: acknowledged under epoch {acked['epoch']}, stored {entry.epoch}"
            )
    for ack in acks[-20:]:
        try:
            manifest = cs.get(ack["seq"])
        except StatefulError as exc:
            problems.append(f"checkpoint {ack['seq']} cannot be read: {exc}")
            continue
        if manifest.value != ack["value"]:
            problems.append(
                f"checkpoint {ack['seq']} reads {manifest.value!r}, acknowledged {ack['value']!r}"
            )
    # Told before it uploads more; and what a zombie sent before it was told.
    stolen_at = {e["epoch"] - 1: e["t"] for e in events if e["event"] == "acquired"}
    told: dict[tuple[str, int], float] = {}
    late = 0
    for event in events:
        session = (event["writer"], event.get("epoch", 0))
        if event["event"] == "fenced":
            told[session] = event["t"]
        elif event["event"] == "upload":
            if session in told:
                problems.append(f"{session[0]} uploaded {event['key']} after it was told it was fenced")
            elif not event["key"].endswith("/~head.json") and event["t"] > stolen_at.get(
                session[1], float("inf")
            ):
                late += 1  # chunk, tree or manifest data sent by a zombie not yet told (never referenced)
    latest = cs.latest()
    if latest is not None:
        cs.verify(latest)  # every chunk re-hashed
        cs.restore_files(latest, scratch / "restored")
    problems += [f"missing: {key}" for key in missing_references(store, identity)]
    return {
        "acquisitions": sum(e["event"] == "acquired" for e in events),
        "acknowledged": len(acks),
        "fenced": sum(e["event"] == "fenced" for e in events),
        "uploads": sum(e["event"] == "upload" for e in events),
        "uploads_after_steal_before_told": late,
        "history_checked": len(kept),
        "problems": problems,
    }


@contextlib.contextmanager
def backend(kind: str, root: Path, server: str = "env") -> Iterator[tuple[str, dict[str, str], Any, str]]:
    """(url for the writers, their environment, a store for the checker, its label) on ``kind``; for ``s3``, on
    ``server``: ``moto`` (serialized) or ``seaweedfs`` started here, or ``env``, the endpoint the test suite
    would use (tests/s3_endpoint.py: ``STATEFUL_TEST_S3_ENDPOINT``, moto by default)."""
    from airflow_stateful.core.stores.registry import store_from_url

    if kind == "local":
        url = (root / "state").as_uri()
        with store_from_url(url) as store:
            yield url, {}, store, "local"
        return
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    from s3_endpoint import s3_endpoint_from_env, started_endpoint

    if server not in S3_SERVERS:
        raise ValueError(f"--s3-server must be one of {', '.join(S3_SERVERS)}, not {server!r}")
    with s3_endpoint_from_env() if server == "env" else started_endpoint(server) as endpoint:
        creds = endpoint.credentials
        if not creds or not endpoint.endpoint_url:
            raise RuntimeError("the storm needs an endpoint URL and its credentials (STATEFUL_TEST_S3_...)")
        env = {
            "STATEFUL_S3_ENDPOINT_URL": endpoint.endpoint_url,
            "AWS_ACCESS_KEY_ID": creds["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": creds["aws_secret_access_key"],
            "AWS_DEFAULT_REGION": endpoint.region,
        }
        # For the storm's own checks in this process, and only while the storm runs: the endpoint is this
        # server's, which stops afterwards. Left behind, it would send every later S3 client of the process
        # (and the CLI runs it starts, which read STATEFUL_S3_ENDPOINT_URL) to a dead port.
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            url = f"s3://{endpoint.bucket}/storm-{os.getpid()}-{time.time_ns()}"
            with store_from_url(url, endpoint_url=endpoint.endpoint_url) as store:
                yield url, env, store, f"s3 ({endpoint.kind})"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def storm(kind: str, writers: int, seconds: float, seed: int, *, server: str = "env") -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"storm-{kind}-"))
    with backend(kind, root, server) as (url, env, store, label):
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("STATEFUL_", "AWS_"))}
        child_env = {**clean, **env, "PYTHONPATH": str(REPO)}
        logs = [root / f"w{i}.log" for i in range(writers)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    url,
                    f"w{i}",
                    str(seconds),
                    str(logs[i]),
                    str(seed + i),
                ],
                env=child_env,
                start_new_session=True,
                stderr=open(root / f"w{i}.stderr", "wb"),  # noqa: SIM115 - closed with the process
            )
            for i in range(writers)
        ]
        try:
            for proc in procs:
                proc.wait(timeout=seconds + 120)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        failed = [
            f"writer w{i} exited {p.returncode}: {(root / f'w{i}.stderr').read_text(errors='replace')[-2000:]}"
            for i, p in enumerate(procs)
            if p.returncode != 0
        ]
        result = check(store, read_events(logs), root)
        result["problems"] = failed + result["problems"]
        result.update(store=label, writers=writers, seconds=seconds)
        return result


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--child"]:
        url, name, seconds, log_path, seed = args[1:6]
        writer(url, name, float(seconds), Path(log_path), int(seed))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["local", "s3", "both"], default="both")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--s3-server",
        choices=S3_SERVERS,
        default="env",
        help="the S3 endpoint: env (the test suite's STATEFUL_TEST_S3_ENDPOINT settings, moto by default), "
        "moto or seaweedfs (started here)",
    )
    opts = parser.parse_args(args)
    kinds = ["local", "s3"] if opts.store == "both" else [opts.store]
    results = [storm(kind, opts.writers, opts.seconds, opts.seed, server=opts.s3_server) for kind in kinds]
    columns = [
        "store",
        "writers",
        "seconds",
        "acquisitions",
        "acknowledged",
        "fenced",
        "uploads",
        "uploads_after_steal_before_told",
        "history_checked",
    ]
    print(" | ".join(columns) + " | violations")
    for r in results:
        print(" | ".join(str(r[c]) for c in columns) + f" | {len(r['problems'])}")
        for problem in r["problems"][:20]:
            print(f"  VIOLATION ({r['store']}): {problem}")
    if opts.json_out:
        opts.json_out.write_text(json.dumps(results, indent=2))
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
