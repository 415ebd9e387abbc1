"""A distributed Airflow cluster on loopback for the ``distributed`` tests (see ``cluster.py``)."""

from __future__ import annotations
