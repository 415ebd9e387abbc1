"""Where a small commit's time goes beyond one ``put_object`` (issue 32: "find out where the rest goes").

Run it with ``.venv/bin/python benchmarks/bench_commit_split.py --server seaweedfs`` (``--help`` for options).
``bench_store.py`` gives the verdict (the commit against one plain ``put_object`` of ~1 KB, and a conditional
PUT as the floor); this script splits the remainder. Interleaved in rounds, on one server and one client
configuration, it times:

* ``put 1 KB``: a plain ``put_object`` of the ~1 KB value, the baseline;
* ``put 1 KB If-Match``: the same, conditional on the previous ETag, as a fenced commit's write must be;
* ``put head If-Match``: the head record's own bytes (the value plus the inline manifests of the checkpoints
  the head keeps: several KB) to a key as deep as the head's, conditional: everything the server does for
  the commit's one request;
* ``commit``: ``CheckpointStore.commit`` of the value by the lease holder (steady state: one request).

So ``put head If-Match`` over ``put 1 KB If-Match`` is what the larger body and the deeper key cost the server,
and ``commit`` over ``put head If-Match`` is this library's own client work (building, encoding, signing and
checking the head record). Each side reports its median wall time per operation and this process's CPU per
operation (``time.process_time``), both per round of ``--per-round`` operations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from bench_server import add_server_option, start_server  # this folder
from bench_store import small_value

from airflow_stateful.core.protocol.checkpoint_store import CheckpointStore
from airflow_stateful.core.records.identity import Identity
from airflow_stateful.core.stores.s3 import S3ObjectStore

BUCKET = "bench-commit-split"
PREFIX = "split"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_option(parser)
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default %(default)s)")
    parser.add_argument("--per-round", type=int, default=100, help="operations per side per round")
    args = parser.parse_args()
    with start_server(args.server) as endpoint:
        kwargs = endpoint.store_kwargs()
        store = S3ObjectStore(bucket=BUCKET, prefix=PREFIX, **kwargs)
        client = store.client
        client.create_bucket(Bucket=BUCKET)
        identity = Identity.for_task(dag_id="bench", task_id="split", name="json")
        cs = CheckpointStore(store=store, identity=identity)
        lease = cs.acquire()
        for i in range(30):  # steady state: the head keeps its full history of inline checkpoints
            cs.commit(lease, small_value(i))
        heads = [
            o["Key"]
            for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/")["Contents"]
            if o["Key"].endswith("~head.json")
        ]
        head = client.get_object(Bucket=BUCKET, Key=heads[0])["Body"].read()
        body = json.dumps(small_value(0), separators=(",", ":")).encode()
        beside_head = heads[0].rsplit("/", 1)[0] + "/~split.json"
        etags = {
            "1k": client.put_object(Bucket=BUCKET, Key="split-1k.json", Body=body)["ETag"],
            "head": client.put_object(Bucket=BUCKET, Key=beside_head, Body=head)["ETag"],
        }
        counter = [1000]

        def commit() -> None:
            counter[0] += 1
            cs.commit(lease, small_value(counter[0]))

        def put_plain() -> None:
            client.put_object(Bucket=BUCKET, Key="split-plain.json", Body=body)

        def put_1k_if_match() -> None:
            etags["1k"] = client.put_object(
                Bucket=BUCKET, Key="split-1k.json", Body=body, IfMatch=etags["1k"]
            )["ETag"]

        def put_head_if_match() -> None:
            etags["head"] = client.put_object(
                Bucket=BUCKET, Key=beside_head, Body=head, IfMatch=etags["head"]
            )["ETag"]

        sides: dict[str, Callable[[], None]] = {
            "put 1 KB": put_plain,
            "put 1 KB If-Match": put_1k_if_match,
            f"put head ({len(head)} B) If-Match": put_head_if_match,
            "commit": commit,
        }
        wall: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        order = list(sides)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else reversed(order):  # neither side always runs first
                op = sides[name]
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(args.per_round):
                    op()
                wall[name].append((time.perf_counter() - w0) / args.per_round)
                cpu[name].append((time.process_time() - c0) / args.per_round)
        cs.release(lease)
        base = statistics.median(wall["put 1 KB"])
        print(
            f"small commit split on {endpoint.description}: {args.rounds} rounds x {args.per_round} per side"
        )
        print(f"{'side':34} {'median':>9} {'vs put':>7} {'client CPU':>11}")
        for name in sides:
            median = statistics.median(wall[name])
            print(
                f"{name:34} {median * 1e3:7.2f} ms {median / base:6.3f}x "
                f"{statistics.median(cpu[name]) * 1e3:8.2f} ms"
            )


if __name__ == "__main__":
    main()
