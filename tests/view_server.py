"""The Stateful view in a real browser: served by uvicorn on 127.0.0.1 in a subprocess, shot by headless Chromium.

Used by tests/test_stateful_view.py and tests/test_checkpoints_tab.py. The server mounts the view at
``/stateful`` behind Airflow's all-admins middleware, as an api-server with ``simple_auth_manager_all_admins``
does, over a local store the test has written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from airflow_stateful.testing.s3_server import free_port

SERVER = r"""
import os, sys, uvicorn
os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
from fastapi import FastAPI
from airflow.api_fastapi.app import init_auth_manager
from airflow.api_fastapi.auth.managers.simple.middleware import SimpleAllAdminMiddleware
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.plugins.view.app import create_app

init_auth_manager()
outer = FastAPI()
outer.add_middleware(SimpleAllAdminMiddleware)  # what an api-server with simple_auth_manager_all_admins adds
now = float(sys.argv[3]) if len(sys.argv) > 3 else None
clock = {} if now is None else {"clock": lambda: now}
outer.mount("/stateful", create_app(LocalObjectStore(root=sys.argv[1], fsync=False), **clock))
uvicorn.run(outer, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
)


@contextmanager
def serve_view(state: Path, *, now: float | None = None) -> Iterator[str]:
    """Serve the view over the local store at ``state`` until the block ends; yields its base URL
    (``http://127.0.0.1:<port>/stateful``) once ``<base>/`` answers 200.

    :param now: the view's clock (seconds since the epoch), fixed; default: the real time.
    """
    port = free_port()
    args = [str(state), str(port)] + ([] if now is None else [str(now)])
    proc = subprocess.Popen([sys.executable, "-c", SERVER, *args])
    base = f"http://127.0.0.1:{port}/stateful"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"the view's server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{base}/", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            subprocess.run(["sleep", "0.1"], check=False)
        else:
            pytest.fail("the view's server never answered")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chromium_or_skip(what: str) -> str:
    """The path of ``chromium``; skips the test (saying it skips ``what``) when it is not on PATH."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print(f"chromium is not on PATH: skipping {what}")
        pytest.skip("chromium is not on PATH (apt-get install chromium to run the browser check)")
    return chromium


def screenshot(chromium: str, url: str, shot: Path, *, window_size: str, flags: Sequence[str] = ()) -> bytes:
    """A PNG of ``url`` taken by headless Chromium with a fresh profile, written to ``shot`` and returned.

    :param window_size: ``"<width>,<height>"`` in CSS pixels.
    :param flags: more Chromium flags (``--force-dark-mode``, ``--hide-scrollbars``, ...).
    """
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="stateful-chromium-") as profile:
        subprocess.run(
            [
                chromium,
                *CHROMIUM_FLAGS,
                *flags,
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                f"--window-size={window_size}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    data = shot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    return data
