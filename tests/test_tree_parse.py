"""The tree reader's fast path accepts exactly what the full reader accepts, with the same result (issue 32).

A re-save of 10,000 small files parses the previous tree first, and the full reader (a :class:`Fields` and an
error context per file and per chunk, a regular expression built per chunk) took about a third of that re-save.
``_quick_file`` reads an entry of the shape this library writes with the same checks and no per-chunk set-up,
and hands anything else to the full reader. Its only risk is accepting what the full reader refuses, or reading
it differently: each entry here, written ones and hundreds of corrupted ones (every field of every kind of
entry set to a wrong type, out of bounds, of another identity, of another content, removed, or with extra
keys), goes through both readers.
"""

from __future__ import annotations

import copy
import hashlib
import random
from typing import Any

import pytest

from airflow_stateful.core.errors import CheckpointCorruptError
from airflow_stateful.core.records import trees
from airflow_stateful.core.records.canonical import canonical_json
from airflow_stateful.core.records.trees import ChunkRef, Tree, TreeFile, chunk_key, pack_key

IDENTITY = "etl/crunch/run=manual__1/map=-1"
OTHER = "etl/crunch/run=manual__10/map=-1"


def sha(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def written_entries() -> list[dict[str, Any]]:
    """Entries as the library writes them: packed, unpacked, unique-suffixed, several chunks, empty, modes."""
    pack = pack_key(IDENTITY, "a" * 32, 3)
    files = [
        TreeFile(
            path="a.txt", size=10, chunks=(ChunkRef(key=pack, sha256=sha(1), size=10, offset=0),), mode=0o644
        ),
        TreeFile(
            path="b/c.bin", size=5, chunks=(ChunkRef(key=chunk_key(IDENTITY, sha(2)), sha256=sha(2), size=5),)
        ),
        TreeFile(
            path="d.bin",
            size=7,
            chunks=(
                ChunkRef(key=chunk_key(IDENTITY, sha(3), unique="b" * 32), sha256=sha(3), size=3),
                ChunkRef(key=pack, sha256=sha(4), size=4, offset=10),
            ),
            mode=0o755,
        ),
        TreeFile(path="empty", size=0, chunks=(), mode=0),
        TreeFile(
            path="seen.bin",
            size=4,
            chunks=(ChunkRef(key=pack, sha256=sha(5), size=4, offset=14),),
            mode=0o600,
            seen=(2049, 1234567, 1733561000123456789, -5),
        ),
    ]
    return [f.to_json() for f in files]


WRONG_VALUES: list[Any] = [
    None, True, False, -1, 0, 1, 2**60, 1.5, "", "x", "\x00", [], {}, "a" * 5000,
    sha(9), chunk_key(IDENTITY, sha(9)), chunk_key(OTHER, sha(1)), pack_key(OTHER, "a" * 32, 3),
    pack_key(IDENTITY, "a" * 32, 3) + "\n", pack_key(IDENTITY, "A" * 32, 3), 0o1777, 2**40, 2**53,
    [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, True], [1, 2, 3, "4"], [1, 2, 3, 4.0], [-1, 2, 3, 4], [1, 2**64, 3, 4],
    [1, 2, 2**63, 4], [1, 2, 3, -(2**63) - 1], [None, 2, 3, 4], [1, 2, 3, 4],
]  # fmt: skip


def mutations(entry: dict[str, Any]) -> list[Any]:
    """Every field of the entry and of each chunk set to every wrong value, removed, and the entry with an
    extra key (ignored by both) or not an object at all."""
    out: list[Any] = [None, [], "entry", 7]
    for field in list(entry):
        for value in WRONG_VALUES:
            bad = copy.deepcopy(entry)
            bad[field] = value
            out.append(bad)
        gone = copy.deepcopy(entry)
        del gone[field]
        out.append(gone)
    for n, chunk in enumerate(entry["chunks"]):
        for field in [*chunk, "pack", "offset", "key"]:
            for value in WRONG_VALUES:
                bad = copy.deepcopy(entry)
                bad["chunks"][n][field] = value
                out.append(bad)
            gone = copy.deepcopy(entry)
            gone["chunks"][n].pop(field, None)
            out.append(gone)
        swapped = copy.deepcopy(entry)
        swapped["chunks"][n] = "chunk"
        out.append(swapped)
    extra = copy.deepcopy(entry)
    extra["later_field"] = {"anything": 1}
    out.append(extra)
    return out


def full_reader(entry: Any) -> TreeFile | None:
    try:
        return TreeFile.from_json(entry, identity=IDENTITY, what="tree 'k' file 0")
    except CheckpointCorruptError:
        return None


@pytest.mark.parametrize("n", range(len(written_entries())))
def test_written_entries_take_the_fast_path_with_the_full_readers_result(n: int) -> None:
    entry = written_entries()[n]
    quick = trees._quick_file(entry, identity=IDENTITY)
    assert quick is not None, f"a written entry left the fast path: {entry}"
    assert quick == full_reader(entry)


def test_no_corrupted_entry_is_read_by_the_fast_path_unless_the_full_reader_reads_it_the_same() -> None:
    checked = accepted = 0
    for entry in written_entries():
        for bad in mutations(entry):
            quick = trees._quick_file(bad, identity=IDENTITY)
            full = full_reader(bad)
            if quick is not None:
                assert quick == full, f"the fast path read {bad!r} as {quick}, the full reader as {full}"
                accepted += 1
            checked += 1
    assert checked > 1000 and accepted > 0  # extra keys are accepted by both


def test_a_whole_tree_reads_the_same_and_a_corrupt_entry_is_still_refused_by_name() -> None:
    """Through ``Tree.from_bytes``: the written tree round-trips; a corrupted entry gets the full reader's error,
    naming the tree, the file and the field, as before the fast path existed."""
    files = tuple(full_reader(e) for e in written_entries())
    assert None not in files
    tree = Tree(identity=IDENTITY, files=files)  # type: ignore[arg-type]
    assert Tree.from_bytes(tree.to_bytes(), key="k", identity=IDENTITY) == tree
    rng = random.Random(32)
    body = trees.json.loads(tree.to_bytes())
    body["files"][2]["chunks"][1]["pack"] = pack_key(OTHER, "a" * 32, rng.randrange(10))
    with pytest.raises(
        CheckpointCorruptError, match=r"tree 'k' file 2 chunk 1: pack .* is not a pack of identity"
    ):
        Tree.from_bytes(canonical_json(body), key="k", identity=IDENTITY)


def test_a_tree_is_written_as_canonical_json_and_an_index_entry_keeps_its_text() -> None:
    """``Tree.to_bytes`` joins each entry's cached text instead of encoding the tree whole (issue 32): the bytes
    must stay exactly ``canonical_json`` of the tree, which names the tree and decides whether a re-save's tree
    is the one already kept, for every kind of entry and for paths and identities that need escaping."""
    rng = random.Random(7)
    awkward = [
        'q"uote',
        "back\\slash",
        "tab\tnew\nline",
        "ünïcödé/файл",
        "emoji 🙂",
        "ctl\x01\x1f",
        "/",
        "é" * 40,
    ]
    for identity in (IDENTITY, 'id"with/quote\\s', "ünï/côdé"):
        pack = pack_key(identity, "c" * 32, 1)
        files = []
        for n in range(200):
            chunks = []
            for m in range(rng.randrange(0, 4)):
                size = rng.randrange(0, 5000)
                if rng.random() < 0.5:
                    chunks.append(
                        ChunkRef(key=pack, sha256=sha(n * 10 + m), size=size, offset=rng.randrange(10**6))
                    )
                else:
                    chunks.append(
                        ChunkRef(key=chunk_key(identity, sha(n * 10 + m)), sha256=sha(n * 10 + m), size=size)
                    )
            path = f"{rng.choice(awkward)}/{n}"
            mode = rng.choice([None, 0, 0o644, 0o755, 0o777])
            seen = rng.choice(
                [None, (rng.randrange(2**64), rng.randrange(2**64), rng.randrange(-(2**63), 2**63), 0)]
            )
            files.append(
                TreeFile(
                    path=path, size=sum(c.size for c in chunks), chunks=tuple(chunks), mode=mode, seen=seen
                )
            )
        tree = Tree(identity=identity, files=tuple(files))
        expected = canonical_json(tree.to_json()) + b"\n"
        assert tree.to_bytes() == expected
        assert tree.to_bytes() == expected, "the second encoding, from the cached entries, is the same"
        again = Tree(identity=identity, files=tuple(files[:100]) + tuple(files[100:]))
        assert again.to_bytes() == expected, "entries taken into a new tree keep their text"
        for entry in files:
            assert entry.encoded() == canonical_json(entry.to_json()).decode()


def awkward_tree(identity: str = IDENTITY) -> Tree:
    """Entries of every kind, with paths that hold the very text a parse cuts the tree's entries at."""
    pack = pack_key(identity, "c" * 32, 1)
    paths = [
        '},{"chunks":[',
        '"chunks":',
        'x"},{"chunks":[{"',
        "back\\",
        "\\",
        "ünï 🙂",
        "a]," + '"format":3',
    ]
    files = []
    for n in range(60):
        chunks = tuple(
            ChunkRef(key=pack, sha256=sha(n * 10 + m), size=m + 1, offset=n * 100 + m * 10)
            if m % 2
            else ChunkRef(key=chunk_key(identity, sha(n * 10 + m)), sha256=sha(n * 10 + m), size=m + 1)
            for m in range(n % 4)
        )
        seen = (n, n + 1, -n, n) if n % 3 else None
        path = f"{paths[n % len(paths)]}/{n}"
        files.append(
            TreeFile(path=path, size=sum(c.size for c in chunks), chunks=chunks, mode=0o644, seen=seen)
        )
    return Tree(identity=identity, files=tuple(files))


def test_a_parsed_tree_keeps_each_entrys_stored_text_and_writes_the_same_bytes() -> None:
    """A new process's re-save takes 99 % of the previous tree's entries as they are; the parse hands each entry
    the text it was read from, so the new tree is not encoded again (issue 32). That text must be exactly the
    entry's canonical text, also for paths that contain the text the parse cuts at."""
    for identity in (IDENTITY, 'id"with/quote\\s'):
        tree = awkward_tree(identity)
        data = tree.to_bytes()
        parsed = Tree.from_bytes(data, key="k", identity=identity)
        assert parsed == tree
        for entry in parsed.files:
            assert "_encoded" in entry.__dict__, f"{entry.path!r} was not given its stored text"
            assert entry.encoded() == canonical_json(entry.to_json()).decode()
        assert parsed.to_bytes() == data


def variants(data: bytes) -> dict[str, bytes]:
    """The same tree laid out otherwise, and with junk a hand-made tree could hold around its entries."""
    body = trees.json.loads(data)
    text = data.decode()
    files = text[len('{"files":[') : text.index('],"format":')]
    ident = trees.json.dumps(body["identity"])
    return {
        "indented": trees.json.dumps(body, indent=1, sort_keys=True).encode(),
        "fields in another order": trees.json.dumps(body).encode(),
        "unicode escaped": trees.json.dumps(body, sort_keys=True, separators=(",", ":")).encode() + b"\n",
        "an earlier files array": (
            '{"files":[{"chunks":[],"path":"ghost","size":0}],"files":[' + text[len('{"files":[') :]
        ).encode(),
        "an earlier array of no entries": ('{"files":[1],"files":[' + text[len('{"files":[') :]).encode(),
        "a later format": (
            '{"files":[' + files + '],"format":[{"chunks":[]}],"format":3,"identity":' + ident + "}\n"
        ).encode(),
        "a later format of objects": (
            '{"files":[' + files + '],"format":[{"a":{"b":1}}],"format":3,"identity":' + ident + "}\n"
        ).encode(),
        "a key that holds chunks": text.replace('"mode":420', '"mode":420,"x":{"chunks":[]}', 1).encode(),
    }


def test_a_tree_not_laid_out_as_written_reads_the_same_and_its_entries_text_reads_back_as_them() -> None:
    """A tree this library did not write byte for byte (another layout, or junk around the entries that JSON
    allows: duplicate keys, nested objects with an entry's key) must read as the same entries, and whatever text
    an entry is given must read back as that very entry: a re-save writes it into the next tree as it is."""
    tree = awkward_tree()
    data = tree.to_bytes()
    for name, variant in variants(data).items():
        parsed = Tree.from_bytes(variant, key="k", identity=IDENTITY)
        given = ["_encoded" in e.__dict__ for e in parsed.files]
        if name == "unicode escaped":  # the one layout whose cut is exact, but not canonical
            assert all(given), name
        else:
            assert not any(given), f"{name}: cut anyway"
        assert parsed.files == tree.files, name
        for entry in parsed.files:
            again = TreeFile.from_json(trees.json.loads(entry.encoded()), identity=IDENTITY, what=name)
            assert again == entry, f"{name}: {entry.path!r} would be re-saved as {again}"
        assert Tree.from_bytes(parsed.to_bytes(), key="k", identity=IDENTITY) == parsed, name
