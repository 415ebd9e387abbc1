"""The package stays easy to see whole: small modules, and no private name used outside the module that owns it.

docs/architecture.md says where new code goes; these checks keep two promises of it that no linter makes:

* no module over :data:`MAX_LINES` lines (one idea per module). :data:`STILL_LARGE` lists the modules that were
  larger when the rule came, with the size they may not grow past: the list only shrinks;
* a name with a leading underscore is private to its module: no ``from x import _name``, and no ``obj._name`` where
  the module does not define ``_name`` itself (a private method called from another module, as
  ``cs._tree_of_ref`` was from GC). ``namedtuple``'s public ``_replace``/``_asdict``/``_fields`` are allowed.

``make lint`` runs this file, and so does ``make test``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "airflow_stateful"
MAX_LINES = 500
STILL_LARGE: dict[str, int] = {}
"""Modules over the limit when it came, and the most lines each may have until it is split."""
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_grows_past_the_limit() -> None:
    too_large = {}
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > STILL_LARGE.get(rel, MAX_LINES):
            too_large[rel] = lines
    assert not too_large, (
        f"modules over {MAX_LINES} lines (or past their STILL_LARGE size): {too_large}; split them by idea"
    )


def test_the_list_of_large_modules_only_shrinks() -> None:
    """A module split below the limit leaves the list (so it can never grow back unnoticed)."""
    shrunk = [rel for rel in STILL_LARGE if len((PACKAGE / rel).read_text().splitlines()) <= MAX_LINES]
    assert not shrunk, f"{shrunk} are within {MAX_LINES} lines now: remove them from STILL_LARGE"


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("airflow_stateful"):
            found += [
                f"line {node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue
            if isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super":
                continue
            if node.attr in defined or node.attr in PUBLIC_UNDERSCORE:
                continue
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_private_name_is_used_outside_its_module(path: Path) -> None:
    uses = _private_uses(path)
    assert not uses, (
        f"{path.relative_to(PACKAGE)} uses private names of other modules: {uses}; make them public"
    )


def test_the_private_name_check_sees_a_private_method_called_from_another_module(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from airflow_stateful.core.fleet.gc import _same\n\ndef f(cs):\n    return cs._tree_of_ref(1)\n"
    )
    assert len(_private_uses(bad)) == 2


# -- the head signing policy reaches every head read ------------------------------------------------------------
HEAD_READERS = {
    "HeadStore",
    "CheckpointReader",
    "CheckpointStore",
    "read_head",
    "read_heads",
    "identity_statuses",
    "find_stuck",
    "disk_usage",
    "plan_identity",
    "plan_gc",
}
"""What reads (or writes) heads from a byte store: each call in the package must say which signer it uses.

Signing is a protocol concern, not a property of the byte store (docs/architecture.md): whoever opens the store
from configuration passes the signer on. A call that forgets it would read heads unverified, so a deployment
with ``require_signed_heads`` would accept a forged head there: failing open. Saying ``signer=None`` is allowed
(a store signing does not apply to); leaving it out is not."""


def _calls_without_signer(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (
            func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        )
        if name in HEAD_READERS and not any(k.arg in ("signer", None) for k in node.keywords):
            found.append(f"line {node.lineno}: {name}(...)")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_head_read_in_the_package_says_which_signer_it_uses(path: Path) -> None:
    missing = _calls_without_signer(path.read_text())
    assert not missing, f"{path.relative_to(PACKAGE)} reads heads without passing signer=: {missing}"


def test_the_signer_check_sees_a_forgotten_signer() -> None:
    assert _calls_without_signer(
        "read_head(store, identity)\nCheckpointStore(store=s, identity=i, signer=x)"
    ) == ["line 1: read_head(...)"]
    assert _calls_without_signer("m.plan_gc(store, **options)") == []  # ** may carry it: checked where built
