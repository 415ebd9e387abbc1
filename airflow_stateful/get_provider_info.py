"""Provider metadata for Airflow's provider manager: the single source of name, versions and config.

Airflow imports this module while its own configuration is still loading, so it must import nothing from
Airflow (and nothing that does). A broken return value breaks every Airflow command on the machine, which
is why ``tests/test_provider.py`` runs ``airflow providers list`` and ``airflow config list`` for real.
"""

from __future__ import annotations

from typing import Any

from airflow_stateful.version import __version__

_ADDED = "0.1.0"
_INTEGRATION = "Stateful checkpoints"


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-stateful",
        "name": "Stateful",
        "description": "Durable identity, fenced S3 checkpoints and upgrade-safe resume for Airflow tasks.",
        "versions": [__version__],
        "connection-types": [],
        "integrations": [
            {
                "integration-name": _INTEGRATION,
                "external-doc-url": "https://github.com/airflow-provider-stateful/airflow-provider-stateful/tree/main/docs",
                "tags": ["software"],
            }
        ],
        "sensors": [
            {"integration-name": _INTEGRATION, "python-modules": ["airflow_stateful.sensors.checkpoint"]},
        ],
        "triggers": [
            {"integration-name": _INTEGRATION, "python-modules": ["airflow_stateful.triggers.checkpoint"]},
        ],
        "task-decorators": [
            {"name": "stateful", "class-name": "airflow_stateful.decorators.stateful.stateful_task"},
        ],
        "config": {
            "stateful": {
                "description": "Where airflow-provider-stateful keeps checkpoints, and how.",
                "options": {
                    "backend_url": {
                        "description": (
                            "Where checkpoints live: s3://bucket/prefix for S3 or any S3-compatible store, or "
                            "file:///absolute/path for a local directory. Empty means "
                            "file://{AIRFLOW_HOME}/stateful, which suits a single machine only."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "s3://my-bucket/airflow-state",
                        "default": "",
                    },
                    "conn_id": {
                        "description": (
                            "Airflow connection (type aws) with the S3 credentials, region and, for MinIO and "
                            "other S3-compatible stores, endpoint_url in its extra. When the connection does "
                            "not exist, boto3's standard credential chain is used."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "minio_state",
                        "default": "aws_default",
                    },
                    "lease_ttl": {
                        "description": (
                            "Seconds a writer's lease lives without a commit or renewal. After that another "
                            "writer may take it without stealing. Retries always take it over at once."
                        ),
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "600",
                        "default": "600",
                    },
                    "keep_last": {
                        "description": "How many committed checkpoints each identity keeps (at least 1).",
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "3",
                        "default": "3",
                    },
                },
            }
        },
    }
