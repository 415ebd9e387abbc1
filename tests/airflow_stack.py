"""A real Airflow deployment on loopback for end-to-end tests: api-server, scheduler (LocalExecutor),
dag-processor and triggerer as subprocesses on SQLite in a temporary AIRFLOW_HOME.

Everything is :mod:`airflow_stateful.testing.local_stack` (``make demo-kill`` uses it too) but :class:`Stack`,
whose failures here are ``pytest.fail`` rather than :class:`~airflow_stateful.testing.local_stack.StackError`.
Used by tests/test_e2e_stack.py (SIGKILL and resume, published outputs), tests/test_e2e_lifetimes.py (lifetimes,
rollbacks, DAG bundles) and tests/test_marks_triggerer.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import pytest

from airflow_stateful.testing import local_stack
from airflow_stateful.testing.local_stack import *  # noqa: F403  (re-exported: the tests import from here)


@dataclass
class Stack(local_stack.Stack):
    """The loopback stack; its failures fail the test."""

    fail: Callable[[str], NoReturn] = field(default=pytest.fail, repr=False)
