"""Cursors people can trust: ``resume(iterable, key=...)``, fingerprints, and what a changed iterable does.

Most tests drive TaskState over a real WriterSession on a local store (each "try" a new session taking the
lease, as a retry does); the ones where Airflow decides about a retry run a real DAG with ``dag.test()``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_stateful_tasks import checkpoints, run_dag, task_instance, write_dag

from airflow_stateful.core import CheckpointStore, Identity, WriterInfo
from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    CursorMismatchError,
    IncompatibleStateError,
    InvalidValueError,
    StopRequested,
)
from airflow_stateful.core.protocol.session import WriterSession
from airflow_stateful.core.records.cursors import Cursor, cursor_position, parse_cursors
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.task_state import TaskState

IDENTITY = Identity.parse("d/t/run=r/map=-1")


class Crash(Exception):
    """What a try dies of in these tests."""


def open_state(root: Path, *, try_number: int = 1, every: int = 1, **session: Any) -> TaskState:
    cs = CheckpointStore(store=LocalObjectStore(root=root), identity=IDENTITY)
    writer = WriterInfo(run_id="r", try_number=try_number)
    opened = WriterSession(checkpoints=cs, writer=writer, heartbeat=False, **session).open()
    return TaskState(session=opened, checkpoint_every=every)


def latest_cursors(root: Path) -> dict[str, Any]:
    latest = CheckpointStore(store=LocalObjectStore(root=root), identity=IDENTITY).latest()
    assert latest is not None
    return dict(latest.extra["cursors"])


def run(
    state: TaskState, items: Iterable[Any], *, crash_after: int | None = None, **kwargs: Any
) -> list[Any]:
    """The items the loop body got; with ``crash_after=n`` the try dies while doing its (n+1)th item."""
    done: list[Any] = []
    try:
        for item in state.resume(items, **kwargs):
            if crash_after is not None and len(done) == crash_after:
                raise Crash(f"crashed at {item!r}")
            done.append(item)
    except Crash:
        pass
    return done


def rows(*ids: int) -> list[dict[str, Any]]:
    return [{"id": f"row-{i}", "n": i} for i in ids]


def by_id(row: dict[str, Any]) -> str:
    return str(row["id"])


def ids(done: list[dict[str, Any]]) -> list[str]:
    return [r["id"] for r in done]


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "airflow_stateful"]


# -- resuming by key -----------------------------------------------------------------------------------------


def test_key_resume_goes_on_right_after_the_last_finished_key_where_the_position_would_lose_rows(
    tmp_path: Path,
) -> None:
    first, changed = rows(*range(10)), rows(3, 4, 7, 5, 6, 8, 9)  # rows 0-2 deleted, the rest reordered
    by_key, by_position = tmp_path / "key", tmp_path / "position"
    assert ids(run(open_state(by_key), first, key=by_id, crash_after=5)) == [f"row-{i}" for i in range(5)]
    assert latest_cursors(by_key)["items"]["last_key"] == "row-4"
    assert latest_cursors(by_key)["items"]["position"] == 5
    resumed = ids(run(open_state(by_key, try_number=2), changed, key=by_id))
    assert resumed == ["row-7", "row-5", "row-6", "row-8", "row-9"], "every unfinished row, none redone"

    run(open_state(by_position), first, crash_after=5)
    with pytest.raises(CursorMismatchError):  # the fingerprint of the first rows no longer matches
        run(open_state(by_position, try_number=2), changed)
    positional = ids(run(open_state(by_position, try_number=3), changed, on_change="warn"))
    assert positional == ["row-8", "row-9"], "what counting positions does: rows 5, 6 and 7 are lost"
    assert set(resumed) - set(positional) == {"row-5", "row-6", "row-7"}


def test_key_resume_records_the_position_in_this_iterable_and_the_last_key(tmp_path: Path) -> None:
    run(open_state(tmp_path), rows(*range(6)), key=by_id, crash_after=4)
    state = open_state(tmp_path, try_number=2)
    assert ids(run(state, rows(2, 3, 4, 5, 6), key=by_id)) == ["row-4", "row-5", "row-6"]
    record = latest_cursors(tmp_path)["items"]
    assert (record["position"], record["last_key"]) == (5, "row-6"), (
        "index after the last key, in this iterable"
    )
    assert record["fingerprint"]["items"] == 5


def test_an_item_inserted_before_the_last_key_is_refused_or_with_warn_taken_as_done(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(open_state(tmp_path), rows(1, 2, 3, 4, 5), key=by_id, crash_after=3)
    inserted = rows(0, 1, 2, 3, 4, 5, 6)  # row-0 is new, before the last finished key (row-3)
    with pytest.raises(
        CursorMismatchError, match=r"key 'row-3' is item 3 now, but only 3 items were finished"
    ):
        run(open_state(tmp_path, try_number=2), inserted, key=by_id)
    caplog.set_level(logging.INFO, logger="airflow_stateful")
    done = ids(run(open_state(tmp_path, try_number=3), inserted, key=by_id, on_change="warn"))
    assert done == ["row-4", "row-5", "row-6"], "documented: the items before the last key are taken as done"
    [warning] = messages(caplog, logging.WARNING)
    assert "at least 1 item(s) before it are new" in warning and "taking them as done" in warning


def test_a_missing_last_key_is_refused_or_with_warn_restarts_from_the_first_item(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(open_state(tmp_path), rows(1, 2, 3, 4), key=by_id, crash_after=2)
    gone = rows(3, 4, 5)  # row-2, the last finished key, was deleted
    with pytest.raises(CursorMismatchError) as refused:
        run(open_state(tmp_path, try_number=2), gone, key=by_id)
    message = str(refused.value)
    assert "cursor 'items'" in message and "'row-2'" in message and "checkpoint 2" in message
    assert "on_change='warn'" in message and "not among the 3 items" in message
    assert isinstance(refused.value, IncompatibleStateError)
    caplog.set_level(logging.INFO, logger="airflow_stateful")
    assert ids(run(open_state(tmp_path, try_number=3), gone, key=by_id, on_change="warn")) == [
        "row-3",
        "row-4",
        "row-5",
    ]
    [warning] = messages(caplog, logging.WARNING)
    assert "starting again from the first item" in warning


def test_a_duplicate_of_the_last_key_makes_the_loop_redo_items_never_skip_them(tmp_path: Path) -> None:
    run(open_state(tmp_path), ["a", "b", "a", "c"], key=str, crash_after=3)  # a, b, a finished
    assert run(open_state(tmp_path, try_number=2), ["a", "b", "a", "c"], key=str) == ["b", "a", "c"]


def test_a_key_cursor_with_other_first_keys_only_informs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(open_state(tmp_path), rows(*range(10)), key=by_id, crash_after=9)
    caplog.set_level(logging.INFO, logger="airflow_stateful")
    done = ids(run(open_state(tmp_path, try_number=2), rows(5, 6, 7, 8, 9), key=by_id))
    assert done == ["row-9"]
    assert not messages(caplog, logging.WARNING)
    assert any(
        "first 8 keys of the iterable are not those of checkpoint 9" in m
        for m in messages(caplog, logging.INFO)
    )


# -- positional cursors and their fingerprint ------------------------------------------------------------------


def test_a_positional_cursor_over_changed_first_items_is_refused_naming_the_cursor_and_suggesting_key(
    tmp_path: Path,
) -> None:
    run(open_state(tmp_path), list(range(20)), crash_after=12, cursor="numbers")
    assert latest_cursors(tmp_path)["numbers"]["fingerprint"]["items"] == 8
    with pytest.raises(CursorMismatchError) as refused:
        run(open_state(tmp_path, try_number=2), [100, *range(20)], cursor="numbers")
    message = str(refused.value)
    assert "cursor 'numbers'" in message and "stored position 12" in message and "key=" in message
    assert "first 8 items of the iterable are not those of checkpoint 12" in message
    assert latest_cursors(tmp_path)["numbers"]["position"] == 12, (
        "refused before doing or committing anything"
    )


def test_on_change_warn_logs_one_warning_and_resumes_at_the_position(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(open_state(tmp_path), list(range(20)), crash_after=12)
    caplog.set_level(logging.INFO, logger="airflow_stateful")
    done = run(open_state(tmp_path, try_number=2), list(range(20))[::-1], on_change="warn")
    assert done == list(range(7, -1, -1)), "the reversed list from index 12 on"
    [warning] = messages(caplog, logging.WARNING)
    assert "cursor 'items'" in warning and "resuming at stored position 12 anyway" in warning


def test_an_unchanged_iterable_resumes_and_a_shorter_first_run_is_checked_over_what_it_had(
    tmp_path: Path,
) -> None:
    run(open_state(tmp_path), list(range(20)), crash_after=12)
    assert run(open_state(tmp_path, try_number=2), list(range(20))) == list(range(12, 20))
    short = tmp_path / "short"
    run(open_state(short), ["a", "b", "c"], crash_after=2)
    assert latest_cursors(short)["items"]["fingerprint"]["items"] == 2, "never more items than were finished"
    assert run(open_state(short, try_number=2), ["a", "b", "c", "d"]) == ["c", "d"], "appended items are fine"
    with pytest.raises(CursorMismatchError, match="it has only 1"):
        run(open_state(short, try_number=3), ["a"])


def test_items_without_a_stable_encoding_store_no_fingerprint_and_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Row:  # its repr shows a memory address: different in every process
        def __init__(self, n: int) -> None:
            self.n = n

    caplog.set_level(logging.INFO, logger="airflow_stateful")
    run(open_state(tmp_path), [Row(n) for n in range(5)], crash_after=3)
    record = latest_cursors(tmp_path)["items"]
    assert record == {"position": 3, "last_key": None, "fingerprint": None}
    [info] = [m for m in messages(caplog, logging.INFO) if "no stable encoding" in m]
    assert "item 0 (Row)" in info and "pass key=" in info
    resumed = run(open_state(tmp_path, try_number=2), [Row(n) for n in range(5)])
    assert [r.n for r in resumed] == [3, 4], "resumed by position, unchecked"

    keyed = tmp_path / "keyed"
    run(open_state(keyed), [Row(n) for n in range(5)], key=lambda r: r.n, crash_after=3)
    assert latest_cursors(keyed)["items"]["fingerprint"]["items"] == 3, "with key= the keys are fingerprinted"


def test_sets_and_other_stable_objects_are_fingerprinted_or_not_as_documented(tmp_path: Path) -> None:
    from datetime import date

    from airflow_stateful.core.protocol.resume import item_digest

    assert item_digest({"b": [1, 2.5], "a": None}) == item_digest({"a": None, "b": (1, 2.5)})
    assert item_digest(1) != item_digest(True) != item_digest("1")
    assert item_digest(date(2026, 1, 2)) == item_digest(date(2026, 1, 2)) != item_digest(date(2026, 1, 3))
    assert item_digest({"a", "b"}) is None, "a set's order follows the hash seed"
    assert item_digest(object()) is None


# -- legacy records, migrations, stops --------------------------------------------------------------------------


def test_legacy_int_cursors_still_resume_and_then_store_the_new_record(tmp_path: Path) -> None:
    cs = CheckpointStore(store=LocalObjectStore(root=tmp_path), identity=IDENTITY)
    writer = WriterInfo(run_id="r", try_number=1)
    cs.commit(cs.acquire(holder=writer), 0, writer=writer, extra={"cursors": {"items": 4, "pages": 2}})
    assert cursor_position(cs.latest(), "items") == 4
    assert run(open_state(tmp_path, try_number=2), range(10)) == [4, 5, 6, 7, 8, 9]
    stored = latest_cursors(tmp_path)
    assert stored["pages"] == {"position": 2, "last_key": None, "fingerprint": None}, (
        "the other loop's, as read"
    )
    assert stored["items"]["position"] == 10 and stored["items"]["fingerprint"]["items"] == 8
    assert cursor_position(cs.latest(), "items") == 10 and cursor_position(cs.latest(), "nope") is None
    # A loop that gained key= resumes a position-only cursor by position once, then by key.
    assert run(open_state(tmp_path, try_number=3), ["p0", "p1", "p2", "p3"], cursor="pages", key=str) == [
        "p2",
        "p3",
    ]
    assert latest_cursors(tmp_path)["pages"]["last_key"] == "p3"


def test_the_fingerprint_check_still_applies_after_a_migration(tmp_path: Path) -> None:
    run(open_state(tmp_path), list(range(20)), crash_after=6)
    upgraded: dict[str, Any] = {"schema_version": 2, "migrations": {1: lambda value: {"v1": value}}}
    with pytest.raises(CursorMismatchError, match="stored position 6"):
        run(open_state(tmp_path, try_number=2, **upgraded), [*range(20)][::-1])
    migrated = CheckpointStore(store=LocalObjectStore(root=tmp_path), identity=IDENTITY).latest()
    assert (
        migrated is not None
        and migrated.schema_version == 2
        and migrated.extra["cursors"]["items"]["position"] == 6
    )
    assert run(open_state(tmp_path, try_number=3, **upgraded), list(range(20)))[:2] == [6, 7], (
        "unchanged: resumes"
    )


def test_a_stop_commits_the_position_and_the_last_finished_key(tmp_path: Path) -> None:
    state = open_state(tmp_path, every=100)
    seen = []
    with pytest.raises(StopRequested, match="after 3 items"):
        for row in state.resume(rows(*range(10)), key=by_id):
            seen.append(row["id"])
            if len(seen) == 3:
                state.request_stop()
    record = latest_cursors(tmp_path)["items"]
    assert (record["position"], record["last_key"]) == (3, "row-2")
    assert ids(run(open_state(tmp_path, try_number=2), rows(*range(10)), key=by_id))[0] == "row-3"


# -- one-shot iterators -------------------------------------------------------------------------------------------


class Counted:
    """A generator over ``items`` that counts how many were read from it."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items, self.read = list(items), 0

    def __iter__(self) -> Iterator[Any]:
        return self.gen()

    def gen(self) -> Iterator[Any]:
        for item in self.items:
            self.read += 1
            yield item


def test_a_generator_is_read_once_item_by_item_and_nothing_is_lost(tmp_path: Path) -> None:
    source = Counted(range(20))
    gen = iter(source)
    loop = open_state(tmp_path).resume(gen)
    assert next(loop) == 0 and source.read == 1, "no read-ahead for the fingerprint"
    assert next(loop) == 1 and source.read == 2
    loop.close()
    other = tmp_path / "other"
    run(open_state(other), iter(Counted(range(20))), crash_after=10)
    resumed_source = Counted(range(20))
    resumed = open_state(other, try_number=2).resume(iter(resumed_source))
    assert next(resumed) == 10 and resumed_source.read == 11, (
        "the 10 finished items skipped, the 11th yielded"
    )
    assert list(resumed) == list(range(11, 20)) and resumed_source.read == 20


def test_a_generator_whose_last_key_is_gone_is_replayed_from_memory_under_warn(tmp_path: Path) -> None:
    run(open_state(tmp_path), rows(1, 2, 3), key=by_id, crash_after=2)
    source = Counted(rows(5, 6, 7))
    assert ids(run(open_state(tmp_path, try_number=2), iter(source), key=by_id, on_change="warn")) == [
        "row-5",
        "row-6",
        "row-7",
    ]
    assert source.read == 3, "each item read once from the generator, none lost"


# -- arguments ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key": 5}, r"key= must be a function .* not 5"),
        ({"key": b"id"}, r"not b'id'"),
        ({"on_change": "skip"}, r"on_change must be one of 'fail', 'warn', not 'skip'"),
        ({"cursor": ""}, r"cursor must be a string of 1-200 characters, not ''"),
        ({"key": "a", "cursor": "b"}, r"key='a' and cursor='b'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidValueError, match=match):
        run(open_state(tmp_path), range(3), **kwargs)


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (lambda n: n / 2, r"key= of item 0 returned a float"),
        (lambda n: n > 1, r"key= of item 0 returned a bool"),
        (lambda n: None, r"key= of item 0 returned a NoneType"),
        (
            lambda n: "x" * 1001 if n == 2 else str(n),
            r"key= of item 2 is a str of 1001 characters; at most 1000",
        ),
        (lambda n: 2**63 if n else 0, r"key= of item 1 is an int outside"),
    ],
)
def test_a_key_of_a_bad_type_is_refused_naming_the_item(
    tmp_path: Path, key: Callable[[int], Any], match: str
) -> None:
    with pytest.raises(InvalidValueError, match=match):
        run(open_state(tmp_path), range(3), key=key)


def test_a_string_key_still_names_the_cursor_with_a_deprecation_warning(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"pass cursor='download' instead"):
        assert run(open_state(tmp_path), range(3), key="download") == [0, 1, 2]
    assert set(latest_cursors(tmp_path)) == {"download"}
    assert run(open_state(tmp_path, try_number=2), range(3), cursor="download") == []


# -- reading records back ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cursors", "match"),
    [
        ({"items": True}, r"cursor 'items' is not a JSON object"),
        ({"items": {"position": -1}}, r"field 'position' must be an integer from 0"),
        (
            {"items": {"position": 3, "last_key": "k" * 1001}},
            r"field 'last_key' must be a string of at most 1000",
        ),
        ({"items": {"position": 3, "last_key": 1.5}}, r"'last_key' must be a string or an integer"),
        ({"items": {"position": 3, "fingerprint": {"items": 4, "sha256": "0" * 64}}}, r"from 1 to 3"),
        ({"items": {"position": 3, "fingerprint": {"items": 2, "sha256": "xyz"}}}, r"'sha256' must be"),
        ({f"c{n}": 1 for n in range(51)}, r"at most 50 cursors"),
        ({"": 1}, r"a cursor name must be 1-200 characters"),
    ],
)
def test_malformed_cursor_records_are_refused_naming_the_checkpoint(
    cursors: dict[str, Any], match: str
) -> None:
    with pytest.raises(CheckpointCorruptError, match=match) as refused:
        parse_cursors({"cursors": cursors}, what="checkpoint 7")
    assert str(refused.value).startswith("checkpoint 7")


def test_both_record_shapes_read_back() -> None:
    record = {"position": 30, "last_key": 29, "fingerprint": {"items": 8, "sha256": "a" * 64}}
    parsed = parse_cursors({"cursors": {"legacy": 4, "items": record}}, what="checkpoint 1")
    assert parsed["legacy"] == Cursor(position=4)
    assert parsed["items"].to_json() == record and json.loads(json.dumps(record)) == record
    assert parsed["items"].describe() == "30 (last 29)"


# -- under Airflow: a changed iterable fails the try without a retry ------------------------------------------------

CHANGED = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=3, retry_delay=timedelta(0), checkpoint_every=1)
    def work(state: TaskState):
        ti = current_ti()
        numbers = list(range(10)) if ti.try_number == 1 else list(range(10))[::-1]
        for n in state.resume(numbers):
            if ti.try_number == 1 and n == 5:
                raise RuntimeError("try 1 dies while doing item 5")
            record(ti.try_number, n)

    work()


dag_object = the_dag()
"""

KEYED = """\
@dag(dag_id="__DAG_ID__", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def the_dag():
    @stateful_task(retries=1, retry_delay=timedelta(0), checkpoint_every=1)
    def work(state: TaskState):
        ti = current_ti()
        ids = list(range(10)) if ti.try_number == 1 else [3, 4, 7, 5, 6, 8, 9, 10]
        for row in state.resume([{"id": i} for i in ids], key=lambda row: row["id"]):
            if ti.try_number == 1 and row["id"] == 5:
                raise RuntimeError("try 1 dies while doing row 5")
            record(ti.try_number, row["id"])

    work()


dag_object = the_dag()
"""


@pytest.mark.airflow
def test_a_changed_iterable_under_a_positional_cursor_fails_the_airflow_try_without_a_retry(
    dags_folder: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import airflow  # noqa: F401 - imported before capfd captures, as tests/test_stateful_tasks.py explains

    capfd.readouterr()
    dag_file = write_dag(dags_folder, tmp_path, CHANGED)
    _, dag_run = run_dag(dag_file)
    assert dag_run.state == "failed"
    ti = task_instance(dag_run, "work")
    assert ti.state == "failed" and ti.try_number == 2, "failed on try 2, not up_for_retry: no try 3"
    assert [r[0] for r in dag_file.rows()] == [1] * 5, "try 2 did no item"
    log = "".join(capfd.readouterr())
    assert "AirflowFailException" in log
    assert "cursor 'items': the first 5 items of the iterable are not those of checkpoint 5" in log
    assert "resuming at stored position 5 would skip the wrong items" in log
    latest = checkpoints(dag_file.dag_id, "work", run_id=dag_run.run_id).latest()
    assert latest is not None and cursor_position(latest) == 5


@pytest.mark.airflow
def test_key_resume_under_airflow_does_exactly_the_unfinished_rows(dags_folder: Path, tmp_path: Path) -> None:
    dag_file = write_dag(dags_folder, tmp_path, KEYED)
    _, dag_run = run_dag(dag_file)
    assert dag_run.state == "success"
    done: dict[int, list[int]] = {1: [], 2: []}
    for try_number, row_id in dag_file.rows():
        done[try_number].append(row_id)
    assert done == {1: [0, 1, 2, 3, 4], 2: [7, 5, 6, 8, 9, 10]}
    latest = checkpoints(dag_file.dag_id, "work", run_id=dag_run.run_id).latest()
    assert latest is not None
    assert latest.extra["cursors"]["items"]["last_key"] == 10 and cursor_position(latest) == 8
