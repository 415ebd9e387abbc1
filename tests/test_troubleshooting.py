"""docs/troubleshooting.md says what the command line prints (issue 33, point 9).

Every entry of the page marked *checked* is produced here by the real ``airflow-stateful`` console script in a
process of its own: a mistyped connection on a machine with no credentials, wrong keys and a missing bucket on
SeaweedFS (a real S3 server), an HTTP server on 127.0.0.1 that is not S3, a closed port, a missing ``file://``
directory, a run id pasted into a raw prefix, a restore into a full directory, a rollback under a live lease and
an identity that was never written. The error line must match the entry's heading (``<...>`` and ``...`` stand
for any text) and the exit code the entry's. A message reworded in the code, an exit code changed, or an entry
no command produces any more fails here, so the page cannot drift from what users see.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import test_cli_setup_errors
from s3_endpoint import S3Endpoint
from test_cli_first_hour import _s3_env, run_script

from airflow_stateful.core import CheckpointStore, Identity, store_from_url
from airflow_stateful.testing.s3_server import free_port

not_s3 = test_cli_setup_errors.not_s3  # the fixture: an HTTP server on 127.0.0.1 that answers 404, not S3
_no_credentials_env = test_cli_setup_errors._no_credentials_env

DOC = Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
PREFIX = "airflow-stateful: "


@dataclass(frozen=True)
class Entry:
    heading: str
    exit_code: int | None
    checked: bool

    def matches(self, line: str) -> bool:
        """Whether an error line reads as this entry's heading, ``<...>`` and ``...`` matching any text."""
        parts = re.split(r"<[^>]*>|\.\.\.", self.heading)
        return re.match(".*?".join(map(re.escape, parts)), line) is not None


def entries() -> list[Entry]:
    """The page's entries: a ``### `message` `` heading, then ``*checked* · exit N`` (or ``exit N``)."""
    found = re.findall(r"^### `(.+)`\n\n(\*checked\* · )?(?:exit (\d))?", DOC.read_text(), re.M)
    return [Entry(heading=h, exit_code=int(code) if code else None, checked=bool(c)) for h, c, code in found]


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith(PREFIX)]
    assert lines, f"no error line in:\n{result.stderr[-3000:]}"
    return lines[-1][len(PREFIX) :]


def seed(url: str, key: str, *, keep_lease: bool) -> None:
    cs = CheckpointStore(store=store_from_url(url), identity=Identity.parse(key))
    lease = cs.acquire()
    cs.commit(lease, {"step": 1})
    cs.commit(lease, {"step": 2})
    if not keep_lease:
        cs.release(lease)


def test_the_page_parses_into_entries_with_exit_codes() -> None:
    """The parser below sees every entry; a checked entry without an exit code could not be checked."""
    found = entries()
    assert len(found) >= 15, [e.heading for e in found]
    assert all(e.exit_code is not None for e in found if e.checked)
    assert "create the bucket" in DOC.read_text().lower() and "never creates" in DOC.read_text()


@pytest.mark.s3
@pytest.mark.parametrize("not_s3", ["html"], indirect=True)  # the empty-body 404: test_cli_setup_errors
def test_every_checked_entry_is_what_a_real_command_prints(
    tmp_path: Path, seaweedfs_endpoint: S3Endpoint, not_s3: str
) -> None:
    key = "etl/crunch/run=r1/map=-1"
    local = f"file://{tmp_path / 'state'}"
    (tmp_path / "state").mkdir()
    seed(local, key, keep_lease=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    creds = seaweedfs_endpoint.credentials
    endpoint = str(seaweedfs_endpoint.endpoint_url)
    good = _s3_env(
        seaweedfs_endpoint,
        AWS_ACCESS_KEY_ID=creds["aws_access_key_id"],
        AWS_SECRET_ACCESS_KEY=creds["aws_secret_access_key"],
        AIRFLOW__STATEFUL__CONN_ID="",
        AWS_MAX_ATTEMPTS="1",
    )
    wrong = {**good, "AWS_SECRET_ACCESS_KEY": "wrong-secret-77"}
    nothing = _no_credentials_env(AIRFLOW__STATEFUL__CONN_ID="seaweedd")
    keys_only = _no_credentials_env(
        AWS_ACCESS_KEY_ID="AKIAEXAMPLE000000001", AWS_SECRET_ACCESS_KEY="x", AIRFLOW__STATEFUL__CONN_ID=""
    )
    s3 = ("--backend", f"s3://{seaweedfs_endpoint.bucket}/p", "--endpoint-url")
    commands: list[tuple[tuple[str, ...], dict[str, str] | None]] = [
        (("ls", *s3, f"http://127.0.0.1:{free_port()}"), nothing),
        (("du", *s3, endpoint), wrong),
        (("ls", "--backend", "s3://no-such-bucket-33/p", "--endpoint-url", endpoint), good),
        (("ls", "--backend", "s3://newcomer-state/p", "--endpoint-url", not_s3), keys_only),
        (("du", *s3, f"http://127.0.0.1:{free_port()}"), good),
        (("ls", "--backend", f"file://{tmp_path / 'nope'}"), None),
        (("gc", "etl/crunch/run=manual__2026-12-05T13:05:47+00:00/", "--backend", local, "--dry-run"), None),
        (("cat", key, "--backend", local, "--files", str(full)), None),
        (("rollback", key, "--backend", local, "--to", "1"), None),
        (("show", "--backend", local, "--dag-id", "etl", "--task-id", "load", "--run-id", "r1"), None),
    ]
    page = entries()
    produced: set[str] = set()
    for args, env in commands:
        result = run_script(*args, env=env)
        line = error_line(result)
        matching = [e for e in page if e.matches(line)]
        assert matching, (
            f"`airflow-stateful {' '.join(args)}` printed an error no entry of {DOC.name} has:\n{line}"
        )
        entry = matching[0]
        assert result.returncode == entry.exit_code, (args, result.returncode, entry.heading)
        assert "wrong-secret-77" not in result.stderr
        produced.add(entry.heading)
    unproduced = [e.heading for e in page if e.checked and e.heading not in produced]
    assert not unproduced, f"entries marked *checked* that no command here produced: {unproduced}"
