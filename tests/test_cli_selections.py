"""The fleet verbs (``ls``, ``stuck``, ``du``, ``gc``) select identities by Airflow's ids, as the single-identity
verbs name one (issue 33, point 1).

Before, they took only a raw key prefix, and keys hold the run id percent-encoded: a run id pasted from the
Airflow UI matched nothing and ``gc`` printed ``(none)`` with exit 0, in docs/deploy.md's own roll-back recipe.
Here the recipe is run as printed, the command of the issue is refused (exit 2) with a selector form that works
when pasted, and every selection (a DAG, a task, a run across its tasks, a name, a map index) is checked on every
fleet verb against neighbours it must not match (``etl2``, ``r10``, ``map=10``).

Everything is real: the console script in a process of its own where the user's view is the point, ``main()``
in this process for the wide matrix, a local file:// store seeded through the library's own commit protocol.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_stateful.cli.main import main
from airflow_stateful.core import CheckpointStore, Identity, store_from_url

BIN = Path(sys.executable).parent
DEPLOY_DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"
RUN = "manual__2026-12-05T13:05:47.540946+00:00"  # a run id as Airflow shows it: ':' and '+' need encoding


def key(dag: str, task: str, *, run: str | None = None, name: str | None = None, map_index: int = -1) -> str:
    return Identity.for_task(dag_id=dag, task_id=task, run_id=run, name=name, map_index=map_index).key


FLEET = {
    "crunch": key("etl", "crunch", run=RUN),
    "load": key("etl", "load", run=RUN),
    "crunch_r1": key("etl", "crunch", run="r1"),
    "crunch_r10": key("etl", "crunch", run="r10"),
    "fan_1": key("etl", "fan", run=RUN, map_index=1),
    "fan_10": key("etl", "fan", run=RUN, map_index=10),
    "named": key("etl", "crunch", name="nightly"),
    "etl2": key("etl2", "crunch", run=RUN),
}
"""Neighbours a selection must tell apart: DAG etl2 beside etl, run r10 beside r1, map=10 beside map=1."""


def seed(url: str, keys: list[str], *, leased: tuple[str, ...] = ()) -> None:
    """Commit one small checkpoint to each identity; those in ``leased`` keep their writer's lease (alive)."""
    store = store_from_url(url)
    for k in keys:
        cs = CheckpointStore(store=store, identity=Identity.parse(k))
        lease = cs.acquire()
        cs.commit(lease, {"identity": k})
        if k not in leased:
            cs.release(lease)
    store.close()


def user_env(backend: str, tmp_path: Path) -> dict[str, str]:
    """A shell as a user has it: the console script on PATH, the backend configured, and an Airflow home of its
    own without a metadata database (GC then goes by the heads, as on a host that cannot read it)."""
    home = tmp_path / "airflow-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        AIRFLOW_HOME=str(home),
        AIRFLOW__STATEFUL__BACKEND_URL=backend,
    )
    return env


def shell(line: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One command line exactly as printed, through the shell (quotes and ``# comments`` included)."""
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=180, env=env)


def recipe() -> list[str]:
    """The commands of docs/deploy.md's "delete it" roll-back step, as printed."""
    text = DEPLOY_DOC.read_text()
    step = text[text.index("* **delete it**") :]
    block = re.search(r"```bash\n(.*?)```", step, flags=re.DOTALL)
    assert block is not None, "the roll-back step has no bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


# -- as a user meets it ---------------------------------------------------------------------------------------
def test_the_deploy_guides_roll_back_recipe_deletes_exactly_that_task_of_that_run(tmp_path: Path) -> None:
    lines = recipe()
    assert [shlex.split(line)[1] for line in lines] == ["du", "unlock", "gc", "gc"], lines
    for line in lines:  # the example's ids are those seeded here
        words = shlex.split(line, comments=True)
        assert words[words.index("--dag-id") + 1] == "etl" and words[words.index("--run-id") + 1] == RUN, line
    backend = (tmp_path / "state").as_uri()
    # The task to delete still holds a live lease (its writer was never released): the recipe's unlock frees it.
    seed(backend, list(FLEET.values()), leased=(FLEET["crunch"],))
    env = user_env(backend, tmp_path)

    results = [shell(line, env) for line in lines]
    for line, result in zip(lines, results, strict=True):
        assert result.returncode == 0, (line, result.stdout, result.stderr)
    du, unlock, dry_run, gc = results
    # du: every task of that run (the mapped ones too), nothing of other runs or of DAG etl2.
    run_wide = {FLEET[n] for n in ("crunch", "load", "fan_1", "fan_10")}
    assert run_wide <= set(du.stdout.split()), du.stdout
    assert not {FLEET[n] for n in ("crunch_r1", "crunch_r10", "named", "etl2")} & set(du.stdout.split())
    assert FLEET["crunch"] in unlock.stdout
    rows = [line.split() for line in dry_run.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == [FLEET["crunch"]] and "would" in rows[0], dry_run.stdout
    assert FLEET["crunch"] in gc.stdout and "deleted" in gc.stdout, gc.stdout

    listed = shell("airflow-stateful ls --json", env)
    assert listed.returncode == 0, listed.stderr
    left = {row["identity"] for row in json.loads(listed.stdout)}
    assert left == set(FLEET.values()) - {FLEET["crunch"]}


def test_a_run_id_as_airflow_shows_it_in_a_prefix_is_refused_with_the_selectors_that_work(
    tmp_path: Path,
) -> None:
    """The issue's command: exit 2 before anything is opened, with a selector form that, pasted, selects it."""
    missing = tmp_path / "never-created"
    plain = f"newcomer_batch/crunch/run={RUN}/map=-1/~"
    result = shell(
        f'airflow-stateful gc "{plain}" --idle-for 0s --dry-run', user_env(missing.as_uri(), tmp_path)
    )
    assert (result.returncode, result.stdout) == (2, ""), (result.stdout, result.stderr)
    assert repr(plain) in result.stderr and "':'" in result.stderr, result.stderr
    assert not missing.exists(), "the prefix is checked before the store is opened"
    suggested = re.search(r"use: (.*?) \(the selectors", result.stderr)
    assert suggested is not None, result.stderr
    selectors = suggested.group(1)
    assert selectors == shlex.join(
        ["--dag-id", "newcomer_batch", "--task-id", "crunch", "--run-id", RUN, "--map-index", "-1"]
    )
    wanted = key("newcomer_batch", "crunch", run=RUN)
    assert f"{wanted}/~" in result.stderr

    backend = (tmp_path / "state").as_uri()
    seed(backend, [wanted, key("newcomer_batch", "crunch", run=RUN, map_index=1)])
    pasted = shell(
        f"airflow-stateful gc {selectors} --idle-for 0s --dry-run --json", user_env(backend, tmp_path)
    )
    assert pasted.returncode == 0, pasted.stderr
    assert [row["identity"] for row in json.loads(pasted.stdout)] == [wanted]


# -- every selection on every fleet verb -----------------------------------------------------------------------
SELECTIONS: list[tuple[list[str], set[str]]] = [
    (["--dag-id", "etl"], {n for n in FLEET if n != "etl2"}),
    (["--dag-id", "etl", "--task-id", "crunch"], {"crunch", "crunch_r1", "crunch_r10", "named"}),
    (["--dag-id", "etl", "--run-id", RUN], {"crunch", "load", "fan_1", "fan_10"}),
    (["--dag-id", "etl", "--run-id", "r1"], {"crunch_r1"}),
    (["--dag-id", "etl", "--task-id", "crunch", "--run-id", RUN], {"crunch"}),
    (["--dag-id", "etl", "--task-id", "fan", "--run-id", RUN, "--map-index", "1"], {"fan_1"}),
    (["--dag-id", "etl", "--run-id", RUN, "--map-index", "10"], {"fan_10"}),
    (["--dag-id", "etl", "--name", "nightly"], {"named"}),
    (["--dag-id", "nothing-here"], set()),
    (["--dag-id", "nothing-here", "--run-id", RUN], set()),
    # The raw prefix keeps working for keys as they are written (encoded), ending where it says.
    (["etl/"], {n for n in FLEET if n != "etl2"}),
    ([f"{FLEET['fan_1']}/~"], {"fan_1"}),
]


@pytest.fixture(scope="module")
def fleet_backend(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One seeded store for the whole matrix (gc runs only --dry-run on it)."""
    url = (tmp_path_factory.mktemp("fleet") / "state").as_uri()
    seed(url, list(FLEET.values()))
    return url


def selected(capsys: pytest.CaptureFixture[str], verb: list[str], selection: list[str], backend: str) -> Any:
    code = main([*verb, *selection, "--backend", backend, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, (verb, selection, err)
    return json.loads(out)


@pytest.mark.parametrize(("selection", "names"), SELECTIONS, ids=[" ".join(s) for s, _ in SELECTIONS])
def test_every_fleet_verb_selects_the_same_identities_and_no_neighbour(
    capsys: pytest.CaptureFixture[str], fleet_backend: str, selection: list[str], names: set[str]
) -> None:
    backend = fleet_backend
    wanted = {FLEET[n] for n in names}
    rows = selected(capsys, ["ls"], selection, backend)
    assert {r["identity"] for r in rows} == wanted, "ls"
    rows = selected(capsys, ["du"], selection, backend)
    assert {r["identity"] for r in rows} - {"TOTAL"} == wanted, "du"
    rows = selected(capsys, ["gc", "--dry-run", "--idle-for", "0s", "--airflow", "no"], selection, backend)
    assert {r["identity"] for r in rows} == wanted, "gc --dry-run"
    assert all(r["action"] == "would delete" for r in rows)
    report = selected(capsys, ["stuck"], selection, backend)
    assert report["checked"] == len(wanted) and report["counts"]["idle"] == len(wanted), "stuck"


def test_a_run_across_tasks_is_one_stuck_report_named_by_its_selection(
    capsys: pytest.CaptureFixture[str], fleet_backend: str
) -> None:
    report = selected(capsys, ["stuck"], ["--dag-id", "etl", "--run-id", RUN], fleet_backend)
    encoded = key("etl", "x", run=RUN).split("/")[2]
    assert report["prefix"] == f"etl/*/{encoded}/map="
    assert report["checked"] == 4 and report["stuck"] == [] and report["errors"] == []


# -- mistakes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["gc", f"etl/crunch/run={RUN}/map=-1/~", "--idle-for", "0s"],
            "--dag-id etl --task-id crunch --run-id",
        ),
        (["ls", "my dag/"], "' '"),
        (["du", "etl//crunch/"], "empty segment"),
        (["ls", "etl~"], "'~' inside a segment"),
        (["du", "--task-id", "crunch"], "--dag-id"),
        (["du", "--run-id", RUN], "--dag-id"),
        (["ls", "--dag-id", "etl", "--map-index", "1"], "--map-index needs --run-id or --name"),
        (
            ["gc", "--dag-id", "etl", "--run-id", "r1", "--name", "nightly"],
            "at most one of --run-id and --name",
        ),
        (["ls", "etl/", "--dag-id", "etl"], "not both"),
        (["stuck", "etl/", "--prefix", "etl2/"], "two different prefixes"),
        (["du", "--dag-id", "etl", "--name", "bad name!"], "'bad name!'"),
        (["stuck", "--dag-id", "etl", "--map-index", "-2", "--run-id", "r1"], "map_index"),
    ],
)
def test_selection_mistakes_exit_2_naming_the_value_before_anything_is_opened(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], says: str
) -> None:
    missing = tmp_path / "never-created"
    code = main([*args, "--backend", missing.as_uri()])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (args, err)
    assert says in err, (args, err)
    assert not missing.exists(), "the selection is checked before the store is opened"
