"""The stored text of each entry of a tree, cut out of the tree's bytes (issue 32).

A new process's re-save keeps 99 % of the previous tree's entries as they are. Each :class:`~.trees.TreeFile`
caches its canonical text (what :meth:`~.trees.Tree.to_bytes` joins); an entry just parsed has none, and encoding
10,000 of them again cost a third of that parse. The tree's bytes already hold each entry's text: this module
cuts them out, exactly or not at all, so the parse can hand each entry its own.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

_ENTRY_START = '{"chunks":['
_ENTRY_BOUNDARY = "}," + _ENTRY_START


def entry_texts(data: bytes, entries: list[Any], *, fmt: int, identity: str) -> list[str]:
    """The stored text of each of ``entries`` (the tree's parsed ``files``), cut out of ``data``, or ``[]`` when
    the tree is not laid out as this library writes it (then each entry is encoded again when needed).

    A new process's re-save keeps 99 % of the previous tree's entries; giving each the text it was read from
    spares encoding them again (a third of a 10,000-file parse). The text is the entry's own source, so it reads
    back as the very entry this process parsed, and the cut is exact, not guessed: ``data`` is valid JSON (it
    was parsed), so every ``"chunks":`` in it ends a key (an unescaped quote cannot sit inside a string); there
    are exactly as many as entries, so no other object has that key, and each ``},{"chunks":[`` starts an entry;
    the first entry opens the array, the suffix is exact and the last piece is checked to be the last entry.
    tests/test_tree_parse.py holds it to that with trees laid out otherwise and with junk JSON allows.
    """
    suffix = f'],"format":{fmt},"identity":{encode_basestring(identity)}}}\n'
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return []
    head = '{"files":['
    if (
        not entries
        or not text.startswith(head + _ENTRY_START)
        or not text.endswith(suffix)
        or text.count('"chunks":') != len(entries)
    ):
        return []
    pieces = text[len(head) + len(_ENTRY_START) : len(text) - len(suffix) - 1].split(_ENTRY_BOUNDARY)
    if len(pieces) != len(entries):
        return []
    last = f"{_ENTRY_START}{pieces[-1]}}}"
    try:
        if text[len(text) - len(suffix) - 1] != "}" or json.loads(last) != entries[-1]:
            return []
    except ValueError:  # the last piece held more than the last entry
        return []
    return [f"{_ENTRY_START}{piece}}}" for piece in pieces[:-1]] + [last]
