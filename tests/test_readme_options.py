"""The README's ``[stateful]`` option table says what the provider declares: every option, once, with its default.

``get_provider_info()`` is the single source of the options (Airflow shows them in ``airflow config list`` and
uses their defaults); the table in the README's "Configure" section is what users read first. An option added to
one and not to the other, or a default changed in one place only, is what this catches: the table once lacked
``expected_checkpoint_interval``.

Defaults are compared as the README shows them: an option with a default shows exactly it (``600``). One whose
default is empty or not set shows what that means instead, and only what the provider's own description says it
means: the word "empty" or "unset", when the description uses it, or the effective value the description names
(``file://{AIRFLOW_HOME}/stateful`` for ``backend_url``). No Airflow is imported: the provider info must not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from airflow_stateful.get_provider_info import get_provider_info

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| option | default | meaning |"


def readme_table(text: str) -> list[tuple[str, str]]:
    """``(option, default cell)`` of each row of the first option table in the README's "## Configure"."""
    match = re.search(r"^## Configure\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "README.md has no '## Configure' section"
    lines = match.group(1).splitlines()
    assert HEADER in lines, f"README's Configure section has no table headed {HEADER!r}"
    rows = []
    for line in lines[lines.index(HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        option = re.fullmatch(r"`([a-z_]+)`", cells[0])
        assert option, f"README option table: {cells[0]!r} is not an option name in backticks"
        rows.append((option.group(1), cells[1]))
    return rows


def table_problems(rows: list[tuple[str, str]], options: dict[str, dict[str, Any]]) -> list[str]:
    """What the table gets wrong against the provider's options (empty: nothing)."""
    names = [name for name, _ in rows]
    problems = [f"listed twice: {name}" for name in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"missing from the README: {name}" for name in options if name not in names]
    problems += [f"not an option of the provider: {name}" for name in names if name not in options]
    for name, cell in rows:
        if name not in options:
            continue
        default, description = options[name].get("default"), options[name]["description"]
        if default:
            if cell != f"`{default}`":
                problems.append(f"{name}: the README says {cell}, the provider's default is `{default}`")
        elif cell in ("empty", "unset"):
            if cell not in description.lower():
                problems.append(
                    f"{name}: the README says {cell}; the description never says what {cell} means"
                )
        elif not (cell.startswith("`") and cell.endswith("`") and cell.strip("`") in description):
            problems.append(
                f"{name}: no default in the provider, and {cell} is neither 'empty' nor 'unset' nor a value "
                "its description names"
            )
    return problems


def provider_options() -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = get_provider_info()["config"]["stateful"]["options"]
    return options


def test_the_readme_lists_every_option_of_the_provider_with_its_default() -> None:
    rows = readme_table(README.read_text())
    assert table_problems(rows, provider_options()) == []
    assert len(rows) == len(provider_options())


def test_the_check_sees_a_missing_option_a_wrong_default_and_an_unknown_option() -> None:
    options = {
        "lease_ttl": {"default": "600", "description": "Seconds."},
        "conn_id": {"default": "", "description": "Empty: boto3's chain."},
        "cache_dir": {"default": None, "description": "Not set: /tmp/cache."},
        "keep_last": {"default": "3", "description": "How many."},
    }
    rows = [("lease_ttl", "`60`"), ("conn_id", "unset"), ("cache_dir", "`/tmp/cache`"), ("typo", "`1`")]
    assert table_problems(rows, options) == [
        "missing from the README: keep_last",
        "not an option of the provider: typo",
        "lease_ttl: the README says `60`, the provider's default is `600`",
        "conn_id: the README says unset; the description never says what unset means",
    ]
    assert table_problems(
        [("lease_ttl", "`600`"), ("lease_ttl", "`600`")], {"lease_ttl": options["lease_ttl"]}
    ) == ["listed twice: lease_ttl"]
