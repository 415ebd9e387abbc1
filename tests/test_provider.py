"""The provider registers with Airflow: a broken provider_info breaks every Airflow command of a user.

The ``airflow`` commands run for real in subprocesses (about 3 s each, so few of them). They read no
database, so they use the session's AIRFLOW_HOME from tests/conftest.py as it is, without the ``db migrate``
that the ``airflow_home`` fixture pays for.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from airflow_stateful.get_provider_info import get_provider_info

pytestmark = pytest.mark.airflow

PACKAGE = "airflow-provider-stateful"
AIRFLOW_VERSION = tuple(int(part) for part in version("apache-airflow").split(".")[:2])
PLUGIN_CLASS = "airflow_stateful.plugins.stateful_view.StatefulPlugin"
# Modules that need an optional extra, and the module whose absence means the extra is not installed.
NEEDS_EXTRA = {"airflow_stateful.operators.kubernetes": "airflow.providers.cncf.kubernetes"}


def airflow(*args: str, home: Path | None = None) -> str:
    """``airflow *args`` in a subprocess, in the session AIRFLOW_HOME that tests/conftest.py set (or ``home``)."""
    env = dict(os.environ)
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)  # see the real defaults
    if home is not None:
        env["AIRFLOW_HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "-m", "airflow", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"airflow {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_provider_info_matches_airflows_schema() -> None:
    """Validated as Airflow's provider manager does: the schema file shipped with airflow-core, draft 7."""
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator_cls(schema).validate(info)
    assert info["package-name"] == PACKAGE
    assert set(info["config"]["stateful"]["options"]) >= {"backend_url", "conn_id", "lease_ttl", "keep_last"}
    # Everything a first-party provider with these kinds of classes lists.
    assert set(info) >= {
        "integrations",
        "hooks",
        "operators",
        "sensors",
        "triggers",
        "task-decorators",
        "plugins",
        "config",
        "connection-types",
    }


def test_provider_info_names_only_what_exists() -> None:
    """Every listed module imports (unless its extra is missing) and holds the classes we advertise.

    Airflow itself never imports the hooks/operators/sensors modules, so a typo there would go unnoticed.
    The schema does not constrain ``plugins`` and ``task-decorators`` items either; this does.
    """
    info = get_provider_info()
    integrations = {i["integration-name"] for i in info["integrations"]}
    expected = {
        "hooks": {"airflow_stateful.hooks.state": {"StateHook"}},
        "operators": {
            "airflow_stateful.operators.stateful": {"StatefulOperator"},
            "airflow_stateful.operators.python": {"StatefulPythonOperator"},
            "airflow_stateful.operators.gc": {"StatefulGCOperator"},
            "airflow_stateful.operators.stuck": {"StatefulStuckCheckOperator"},
            "airflow_stateful.operators.kubernetes": {"StatefulKubernetesPodOperator"},
        },
        "sensors": {"airflow_stateful.sensors.checkpoint": {"CheckpointSensor", "LeaseReleasedSensor"}},
        "triggers": {"airflow_stateful.triggers.checkpoint": {"CheckpointTrigger"}},
    }
    for section, modules in expected.items():
        listed = [m for entry in info[section] for m in entry["python-modules"]]
        assert {e["integration-name"] for e in info[section]} <= integrations, section
        assert sorted(listed) == sorted(modules), section
        for module_name, class_names in modules.items():
            extra = NEEDS_EXTRA.get(module_name)
            if extra and not _has_module(extra):
                continue  # its optional extra is not installed here
            module = importlib.import_module(module_name)
            assert class_names <= set(vars(module)), f"{module_name} lacks {class_names - set(vars(module))}"

    [decorator] = info["task-decorators"]
    assert decorator["name"] == "stateful"
    assert callable(_import_string(decorator["class-name"]))

    [plugin] = info["plugins"]
    assert plugin["plugin-class"] == PLUGIN_CLASS
    plugin_cls = _import_string(plugin["plugin-class"])
    assert plugin_cls.name == plugin["name"]
    # The same class is registered through the `airflow.plugins` entry point (which loads it by default):
    # the two must not drift apart, or Airflow would load two different plugins.
    ours = [ep for ep in entry_points(group="airflow.plugins") if ep.value.startswith("airflow_stateful.")]
    assert [ep.value.replace(":", ".") for ep in ours] == [PLUGIN_CLASS]


def test_provider_info_does_not_claim_a_connection_type() -> None:
    """StateHook reads `aws` connections, which belong to the amazon provider (see get_provider_info)."""
    from airflow_stateful.hooks.state import StateHook

    info = get_provider_info()
    assert info["connection-types"] == []
    assert "hook-class-names" not in info  # the deprecated key would import the hook and claim `aws` too
    assert StateHook.conn_type == "aws"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _import_string(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def test_airflow_providers_list_shows_the_provider() -> None:
    rows = json.loads(airflow("providers", "list", "--output", "json"))
    ours = [r for r in rows if r["package_name"] == PACKAGE]
    assert ours, f"not in `airflow providers list`: {[r['package_name'] for r in rows]}"
    from airflow_stateful.version import __version__

    assert ours[0]["version"] == __version__


def test_airflow_providers_get_shows_everything_we_list() -> None:
    """``airflow providers get --full`` prints the provider info as Airflow loaded it from the entry point."""
    [shown] = json.loads(airflow("providers", "get", PACKAGE, "--full", "--output", "json"))
    info = get_provider_info()
    for key in ("hooks", "operators", "sensors", "triggers", "task-decorators", "plugins", "config"):
        assert shown[key] == as_airflow_prints(info[key]), key
    assert shown["connection-types"] == []
    modules = {
        m
        for key in ("hooks", "operators", "sensors", "triggers")
        for e in shown[key]
        for m in e["python-modules"]
    }
    assert {
        "airflow_stateful.hooks.state",
        "airflow_stateful.operators.stateful",
        "airflow_stateful.operators.python",
        "airflow_stateful.operators.gc",
        "airflow_stateful.operators.kubernetes",
        "airflow_stateful.sensors.checkpoint",
        "airflow_stateful.triggers.checkpoint",
    } <= modules
    assert shown["plugins"] == [{"name": "stateful", "plugin-class": PLUGIN_CLASS}]


def as_airflow_prints(value: Any) -> Any:
    """``value`` as Airflow's console prints it with ``--output json``: every scalar but ``None`` as its ``str``
    (``backend_url``'s ``is_template: True`` is shown as ``"True"``)."""
    if isinstance(value, dict):
        return {k: as_airflow_prints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_airflow_prints(v) for v in value]
    return None if value is None else str(value)


def test_airflow_providers_triggers_lists_ours() -> None:
    rows = json.loads(airflow("providers", "triggers", "--output", "json"))
    ours = [r for r in rows if r["package_name"] == PACKAGE]
    assert ours == [
        {
            "package_name": PACKAGE,
            "class": "airflow_stateful.triggers.checkpoint",
            "integration_name": "Stateful checkpoints",
        }
    ]


def test_airflow_providers_hooks_leaves_connection_types_to_their_owners() -> None:
    """``airflow providers hooks`` lists connection types. We register none, so StateHook is not there and
    we never take ``aws`` from the amazon provider; the first-party ones still load (no error rows)."""
    rows = json.loads(airflow("providers", "hooks", "--output", "json"))
    assert not [r for r in rows if r["package_name"] == PACKAGE]
    assert not [r for r in rows if "airflow_stateful" in str(r["class"])]
    by_type = {r["connection_type"]: r for r in rows}
    assert by_type["fs"]["package_name"] == "apache-airflow-providers-standard"
    if "aws" in by_type:  # only when the amazon provider is installed
        assert by_type["aws"]["package_name"] == "apache-airflow-providers-amazon"


def test_airflow_plugins_loads_our_plugin_once_from_the_entry_point() -> None:
    rows = json.loads(airflow("plugins", "--output", "json"))
    ours = [r for r in rows if r["name"] == "stateful"]
    assert len(ours) == 1, rows
    [plugin] = ours
    assert "group='airflow.plugins'" in plugin["source"]
    assert PLUGIN_CLASS.rpartition(".")[0] in plugin["source"]
    assert plugin["fastapi_apps"] == [
        {"app": "fastapi.applications.FastAPI", "url_prefix": "/stateful", "name": "Stateful"}
    ]
    # The Browse entry, and the Checkpoints tabs on the task instance and DAG run pages.
    assert {v["destination"]: v["href"] for v in plugin["external_views"]} == {
        "nav": "/stateful/",
        "task_instance": "/stateful/ti/{DAG_ID}/{RUN_ID}/{TASK_ID}?map_index={MAP_INDEX}",
        "dag_run": "/stateful/run/{DAG_ID}/{RUN_ID}",
    }


def test_airflow_config_lists_the_stateful_section_with_defaults() -> None:
    # Airflow 3.1 lists values by default and has no --show-values (3.2+ hides them without it).
    show = ["--show-values"] if AIRFLOW_VERSION >= (3, 2) else []
    out = airflow("config", "list", "--section", "stateful", *show, "--include-descriptions")
    assert "[stateful]" in out
    for line in ("conn_id = aws_default", "lease_ttl = 600", "keep_last = 3", "backend_url ="):
        assert line in out, f"{line!r} missing from:\n{out}"
    assert "s3://bucket/prefix" in out, "the options are documented in the listing"
    assert airflow("config", "get-value", "stateful", "keep_last").strip() == "3"


def test_a_new_airflow_home_lists_the_default_backend_as_the_readme_states_it(tmp_path: Path) -> None:
    """``airflow config list`` in a fresh AIRFLOW_HOME shows ``backend_url``'s default as the README's table does
    (it once showed an empty value), the ``airflow.cfg`` Airflow writes there keeps it as written, and both readers
    of ``[stateful]`` resolve it to the directory under that home, as the empty default did."""
    home = tmp_path / "home with space"
    home.mkdir()
    show = ["--show-values"] if AIRFLOW_VERSION >= (3, 2) else []
    out = airflow("config", "list", "--section", "stateful", *show, home=home)
    assert "backend_url = file://{AIRFLOW_HOME}/stateful\n" in out, out
    assert airflow("config", "get-value", "stateful", "backend_url", home=home).strip() == (
        "file://{AIRFLOW_HOME}/stateful"
    )
    assert "\nbackend_url = file://{AIRFLOW_HOME}/stateful\n" in (home / "airflow.cfg").read_text()

    code = (
        "from airflow_stateful.cli.environment import airflow_cfg, light_settings\n"
        "light = light_settings(airflow_cfg())\n"
        "from airflow_stateful.config import load_settings\n"
        "print(light.backend_url if light else None); print(load_settings().backend_url)\n"
    )
    env = dict(os.environ, AIRFLOW_HOME=str(home))
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [(home / "stateful").as_uri()] * 2


def test_settings_use_the_documented_default_backend(tmp_path: Path) -> None:
    """An empty backend_url means a directory under AIRFLOW_HOME (the embedded default)."""
    code = "from airflow_stateful.config import load_settings; s = load_settings(); print(s.backend_url, s.keep_last)"
    env = dict(os.environ, AIRFLOW_HOME=str(tmp_path))
    env.pop("AIRFLOW__STATEFUL__BACKEND_URL", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == [(tmp_path / "stateful").as_uri(), "3"]
