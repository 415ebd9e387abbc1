"""Outputs a writer published since its last commit: staged, uploaded, invisible until the next commit lands.

``WriterSession.publish`` uploads an output's chunks at once (so what is published is the content at that call,
and the commit that makes it visible stays cheap) and stages it here by name; the next commit takes them all
(:meth:`OutputStage.taken`) and, once it lands, forgets those it made visible (:meth:`committed`). The stage
also says which chunks the writer may reference without uploading (its newest checkpoint's, and staged ones)
and which uploaded keys a sweep must keep (nothing references staged chunks yet).
"""

from __future__ import annotations

import logging

from airflow_stateful.core.data.content import ContentStore
from airflow_stateful.core.records.manifests import Manifest
from airflow_stateful.core.records.outputs import StagedOutput
from airflow_stateful.core.records.trees import ChunkRef

log = logging.getLogger("airflow_stateful")


class OutputStage:
    """The outputs staged by one writer, by name (publishing a name again replaces it)."""

    def __init__(self) -> None:
        self._outputs: dict[str, StagedOutput] = {}

    def add(self, output: StagedOutput) -> None:
        self._outputs[output.name] = output

    def taken(self) -> dict[str, StagedOutput]:
        """What the next commit publishes (a copy: outputs staged while it runs wait for the one after)."""
        return dict(self._outputs)

    def committed(self, published: dict[str, StagedOutput]) -> None:
        """A commit made ``published`` visible: they are no longer staged (unless published again meanwhile)."""
        for name, output in published.items():
            if self._outputs.get(name) is output:
                del self._outputs[name]

    def landed(self, manifest: Manifest) -> None:
        """A commit whose answer was lost turned out to have landed: what it carries is no longer staged."""
        self._outputs = {n: o for n, o in self._outputs.items() if manifest.outputs.get(n) is None}

    def keys(self) -> set[str]:
        """The chunk keys staged outputs reference (a sweep must not delete them: no checkpoint does yet)."""
        return {c.key for staged in self._outputs.values() for f in staged.files for c in f.chunks}

    def known_chunks(self, content: ContentStore, latest: Manifest | None) -> dict[str, ChunkRef]:
        """Chunks the writer may reference without uploading: ``latest``'s files and outputs, and the staged
        outputs'. Best effort: a tree that cannot be read only means uploading again."""
        known: dict[str, ChunkRef] = {}
        for ref in [latest.tree, latest.outputs_tree] if latest is not None else []:
            if ref is None:
                continue
            try:
                tree = content.tree_of(ref)
            except Exception as exc:
                log.warning("%s: not deduplicating against tree %s: %s", content.identity, ref.key, exc)
                continue
            known.update({c.sha256: c for f in tree.files for c in f.chunks})
        for staged in self._outputs.values():
            known.update({c.sha256: c for f in staged.files for c in f.chunks})
        return known
