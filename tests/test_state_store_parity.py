"""Side by side: our S3StateStoreBackend and Airflow's common-io object-storage backend, same behaviours.

A team moving from common-io's ``StateStoreObjectStorageBackend`` (apache-airflow-providers-common-io, the
object-storage backend for Airflow 3.3's task and asset state store) to ours must not break (issue 11). So
every behaviour here runs on both backends, and the answers must be equal to each other AND to what Airflow's
``BaseStoreBackend`` contract says (two backends wrong in the same way would otherwise pass): round trips
with keys holding ``/``, spaces and Unicode, isolation between scopes, delete, clear of one map index and of
all, asset scopes, the async variants and the worker-side references.

common-io's backend runs on a local directory, configured as its users do
(``[common.io] state_store_objectstorage_path = file:///...``); ours on a local directory and on the
session's S3 endpoint (moto's real server over HTTP by default). Both get the task SDK's scopes
(``airflow.sdk.state``), the only ones common-io's backend handles (see the server-side difference below).

Where the two legitimately differ, one test per difference pins the behaviour of BOTH sides, with the reason
in a comment, so a change in either shows up here. Last, one DAG runs under ``dag.test()`` with each as the
worker-side backend (``[workers] state_store_backend``) and must return the same.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import textwrap
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import pytest
from dag_helpers import find_dag, load_dag_module
from s3_endpoint import S3Endpoint
from test_state_store import forget_state_backends, returned

from airflow_stateful.core.errors import ConfigurationError, IdentityError, InvalidValueError
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.state_store import S3StateStoreBackend

COMMON_IO_MODULE = "airflow.providers.common.io.state_store.backend"
COMMON_IO_BACKEND = f"{COMMON_IO_MODULE}.StateStoreObjectStorageBackend"
OUR_BACKEND = "airflow_stateful.state_store.S3StateStoreBackend"
RUN_ID = "manual__2026-01-01T00:00:00+00:00"
PAST = datetime.now(tz=timezone.utc) - timedelta(days=1)


def task_scope(**overrides: Any) -> Any:
    from airflow.sdk.state import TaskScope

    fields: dict[str, Any] = {"dag_id": "etl", "run_id": RUN_ID, "task_id": "load"}
    fields.update(overrides)
    return TaskScope(**fields)


def asset_scope(**fields: Any) -> Any:
    from airflow.sdk.state import AssetScope

    return AssetScope(**fields)


# -- the two backends ---------------------------------------------------------------------------------------
def common_io_module() -> ModuleType:
    """common-io's backend module, or a skip that names exactly what is missing."""
    try:
        return importlib.import_module(COMMON_IO_MODULE)
    except ImportError as exc:
        pytest.skip(
            f"{COMMON_IO_BACKEND} cannot be imported ({exc}): the comparison needs "
            "apache-airflow-providers-common-io >= 1.11 (pip install apache-airflow-providers-common-io)"
        )


def configure_common_io(monkeypatch: pytest.MonkeyPatch, root: Path) -> ModuleType:
    """Point common-io's backend at ``root`` the way its users do: ``[common.io]`` settings.

    The backend reads them through ``functools.cache``d helpers (``_get_base_path``, ``_get_compression``,
    ``_get_threshold``), once per process; forget them so this test's directory is the one used.
    """
    module = common_io_module()
    monkeypatch.setenv("AIRFLOW__COMMON_IO__STATE_STORE_OBJECTSTORAGE_PATH", root.as_uri())
    monkeypatch.delenv("AIRFLOW__COMMON_IO__STATE_STORE_OBJECTSTORAGE_COMPRESSION", raising=False)
    monkeypatch.delenv("AIRFLOW__COMMON_IO__STATE_STORE_OBJECTSTORAGE_THRESHOLD", raising=False)
    forget_common_io_config(module)
    return module


def forget_common_io_config(module: ModuleType) -> None:
    for name in ("_get_base_path", "_get_compression", "_get_threshold"):
        getattr(module, name).cache_clear()


@pytest.fixture
def common_io_root(tmp_path: Path) -> Path:
    root = tmp_path / "common-io"
    root.mkdir()
    return root


@pytest.fixture
def common_io(common_io_root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = configure_common_io(monkeypatch, common_io_root)
    yield module.StateStoreObjectStorageBackend()
    forget_common_io_config(module)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def our_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "local":
        yield LocalObjectStore(root=tmp_path / "ours", fsync=False)
    else:
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        with endpoint.store(request.getfixturevalue("s3_prefix")) as store:
            yield store


@pytest.fixture
def ours(our_store: ObjectStore) -> S3StateStoreBackend:
    return S3StateStoreBackend(store=our_store)


def both(common_io: Any, ours: S3StateStoreBackend, scenario: Callable[[Any], Any]) -> Any:
    """Run ``scenario`` on each backend; they must observe the same. Returns that observation."""
    theirs, mine = scenario(common_io), scenario(ours)
    assert mine == theirs, f"the backends disagree.\ncommon-io: {theirs!r}\nours:      {mine!r}"
    return mine


# -- the same behaviours, both backends ---------------------------------------------------------------------
KEYS = [
    "connector/offset",
    "a/b",
    "a_b",
    "a%2Fb",
    "a%252Fb",
    "a//b",
    "/leading",
    "trailing/",
    "key with spaces",
    "ünïcödé/ключ/😀",
    "K",
    "k",
    "~tilde",
    "k.json",
    "%",
]
VALUES = [
    '{"b": 1,  "a": [1, 2.5, "x"]}',
    '"text with / and %2F"',
    "0",
    "[]",
    "true",
    '"ü"',
    '{"nested": {}}',
]


def test_values_round_trip_verbatim_under_keys_with_slashes_spaces_and_unicode(
    common_io: Any, ours: S3StateStoreBackend, common_io_root: Path
) -> None:
    stored = {key: VALUES[i % len(VALUES)] for i, key in enumerate(KEYS)}

    def scenario(backend: Any) -> Any:
        scope = task_scope()
        before = [backend.get(scope, key) for key in KEYS]
        for key, value in stored.items():
            backend.set(scope, key, value)
        after = [backend.get(scope, key) for key in KEYS]
        backend.set(scope, "connector/offset", '{"offset": 2}')
        return before, after, backend.get(scope, "connector/offset"), backend.get(scope, "connector")

    assert both(common_io, ours, scenario) == (
        [None] * len(KEYS),
        [stored[key] for key in KEYS],
        '{"offset": 2}',
        None,  # "connector/offset" is not a folder "connector" holding "offset"
    )
    assert len([p for p in common_io_root.rglob("*") if p.is_file()]) == len(KEYS), (
        "common-io wrote into the directory configured for it, one object per key"
    )


def test_scopes_are_isolated(common_io: Any, ours: S3StateStoreBackend) -> None:
    scopes = [
        task_scope(),
        task_scope(dag_id="etl2"),  # a dag_id that starts with another's
        task_scope(dag_id="other"),
        task_scope(run_id="scheduled__2026-01-02T00:00:00+00:00"),
        task_scope(run_id="a/b"),
        task_scope(run_id="a%2Fb"),
        task_scope(run_id="a_b"),
        task_scope(task_id="load2"),
        task_scope(task_id="group.load"),
        task_scope(map_index=0),
        task_scope(map_index=1),
        task_scope(map_index=10),  # map=1 must not be a prefix of map=10
        asset_scope(name="orders"),
        asset_scope(name="orders2"),
        asset_scope(name="orders/eu"),
        asset_scope(uri="s3://lake/orders/"),
        asset_scope(uri="s3://lake/orders/eu/"),
        asset_scope(asset_id=7),
        asset_scope(asset_id=70),
    ]

    def scenario(backend: Any) -> Any:
        for n, scope in enumerate(scopes):
            backend.set(scope, "shared/key", str(n))
        everything = [backend.get(scope, "shared/key") for scope in scopes]
        backend.delete(scopes[0], "shared/key")
        backend.clear(scopes[12])  # the asset named "orders"
        return everything, [backend.get(scope, "shared/key") for scope in scopes]

    everything, after = both(common_io, ours, scenario)
    assert everything == [str(n) for n in range(len(scopes))]
    assert after == [None] + [str(n) for n in range(1, 12)] + [None] + [
        str(n) for n in range(13, len(scopes))
    ]


def test_delete_removes_one_key_and_a_missing_key_is_not_an_error(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    def scenario(backend: Any) -> Any:
        scope = task_scope()
        for key in ("a/b", "a_b", "a%2Fb", "a"):
            backend.set(scope, key, json.dumps(key))
        backend.delete(scope, "a/b")
        backend.delete(scope, "a/b")  # again: already gone
        backend.delete(scope, "never/set")
        backend.delete(task_scope(dag_id="never-run-dag"), "k")  # a scope with nothing in it
        backend.delete(asset_scope(name="never-written"), "k")
        return [backend.get(scope, key) for key in ("a/b", "a_b", "a%2Fb", "a")]

    assert both(common_io, ours, scenario) == [None, '"a_b"', '"a%2Fb"', '"a"']


def snapshot(backend: Any, scopes: list[Any], keys: list[str]) -> list[list[str | None]]:
    return [[backend.get(scope, key) for key in keys] for scope in scopes]


MAPPED = [task_scope(map_index=i) for i in (-1, 0, 1, 10)]
NEIGHBOURS = [task_scope(task_id="load2"), task_scope(run_id="other"), asset_scope(name="load")]


def test_clear_removes_one_map_index_then_all_and_never_a_neighbour(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    keys = ["x/k", "k2"]

    def scenario(backend: Any) -> Any:
        for scope in MAPPED + NEIGHBOURS:
            for key in keys:
                backend.set(scope, key, json.dumps(f"{key}@{getattr(scope, 'map_index', 'n')}"))
        backend.clear(task_scope(map_index=1))
        one = snapshot(backend, MAPPED + NEIGHBOURS, keys)
        backend.clear(task_scope(map_index=0), all_map_indices=True)
        every = snapshot(backend, MAPPED + NEIGHBOURS, keys)
        backend.clear(task_scope(dag_id="never"))  # nothing to clear is not an error
        backend.clear(task_scope(dag_id="never"), all_map_indices=True)
        return one, every

    one, every = both(common_io, ours, scenario)
    neighbours = [['"x/k@-1"', '"k2@-1"'], ['"x/k@-1"', '"k2@-1"'], ['"x/k@n"', '"k2@n"']]
    assert one == [
        ['"x/k@-1"', '"k2@-1"'],
        ['"x/k@0"', '"k2@0"'],
        [None, None],
        ['"x/k@10"', '"k2@10"'],
        *neighbours,
    ]
    assert every == [[None, None]] * 4 + neighbours


def test_asset_scopes_by_name_and_uri(common_io: Any, ours: S3StateStoreBackend) -> None:
    by_name, by_uri = asset_scope(name="orders/eu"), asset_scope(uri="s3://lake/orders/")
    other, same_named_task = asset_scope(name="orders"), task_scope(dag_id="orders", task_id="orders")

    def scenario(backend: Any) -> Any:
        for scope in (by_name, by_uri, other, same_named_task):
            backend.set(scope, "cursor/position", "1")
            backend.set(scope, "watermark", '"2026-01-01"')
        backend.delete(by_uri, "cursor/position")
        deleted = snapshot(
            backend, [by_name, by_uri, other, same_named_task], ["cursor/position", "watermark"]
        )
        backend.clear(by_name, all_map_indices=True)  # the flag has no effect on assets
        cleared = snapshot(
            backend, [by_name, by_uri, other, same_named_task], ["cursor/position", "watermark"]
        )
        return deleted, cleared

    full = ["1", '"2026-01-01"']
    assert both(common_io, ours, scenario) == (
        [full, [None, '"2026-01-01"'], full, full],
        [[None, None], [None, '"2026-01-01"'], full, full],
    )


def test_async_variants_behave_as_the_sync_ones(common_io: Any, ours: S3StateStoreBackend) -> None:
    async def scenario(backend: Any) -> Any:
        await asyncio.gather(*(backend.aset(s, "x/k", str(n)) for n, s in enumerate(MAPPED + NEIGHBOURS)))
        await backend.aset(asset_scope(name="orders"), "cursor/position", "5")
        got = await asyncio.gather(*(backend.aget(s, "x/k") for s in MAPPED + NEIGHBOURS))
        await backend.adelete(MAPPED[0], "x/k")
        await backend.adelete(MAPPED[0], "never/set")
        await backend.aclear(MAPPED[1])
        after_one = [await backend.aget(s, "x/k") for s in MAPPED + NEIGHBOURS]
        await backend.aclear(MAPPED[2], all_map_indices=True)
        await backend.aclear(asset_scope(name="orders"))
        after_all = [await backend.aget(s, "x/k") for s in MAPPED + NEIGHBOURS]
        return got, after_one, after_all, await backend.aget(asset_scope(name="orders"), "cursor/position")

    got, after_one, after_all, asset = both(common_io, ours, lambda backend: asyncio.run(scenario(backend)))
    assert got == ["0", "1", "2", "3", "4", "5", "6"]
    assert after_one == [None, None, "2", "3", "4", "5", "6"]
    assert after_all == [None, None, None, None, "4", "5", "6"]
    assert asset is None


def test_worker_side_references_round_trip_and_are_deterministic(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    """``[workers] state_store_backend``: the worker writes the value and Airflow's database keeps the ref.

    The references themselves differ (each backend names its own objects); what they resolve to must not.
    """

    def scenario(backend: Any) -> Any:
        scope, asset = task_scope(map_index=2), asset_scope(name="orders/eu")
        value = {"offset": 7, "files": ["a/b.csv", "ü.csv"]}
        ref = backend.serialize_task_state_store_to_ref(value=value, key="connector/offset", scope=scope)
        same = backend.serialize_task_state_store_to_ref(value=value, key="connector/offset", scope=scope)
        other = backend.serialize_task_state_store_to_ref(value=1, key="connector_offset", scope=scope)
        asset_ref = backend.serialize_asset_state_store_to_ref(value=[1, 2], key="cursor/pos", scope=asset)
        resolved = [
            backend.deserialize_task_state_store_from_ref(ref),
            backend.deserialize_task_state_store_from_ref(other),
            backend.deserialize_asset_state_store_from_ref(asset_ref),
        ]
        backend.delete(scope, "connector/offset")  # what Airflow calls on the worker after the database row
        return ref == same, ref != other, resolved, backend.deserialize_task_state_store_from_ref(ref)

    assert both(common_io, ours, scenario) == (
        True,
        True,
        [{"offset": 7, "files": ["a/b.csv", "ü.csv"]}, 1, [1, 2]],
        None,
    )


def test_an_expired_value_stays_readable_until_garbage_collection(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    """Airflow's contract: expiry is the GC's business; ``get`` of an expired value still returns it."""

    def scenario(backend: Any) -> Any:
        backend.set(task_scope(), "job/id", '"j-1"', expires_at=PAST)
        return backend.get(task_scope(), "job/id")

    assert both(common_io, ours, scenario) == '"j-1"'


# -- where they legitimately differ: each pinned on both sides ----------------------------------------------
def test_difference_a_value_that_is_not_json_text(common_io: Any, ours: S3StateStoreBackend) -> None:
    # Airflow always hands a backend JSON text. common-io stores whatever string it gets; ours refuses
    # anything else before writing, so a caller bypassing Airflow cannot plant a value Airflow cannot load.
    common_io.set(task_scope(), "k", "{not json")
    assert common_io.get(task_scope(), "k") == "{not json"
    with pytest.raises(InvalidValueError, match="not valid JSON"):
        ours.set(task_scope(), "k", "{not json")
    assert ours.get(task_scope(), "k") is None


def test_difference_expiry_is_kept_and_collected_by_ours_only(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    # common-io's set() drops expires_at and it has no cleanup() of its own (BaseStoreBackend's no-op), so
    # its values never expire. Ours records expires_at in the document and cleanup() deletes expired ones.
    for backend in (common_io, ours):
        backend.set(task_scope(), "old", '"o"', expires_at=PAST)
        backend.set(task_scope(), "kept", '"k"')
        backend.cleanup()
    assert (common_io.get(task_scope(), "old"), common_io.get(task_scope(), "kept")) == ('"o"', '"k"')
    assert (ours.get(task_scope(), "old"), ours.get(task_scope(), "kept")) == (None, '"k"')


def test_difference_the_keys_dot_and_dotdot(common_io: Any, ours: S3StateStoreBackend) -> None:
    # common-io refuses "." and ".." as path segments; Airflow's database backend accepts them as keys, and
    # so does ours (they become the object names "..json" and "...json", never a folder).
    for key in (".", ".."):
        with pytest.raises(ValueError, match="Invalid path segment"):
            common_io.set(task_scope(), key, "1")
        ours.set(task_scope(), key, json.dumps(key))
    assert [ours.get(task_scope(), key) for key in (".", "..")] == ['"."', '".."']


def test_difference_control_characters_in_keys(common_io: Any, ours: S3StateStoreBackend) -> None:
    # common-io percent-encodes them (line%0Abreak). Ours keeps refusing them (issue 11 keeps this check):
    # a key with a newline or a tab is almost always a bug, and it would make logs and listings ambiguous.
    common_io.set(task_scope(), "line\nbreak", "1")
    assert common_io.get(task_scope(), "line\nbreak") == "1"
    with pytest.raises(IdentityError, match="control character"):
        ours.set(task_scope(), "line\nbreak", "1")


def test_difference_long_keys(common_io: Any, ours: S3StateStoreBackend) -> None:
    # Ours refuses keys over 200 characters up front, naming the limit, on every store. common-io has no
    # limit of its own: on a local directory a key longer than a file name (255 bytes) fails in the OS.
    common_io.set(task_scope(), "k" * 220, "1")
    assert common_io.get(task_scope(), "k" * 220) == "1"
    with pytest.raises(OSError, match="too long"):
        common_io.set(task_scope(), "k" * 300, "1")
    for length in (220, 300):
        with pytest.raises(IdentityError, match=f"{length} characters; the limit is 200"):
            ours.set(task_scope(), "k" * length, "1")


def test_difference_asset_name_uri_and_id_share_a_folder_in_common_io(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    # common-io names an asset's folder by `name or uri or asset_id` alone, so the asset named "7" and the
    # asset with id 7, or an asset named "x" and one whose URI is "x", read each other's state. Ours keeps
    # name=, uri= and id= folders apart.
    pairs = [(asset_scope(name="7"), asset_scope(asset_id=7)), (asset_scope(name="x"), asset_scope(uri="x"))]
    for first, second in pairs:
        for backend in (common_io, ours):
            backend.set(first, "k", '"first"')
        assert common_io.get(second, "k") == '"first"'
        assert ours.get(second, "k") is None


def test_difference_a_dag_named_assets_shares_common_ios_asset_folder(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    # common-io puts task state at <base>/<dag_id>/<run_id>/<task_id>/<map_index>/<key> and asset state at
    # <base>/assets/<asset>/<key>: the task state of DAG "assets" in run "orders" lies inside the folder of
    # the asset named "orders". Clearing that asset then fails, and the asset key "t" cannot be written.
    # Ours keeps task and asset state under ~task-state/ and ~asset-state/.
    task, asset = task_scope(dag_id="assets", run_id="orders", task_id="t"), asset_scope(name="orders")
    for backend in (common_io, ours):
        backend.set(task, "k", '"task"')
        backend.set(asset, "w", '"asset"')
    with pytest.raises((ValueError, OSError)):
        common_io.clear(asset)
    with pytest.raises(OSError):
        common_io.set(asset, "t", '"asset key t"')
    ours.set(asset, "t", '"asset key t"')
    ours.clear(asset)
    assert [ours.get(asset, "w"), ours.get(asset, "t"), ours.get(task, "k")] == [None, None, '"task"']


def test_difference_only_ours_loads_as_the_server_side_backend(
    monkeypatch: pytest.MonkeyPatch, common_io_root: Path, tmp_path: Path
) -> None:
    # Airflow's API server loads [state_store] backend with issubclass(cls, airflow._shared.state.
    # BaseStoreBackend) and passes that module's scopes. common-io's class derives from the task SDK's copy
    # (airflow.sdk.state), a different class, and dispatches on the SDK's TaskScope: on Airflow 3.3 it works
    # on the worker side only. Ours registers with the core ABC and accepts both copies of the scopes.
    import airflow._shared.state as core_state
    from airflow.state import resolve_state_backend

    module = configure_common_io(monkeypatch, common_io_root)
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "ours").as_uri())
    core_scope = core_state.TaskScope(dag_id="etl", run_id=RUN_ID, task_id="load")
    try:
        monkeypatch.setenv("AIRFLOW__STATE_STORE__BACKEND", COMMON_IO_BACKEND)
        with pytest.raises(TypeError, match="not a subclass of `BaseStoreBackend`"):
            resolve_state_backend()
        with pytest.raises(TypeError, match="Unknown scope type"):
            module.StateStoreObjectStorageBackend().set(core_scope, "k", "1")

        monkeypatch.setenv("AIRFLOW__STATE_STORE__BACKEND", OUR_BACKEND)
        server = resolve_state_backend()()
        server.set(core_scope, "k", "1")
        assert server.get(task_scope(), "k") == "1"
    finally:
        forget_common_io_config(module)


def test_difference_a_reference_written_by_the_other_backend(
    common_io: Any, ours: S3StateStoreBackend
) -> None:
    # After a switch in the worker-side mode, Airflow's database still holds the old backend's references.
    # Ours refuses a reference outside its store with an error naming it (a silent None would make a task
    # start over from nothing); common-io takes a string that is not its reference for inline JSON and fails.
    theirs = common_io.serialize_asset_state_store_to_ref(value=5, key="wm", scope=asset_scope(name="a"))
    mine = ours.serialize_asset_state_store_to_ref(value=5, key="wm", scope=asset_scope(name="a"))
    with pytest.raises(ConfigurationError, match="does not point into this backend's store") as info:
        ours.deserialize_asset_state_store_from_ref(theirs)
    assert theirs in str(info.value)
    with pytest.raises(ValueError):  # json.JSONDecodeError
        common_io.deserialize_asset_state_store_from_ref(mine)


# -- the same DAG under dag.test(), each as the worker-side backend -----------------------------------------
PARITY_DAG = """\
from __future__ import annotations

from datetime import datetime

from airflow.sdk import Asset, dag, task

CURSOR = Asset(name="__DAG_ID___cursor", uri="file:///data/__DAG_ID__/cursor")


@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def flow():
    @task
    def sync(part, task_state_store=None):
        before = task_state_store.get("connector/offset")
        task_state_store.set("connector/offset", {"part": part, "offset": 10 * part})
        task_state_store.set("connector_offset", part)
        task_state_store.set("scratch/tmp", "temporary")
        task_state_store.delete("scratch/tmp")
        keys = ["connector/offset", "connector_offset", "scratch/tmp"]
        return {"before": before, "after": [task_state_store.get(k) for k in keys]}

    @task(outlets=[CURSOR])
    def advance(asset_state_store=None):
        before = asset_state_store.get("cursor/position", 0)
        asset_state_store.set("cursor/position", before + 1)
        return before

    sync.expand(part=[1, 2]) >> advance()


dag_object = flow()
"""


def run_parity_dag(dags_folder: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> tuple[str, list[Any]]:
    """Run the DAG twice with ``backend`` as ``[workers] state_store_backend``; what its tasks returned.

    A DAG id (and asset) of its own per backend, so one backend never reads the other's references.
    """
    monkeypatch.delenv("AIRFLOW__STATE_STORE__BACKEND", raising=False)
    monkeypatch.setenv("AIRFLOW__WORKERS__STATE_STORE_BACKEND", backend)
    forget_state_backends()
    dag_id = f"parity_{uuid.uuid4().hex[:8]}"
    path = dags_folder / f"{dag_id}.py"
    path.write_text(textwrap.dedent(PARITY_DAG).replace("__DAG_ID__", dag_id))
    try:
        dag = find_dag(load_dag_module(path))
        runs = [dag.test(), dag.test()]
    finally:
        path.unlink()  # later dag.test() calls of the session need not parse it
        forget_state_backends()
    assert [run.state for run in runs] == ["success", "success"]
    seen = [[returned(run, "sync"), returned(run, "advance")] for run in runs]
    return runs[0].run_id, [dag_id, *seen]


@pytest.mark.airflow
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_the_same_dag_sees_the_same_state_on_either_worker_side_backend(
    where: str,
    dags_folder: Path,
    common_io_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    module = configure_common_io(monkeypatch, common_io_root)
    try:
        theirs_run, (theirs_dag, *theirs) = run_parity_dag(dags_folder, monkeypatch, COMMON_IO_BACKEND)
    finally:
        forget_common_io_config(module)
    if where == "local":
        store: ObjectStore = LocalObjectStore(root=tmp_path / "ours", fsync=False)
        monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", store.url)
    else:
        request.getfixturevalue("s3_backend")  # [stateful] backend_url and conn_id on the S3 endpoint
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        store = endpoint.store(request.getfixturevalue("s3_prefix"))
    our_run, (our_dag, *mine) = run_parity_dag(dags_folder, monkeypatch, OUR_BACKEND)

    run_one = [
        [
            {"before": None, "after": [{"part": 1, "offset": 10}, 1, None]},
            {"before": None, "after": [{"part": 2, "offset": 20}, 2, None]},
        ],
        [0],
    ]
    run_two = [run_one[0], [1]]  # task state is per run; the asset's state outlived the first run
    assert mine == theirs == [run_one, run_two]

    # Each kept the key "connector/offset" as one object of its own layout, in its own store.
    theirs_file = (
        common_io_root / theirs_dag / quote(theirs_run, safe="") / "sync" / "1" / "connector%2Foffset"
    )
    assert json.loads(theirs_file.read_text()) == {"part": 2, "offset": 20}
    our_key = f"~task-state/{our_dag}/{quote(our_run, safe='-_.')}/sync/map=1/connector%2Foffset.json"
    assert json.loads(json.loads(store.get(our_key).data)["value"]) == {"part": 2, "offset": 20}
