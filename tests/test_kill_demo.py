"""``make demo-kill`` under ``make soak``: the demo module, run as a user runs it, shows a real SIGKILL and the resume.

``python -m airflow_stateful.testing.kill_demo`` (the module, not make, so that it runs on this test's Python)
starts api-server, scheduler (LocalExecutor) and dag-processor on 127.0.0.1 in an AIRFLOW_HOME under the test's
temporary directory, runs ``killable_batch`` with ``kill_at_item=37`` and stops everything. The test checks its
output, the ledger file it leaves in the home, and that no process of it is left. About a minute here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from dag_helpers import ledger_by_try
from long_tests import LONG_TESTS

from airflow_stateful.testing.local_stack import processes_of

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(
        not LONG_TESTS,
        reason="`make demo-kill` itself; `make soak` runs this (STATEFUL_LONG_TESTS=1). `make test` keeps the same "
        "SIGKILL and resume of killable_batch on a whole stack (tests/test_e2e_stack.py), to stay under 15 minutes",
    ),
]

TIMEOUT = 300


def run_demo(home: Path) -> tuple[int, str]:
    """Run the demo; on a timeout stop it as a user's Ctrl-C would (SIGTERM: it stops its stack), then kill."""
    command = [sys.executable, "-m", "airflow_stateful.testing.kill_demo", "--home", str(home)]
    demo = subprocess.Popen(
        [*command, "--kill-at-item", "37", "--item-seconds", "0.1"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = demo.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        demo.send_signal(signal.SIGTERM)
        try:
            output, _ = demo.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(demo.pid, signal.SIGKILL)
            output, _ = demo.communicate()
        pytest.fail(f"the demo took longer than {TIMEOUT} s\n{output}")
    return demo.returncode, output


def kill_leftovers(home: Path) -> list[str]:
    """Kill whatever of the demo's stack is still running (the demo should have stopped it) and name it."""
    left = processes_of(home)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    return [f"{p.pid}: {' '.join(p.info['cmdline'] or [])}" for p in left]


def test_kill_demo_shows_the_sigkill_and_the_resume(tmp_path: Path) -> None:
    home = tmp_path / "home"
    t0 = time.monotonic()
    try:
        code, output = run_demo(home)
    finally:
        left = kill_leftovers(home)
    seconds = time.monotonic() - t0
    assert not left, "processes of the demo's stack were still running after it exited:\n" + "\n".join(left)
    assert code == 0, f"the demo exited with {code}\n{output}"

    # What the user reads.
    assert f"AIRFLOW_HOME={home}" in output
    assert "kill-demo: the story held: SIGKILL at item 37, resumed at 30, run succeeded" in output, output
    assert "try 1's task log: warning: try 1: SIGKILL to my own process at item 37" in output, output
    assert "Process terminated by signal" in output and "(signal -9, SIGKILL)" in output, output
    assert "try states (REST API, tries/N): {1: 'failed', 2: 'success'}" in output, output
    assert "try 2 resumed at item 30 and handled 30..99 (70 items)" in output, output
    assert "result {'total': 328350}" in output, output
    assert "stopped: no process of the stack is left" in output, output
    assert " NOT: " not in output, output

    # What the task itself wrote, one `try,item` row per handled item.
    tries = ledger_by_try(home / "killable_batch.ledger")
    assert tries == {1: list(range(37)), 2: list(range(30, 100))}, tries

    # The command the demo prints to see every checkpoint works as printed (the identity named by its Airflow
    # ids, the run id as the scheduler made it).
    [line] = [x for x in output.splitlines() if x.strip().startswith("every checkpoint: ")]
    words = shlex.split(line.split("every checkpoint: ", 1)[1])
    env = {**os.environ, **dict(w.split("=", 1) for w in words[:1])}
    history = subprocess.run(
        [*words[1:], "--json"], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert history.returncode == 0, history.stderr
    assert [r["seq"] for r in json.loads(history.stdout)] == list(range(10, 0, -1)), history.stdout
    print(f"kill demo: {seconds:.0f} s")
