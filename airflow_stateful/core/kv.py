"""Kept for old imports: the state document format moved to :mod:`airflow_stateful.core.state_documents`."""

from __future__ import annotations

from airflow_stateful.core.state_documents import *  # noqa: F403
