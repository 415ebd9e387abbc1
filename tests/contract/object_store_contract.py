"""The contract every ObjectStore passes. Subclasses provide a ``store`` fixture (see test_local/test_s3)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from airflow_stateful.core.errors import (
    CheckpointCorruptError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    PreconditionFailedError,
)
from airflow_stateful.core.stores.base import CommonPrefix, ObjectInfo, ObjectStore

MIB = 1024 * 1024
FLEET = [
    *("a/~head.json", "a/~manifests/1.json", "a/~data/c/f", "a/~"),  # identity "a"
    *("a/b/~head.json", "a/b/~data/x"),  # identity "a/b", nested in "a"
    *("a-b/~head.json", "a.b/~head.json"),  # siblings that sort before "a/"
    *("q/~x/~y", "z/free", "top", "~task-state/doc"),  # a second "/~" in one key; keys of no identity
]


def once(keys: Iterable[str]) -> list[str]:
    """The listed keys sorted, after checking none was listed twice: a listing's order is the store's (S3's
    byte order, SeaweedFS's directory walk), but every key comes exactly once."""
    listed = list(keys)
    twice = sorted({k for k in listed if listed.count(k) > 1})
    assert not twice, f"listed more than once: {twice}"
    return sorted(listed)


def write_random(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        remaining = size
        while remaining:
            chunk = os.urandom(min(remaining, MIB))
            digest.update(chunk)
            fh.write(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()


class ObjectStoreContract:
    #: whether concurrent compare-and-swap is truly atomic on this store (not on threaded moto).
    atomic_cas = True

    def test_get_missing_raises_not_found(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFoundError, match="nothing-here"):
            store.get("a/nothing-here")

    def test_get_with_a_size_cap_refuses_a_larger_object_by_name(self, store: ObjectStore) -> None:
        store.put("a/record.json", b"x" * 1000)
        assert store.get("a/record.json", max_bytes=1000).data == b"x" * 1000
        with pytest.raises(
            ObjectTooLargeError, match=r"'a/record.json'.* 1000 bytes, more than the 999 bytes"
        ):
            store.get("a/record.json", max_bytes=999)
        with pytest.raises(ObjectNotFoundError):
            store.get("a/absent.json", max_bytes=10)

    def test_put_get_round_trip_and_etag_changes(self, store: ObjectStore) -> None:
        etag1 = store.put("a/b.json", b"one")
        blob = store.get("a/b.json")
        assert blob.data == b"one"
        assert blob.etag == etag1
        etag2 = store.put("a/b.json", b"two")
        assert etag2 != etag1
        assert store.get("a/b.json").data == b"two"

    def test_create_if_absent_refuses_existing_and_keeps_it(self, store: ObjectStore) -> None:
        store.put("k", b"first", if_none_match=True)
        with pytest.raises(PreconditionFailedError):
            store.put("k", b"second", if_none_match=True)
        assert store.get("k").data == b"first"

    def test_compare_and_swap(self, store: ObjectStore) -> None:
        etag = store.put("head", b"v1", if_none_match=True)
        new_etag = store.put("head", b"v2", if_match=etag)
        with pytest.raises(PreconditionFailedError):
            store.put("head", b"stale", if_match=etag)
        assert store.get("head").data == b"v2"
        assert store.get("head").etag == new_etag
        with pytest.raises(PreconditionFailedError):
            store.put("never-written", b"x", if_match=etag)
        with pytest.raises(ObjectNotFoundError):
            store.get("never-written")

    def test_concurrent_cas_has_exactly_one_winner(self, store: ObjectStore) -> None:
        if not self.atomic_cas:
            pytest.skip(
                "threaded moto (STATEFUL_TEST_MOTO_THREADED=1) checks If-Match without a lock; "
                "the default serialized moto, local and real S3 run this race"
            )
        for round_ in range(5):
            key = f"race/{round_}"
            etag = store.put(key, b"start", if_none_match=True)
            winners: list[int] = []
            barrier = threading.Barrier(8)

            def contend(
                i: int,
                key: str = key,
                etag: str = etag,
                winners: list[int] = winners,
                barrier: threading.Barrier = barrier,
            ) -> None:
                barrier.wait()
                try:
                    store.put(key, f"writer {i}".encode(), if_match=etag)
                    winners.append(i)
                except PreconditionFailedError:
                    pass

            threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(winners) == 1, f"round {round_}: {len(winners)} writers won a CAS on one ETag"
            assert store.get(key).data == f"writer {winners[0]}".encode()

    def test_concurrent_create_has_exactly_one_winner(self, store: ObjectStore) -> None:
        winners: list[int] = []
        barrier = threading.Barrier(6)

        def create(i: int) -> None:
            barrier.wait()
            try:
                store.put("once", f"{i}".encode(), if_none_match=True)
                winners.append(i)
            except PreconditionFailedError:
                pass

        threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1
        assert store.get("once").data == str(winners[0]).encode()

    def test_list_objects_is_prefix_filtered(self, store: ObjectStore) -> None:
        for key in ["x/b", "x/a/2", "x/a/1", "xy/c", "z"]:
            store.put(key, key.encode())
        assert once(i.key for i in store.list_objects("x/")) == ["x/a/1", "x/a/2", "x/b"]
        assert once(i.key for i in store.list_objects("x")) == ["x/a/1", "x/a/2", "x/b", "xy/c"]
        sizes = {i.key: i.size for i in store.list_objects("")}
        assert sizes["xy/c"] == 4
        assert list(store.list_objects("nothing/")) == []

    def test_list_objects_lists_every_key_once_whatever_order_the_server_walks(
        self, store: ObjectStore
    ) -> None:
        """Keys that a directory walk and S3's byte order put in different orders (``a/b`` and ``a-b``): every
        one is listed, exactly once, with and without a prefix. The order is the store's, so it is not compared
        here (the local store's own tests check its byte order)."""
        keys = ["a/b", "a.txt", "a-b", "a0", "a/c/d", "b", "A"]
        for key in keys:
            store.put(key, b"x")
        assert once(i.key for i in store.list_objects("")) == sorted(keys)
        assert once(i.key for i in store.list_objects("a")) == sorted(k for k in keys if k.startswith("a"))

    def test_delimited_listing_rolls_every_key_past_the_delimiter_into_one_entry(
        self, store: ObjectStore
    ) -> None:
        """S3's ListObjectsV2 with a Delimiter (any string): one entry per common prefix, beside the objects
        that hold no delimiter after the prefix, each prefix once however many keys it covers (across pages
        too)."""
        for key in FLEET:
            store.put(key, b"x")

        def listed(prefix: str, delimiter: str = "/~") -> list[str]:
            return once(
                f"{e.prefix}*" if isinstance(e, CommonPrefix) else e.key
                for e in store.list_delimited(prefix, delimiter)
            )

        assert listed("") == [
            "a-b/~*",
            "a.b/~*",
            "a/b/~*",
            "a/~*",
            "q/~*",
            "top",
            "z/free",
            "~task-state/doc",
        ]
        # Past the prefix only: the identity that "a/" names lists its own objects; nested ones roll up.
        assert listed("a/") == ["a/b/~*", "a/~", "a/~data/c/f", "a/~head.json", "a/~manifests/1.json"]
        assert listed("a") == ["a-b/~*", "a.b/~*", "a/b/~*", "a/~*"]
        assert listed("a/b/~") == ["a/b/~data/x", "a/b/~head.json"]
        assert listed("", "/") == ["a-b/*", "a.b/*", "a/*", "q/*", "top", "z/*", "~task-state/*"]
        assert listed("a/", "/") == ["a/b/*", "a/~", "a/~data/*", "a/~head.json", "a/~manifests/*"]
        assert listed("nothing/") == []
        sizes = {e.key: e.size for e in store.list_delimited("", "/~") if isinstance(e, ObjectInfo)}
        assert sizes["z/free"] == 1
        with pytest.raises(ValueError, match="delimiter"):
            list(store.list_delimited("", ""))

    def test_delimited_listing_matches_the_full_listing_rolled_up(self, store: ObjectStore) -> None:
        """Whatever the store does to save work, its answer is the full listing with the rule applied."""
        for key in FLEET:
            store.put(key, b"x")

        def entries(listing: Iterable[ObjectInfo | CommonPrefix]) -> list[str]:
            return once(e.prefix + "*" if isinstance(e, CommonPrefix) else e.key for e in listing)

        for prefix in ("", "a", "a/", "a/~", "a/b", "q/~x", "~"):
            for delimiter in ("/~", "/", "~", "b/", "/~d"):
                expected = entries(ObjectStore.list_delimited(store, prefix, delimiter))
                assert entries(store.list_delimited(prefix, delimiter)) == expected, (prefix, delimiter)

    def test_delete_and_delete_many(self, store: ObjectStore) -> None:
        for key in ["d/1", "d/2", "d/3"]:
            store.put(key, b"x")
        store.delete("d/1")
        store.delete("d/1")  # missing is fine
        store.delete_many(["d/2", "d/3", "d/never"])
        assert list(store.list_objects("d/")) == []

    def test_conditional_delete(self, store: ObjectStore) -> None:
        etag = store.put("cd", b"1")
        store.put("cd", b"2")
        with pytest.raises(PreconditionFailedError):
            store.delete("cd", if_match=etag)
        assert store.get("cd").data == b"2"
        store.delete("cd", if_match=store.get("cd").etag)
        with pytest.raises(ObjectNotFoundError):
            store.get("cd")

    @pytest.mark.parametrize("size", [0, 1000, 12 * MIB + 123])
    def test_file_round_trip_is_byte_identical(self, store: ObjectStore, tmp_path: Path, size: int) -> None:
        src = tmp_path / "src.bin"
        expected = write_random(src, size)
        stored = store.upload_file("files/f", src)
        assert (stored.size, stored.sha256) == (size, expected)
        dest = tmp_path / "out" / "dest.bin"
        store.download_file("files/f", dest, size=size, sha256=expected)
        assert hashlib.sha256(dest.read_bytes()).hexdigest() == expected
        assert [p.name for p in dest.parent.iterdir()] == ["dest.bin"], "no temporary files may be left"

    def test_upload_file_is_create_if_absent(self, store: ObjectStore, tmp_path: Path) -> None:
        src, other = tmp_path / "src.bin", tmp_path / "other.bin"
        expected = write_random(src, 100)
        write_random(other, 100)
        store.upload_file("files/once", src)
        with pytest.raises(PreconditionFailedError):
            store.upload_file("files/once", other)
        dest = tmp_path / "dest.bin"
        store.download_file("files/once", dest, size=100, sha256=expected)
        assert dest.read_bytes() == src.read_bytes()

    @pytest.mark.parametrize("size", [2000, 12 * MIB + 5])
    def test_download_of_corrupt_object_names_it_and_writes_nothing(
        self, store: ObjectStore, tmp_path: Path, size: int
    ) -> None:
        src = tmp_path / "src.bin"
        expected = write_random(src, size)
        store.upload_file("files/c", src)
        data = bytearray(src.read_bytes())
        data[size // 2] ^= 0xFF  # one flipped bit-pattern in the middle
        store.put("files/c", bytes(data))
        dest = tmp_path / "out" / "dest.bin"
        with pytest.raises(CheckpointCorruptError, match="files/c"):
            store.download_file("files/c", dest, size=size, sha256=expected)
        assert not dest.exists()
        assert list(dest.parent.iterdir()) == [], "no partial file may be left"
        # Truncated and extended objects are corrupt too.
        store.put("files/c", bytes(data[: size - 10]))
        with pytest.raises(CheckpointCorruptError, match="files/c"):
            store.download_file("files/c", dest, size=size, sha256=expected)
        store.put("files/c", src.read_bytes() + b"extra")
        with pytest.raises(CheckpointCorruptError, match="files/c"):
            store.download_file("files/c", dest, size=size, sha256=expected)
        assert not dest.exists()
