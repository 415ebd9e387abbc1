"""The provider registers with Airflow: a broken provider_info breaks every Airflow command of a user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from airflow_stateful.get_provider_info import get_provider_info

pytestmark = pytest.mark.airflow


def airflow(*args: str, home: Path) -> str:
    env = dict(os.environ, AIRFLOW_HOME=str(home))
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)  # see the real defaults
    result = subprocess.run(
        [sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"airflow {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_provider_info_matches_airflows_schema() -> None:
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == "airflow-provider-stateful"
    assert set(info["config"]["stateful"]["options"]) >= {"backend_url", "conn_id", "lease_ttl", "keep_last"}


def test_airflow_providers_list_shows_the_provider(tmp_path: Path) -> None:
    rows = json.loads(airflow("providers", "list", "--output", "json", home=tmp_path))
    ours = [r for r in rows if r["package_name"] == "airflow-provider-stateful"]
    assert ours, f"not in `airflow providers list`: {[r['package_name'] for r in rows]}"
    from airflow_stateful.version import __version__

    assert ours[0]["version"] == __version__


def test_airflow_config_lists_the_stateful_section_with_defaults(tmp_path: Path) -> None:
    out = airflow(
        "config", "list", "--section", "stateful", "--show-values", "--include-descriptions", home=tmp_path
    )
    assert "[stateful]" in out
    for line in ("conn_id = aws_default", "lease_ttl = 600", "keep_last = 3", "backend_url ="):
        assert line in out, f"{line!r} missing from:\n{out}"
    assert "s3://bucket/prefix" in out, "the options are documented in the listing"
    assert airflow("config", "get-value", "stateful", "keep_last", home=tmp_path).strip() == "3"


def test_settings_use_the_documented_default_backend(tmp_path: Path) -> None:
    """An empty backend_url means a directory under AIRFLOW_HOME (the embedded default)."""
    code = "from airflow_stateful.config import StatefulSettings; s = StatefulSettings.load(); print(s.backend_url, s.keep_last)"
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path))
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == [(tmp_path / "stateful").as_uri(), "3"]
