"""Where the state lives, kept out of what the view shows to users who may not read Airflow's configuration.

The view hides ``backend_url`` from such users (it is configuration: a bucket, an endpoint, a directory on the
server). Error messages name it too: a store says which store refused an object, an ``OSError`` names the file,
botocore names the endpoint it could not reach. :class:`Redactor` replaces every such location in the rows,
cells, notes and errors a response carries with :data:`REDACTED`, so the page still says what went wrong
(the object key, the size, the advice) without saying where the store is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlparse

from airflow_stateful.core.stores.base import ObjectStore

REDACTED = "<store>"

T = TypeVar("T")


@dataclass(frozen=True)
class Redactor:
    """Replaces ``locations`` (longest first, so a URL goes before the bucket or directory inside it)."""

    locations: tuple[str, ...] = ()

    @classmethod
    def of(cls, store: ObjectStore) -> Redactor:
        """Every way a message may name ``store``: its URL (as given and unquoted), its directory, its bucket
        as a URL or quoted, its endpoint URL and that endpoint's host and port."""
        found = {store.url, unquote(store.url)}
        parsed = urlparse(store.url)
        if parsed.scheme == "file":
            found.add(unquote(parsed.path))
        root = getattr(store, "root", None)
        if isinstance(root, Path):
            found.add(str(root))
        bucket = getattr(store, "bucket", None)
        if isinstance(bucket, str) and bucket:
            found.update({f"s3://{bucket}", f"'{bucket}'", f'"{bucket}"', f"/{bucket}/"})
        endpoint = getattr(store, "endpoint_url", None)
        if isinstance(endpoint, str) and endpoint:
            found.add(endpoint.rstrip("/"))
            netloc = urlparse(endpoint).netloc
            if netloc:
                found.add(netloc)
        # A location of a character or two would blank out unrelated text.
        return cls(tuple(sorted((x for x in found if len(x) >= 3), key=len, reverse=True)))

    def text(self, value: str) -> str:
        for location in self.locations:
            if location in value:
                value = value.replace(location, REDACTED)
        return value

    def data(self, value: T) -> T:
        """``value`` with every string inside it redacted: dicts, lists, tuples and dataclasses are walked (and
        copied), other values are returned as they are."""
        if isinstance(value, str):
            return self.text(value)  # type: ignore[return-value]
        if isinstance(value, dict):
            return {k: self.data(v) for k, v in value.items()}  # type: ignore[return-value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(self.data(v) for v in value))
        if isinstance(value, list | tuple):
            return type(value)(self.data(v) for v in value)
        if is_dataclass(value) and not isinstance(value, type):
            return replace(
                value, **{f.name: self.data(getattr(value, f.name)) for f in fields(value) if f.init}
            )
        return value


NOTHING = Redactor()
"""For a user who may read the configuration: nothing is hidden."""
