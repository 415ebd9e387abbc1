"""Airflow plugins of the provider (loaded through the ``airflow.plugins`` entry point)."""

from __future__ import annotations
