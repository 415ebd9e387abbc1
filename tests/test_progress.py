"""Long transfers log their progress, so a task log shows a 20-minute upload is alive and how far it got."""

from __future__ import annotations

import logging

import pytest
from contract.faults import FakeClock

from airflow_stateful.core.data.transfer_progress import TransferProgress, human_bytes


def test_progress_logs_at_most_every_interval_and_a_final_summary(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(0.0)
    logger = logging.getLogger("test.progress")
    progress = TransferProgress(
        label="uploading 1 file(s)", total_bytes=100 * 2**20, logger=logger, clock=clock
    )
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for _ in range(10):
            clock.advance(1.0)
            progress(5 * 2**20)  # 5 MiB a second
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "uploading 1 file(s): 25.0 MiB of 100.0 MiB (25%) at 5.0 MiB/s",
        "uploading 1 file(s): 50.0 MiB of 100.0 MiB (50%) at 5.0 MiB/s",
        "uploading 1 file(s): 50.0 MiB in 10.0 s (5.0 MiB/s)",
    ]


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * 2**30, "3.0 GiB"), (2**50, "1024.0 TiB")],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text
