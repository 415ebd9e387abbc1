"""Provider metadata for Airflow's provider manager: the single source of name, versions and config.

Airflow imports this module while its own configuration is still loading, so it must import nothing from
Airflow (and nothing that does). A broken return value breaks every Airflow command on the machine, which
is why ``tests/test_provider.py`` runs ``airflow providers list`` and ``airflow config list`` for real.

What Airflow 3.3 does with each key (read in ``airflow/providers_manager.py``; the layout follows the
first-party providers' generated ``get_provider_info.py``):

* ``hooks``, ``operators`` and ``sensors`` are metadata only: Airflow never imports these modules (no
  ``airflow providers`` verb lists them; ``airflow providers get --full`` shows them). Measured: a module
  that cannot be imported in any of these lists (``triggers`` too) gives no error and no warning. So
  ``airflow_stateful.operators.kubernetes``, which needs the optional ``kubernetes`` extra, is listed like
  the other operators: without the extra nothing breaks; only a DAG that imports it fails
  (ModuleNotFoundError for ``airflow.providers.cncf.kubernetes``).
* ``triggers`` is what ``airflow providers triggers`` prints (module names, not imported).
* ``task-decorators`` registers ``@task.stateful``; the class is imported on first use.
* ``plugins``: the plugin is loaded by default through the ``airflow.plugins`` entry point (pyproject.toml);
  Airflow loads provider-listed plugins only when ``[core] lazy_discover_providers`` is False, and then
  keeps the first of two plugins with the same name: it logs "Plugin 'stateful' already registered,
  skipping" and lists that line among the plugin import errors. The first-party openlineage provider does
  the same (its plugin is in both places), so we list it for completeness of the metadata.
* ``connection-types`` maps a connection type to a hook class; the first provider in package-name order
  wins and the others only log "already registered". ``StateHook`` reads connections of type ``aws``, which
  belongs to the amazon provider, and "airflow-provider-stateful" sorts before
  "apache-airflow-providers-amazon": claiming ``aws`` here would silently take it over (the UI's AWS
  connection form and ``Connection.get_hook()`` would give a ``StateHook``). So we list none.
* ``config``: every default is written, uncommented, into the ``airflow.cfg`` Airflow creates on its first
  command, and a string default is first formatted with Airflow's own variables. ``backend_url``'s
  ``file://{AIRFLOW_HOME}/stateful`` is marked ``is_template`` (as core options like ``log_filename_template``
  are) so it is kept as written: the store resolves ``{AIRFLOW_HOME}`` when it opens, which is what the empty
  default it replaced did, rather than freezing one machine's path into the file.
* No dependency keys: the 3.3 schema has none (first-party providers keep them in pyproject.toml only), and
  our pyproject.toml is their single source, extras included.
"""

from __future__ import annotations

from typing import Any

from airflow_stateful.config import DEFAULT_BACKEND_URL
from airflow_stateful.core.settings import CONN_ID, KEEP_LAST, LEASE_GRACE, LEASE_TTL, RESTORE_CACHE_MAX_BYTES
from airflow_stateful.version import __version__

# Every option is new in the first release: nothing was published before it (docs/releasing.md says how a later
# release marks what it adds).
_ADDED = "0.1.0"
_INTEGRATION = "Stateful checkpoints"


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-stateful",
        "name": "Stateful",
        "description": "Durable identity, fenced S3 checkpoints and upgrade-safe resume for Airflow tasks.",
        "versions": [__version__],
        # StateHook uses the amazon provider's `aws` type; claiming it would take it over (see above).
        "connection-types": [],
        "integrations": [
            {
                "integration-name": _INTEGRATION,
                "external-doc-url": "https://github.com/airflow-provider-stateful/airflow-provider-stateful/tree/main/docs",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {"integration-name": _INTEGRATION, "python-modules": ["airflow_stateful.hooks.state"]},
        ],
        "operators": [
            {
                "integration-name": _INTEGRATION,
                "python-modules": [
                    "airflow_stateful.operators.stateful",
                    "airflow_stateful.operators.python",
                    "airflow_stateful.operators.gc",
                    "airflow_stateful.operators.stuck",
                    # Needs the `kubernetes` extra; metadata only, never imported by Airflow (see above).
                    "airflow_stateful.operators.kubernetes",
                ],
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
        "plugins": [
            {"name": "stateful", "plugin-class": "airflow_stateful.plugins.stateful_view.StatefulPlugin"},
        ],
        "config": {
            "stateful": {
                "description": "Where airflow-provider-stateful keeps checkpoints, and how.",
                "options": {
                    "backend_url": {
                        "description": (
                            "Where checkpoints live: s3://bucket/prefix for S3 or any S3-compatible store, or "
                            "file:///absolute/path for a local directory. The default, "
                            f"{DEFAULT_BACKEND_URL}, is a directory under the AIRFLOW_HOME of the process that "
                            "opens the store (read when it runs); it suits a single machine only. Empty means "
                            "the same."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "s3://my-bucket/airflow-state",
                        "default": DEFAULT_BACKEND_URL,
                        # Shown and kept as written: the store resolves {AIRFLOW_HOME} itself, as it did when
                        # the default was empty (airflow_stateful.config.default_backend_url).
                        "is_template": True,
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
                        "default": CONN_ID,
                    },
                    "lease_ttl": {
                        "description": (
                            "Seconds a writer's lease lives after its last renewal. Writers renew it in the "
                            "background about every third of this, so a task may compute for hours between "
                            "two saves; a killed writer's lease expires this long after its last renewal. "
                            "Then another writer may take it without stealing (retries always take it over "
                            "at once). Also accepts durations such as 10m."
                        ),
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "600",
                        "default": str(LEASE_TTL),
                    },
                    "lease_grace": {
                        "description": (
                            "Seconds past a lease's expiry before maintenance (airflow-stateful gc, the "
                            "maintenance DAG) may break it. Covers clock skew between the host that renews a "
                            "lease and the host that judges it: keep it well above your worst skew."
                        ),
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "60",
                        "default": str(LEASE_GRACE),
                    },
                    "signing_conn_id": {
                        "description": (
                            "Airflow connection whose password is a key (16 bytes or more) used to sign every "
                            "head record this deployment writes (HMAC-SHA256) and to verify every head it "
                            "reads; its extra may name the key (key_id, default: the connection id). Empty: "
                            "heads are not signed. Any secrets backend can hold the connection."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "stateful_signing",
                        "default": "",
                    },
                    "require_signed_heads": {
                        "description": (
                            "With signing_conn_id: refuse heads that carry no signature by this deployment's "
                            "key (written before signing was turned on, by a writer without the key, or "
                            "forged by someone who can write to the bucket)."
                        ),
                        "version_added": _ADDED,
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                    "keep_last": {
                        "description": "How many committed checkpoints each identity keeps (at least 1).",
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "3",
                        "default": str(KEEP_LAST),
                    },
                    # No default here on purpose: Airflow would store it as the option's value, and an empty
                    # value must stay distinguishable from "not set" (empty turns the cache off).
                    "restore_cache_dir": {
                        "description": (
                            "A directory on the worker where tasks keep the checkpoint chunks they saved or "
                            "restored, so a retry on the same machine restores unchanged chunks without "
                            "downloading them. Every chunk read from it is checked against the SHA-256 "
                            "the committed checkpoint records (a file that does not match is deleted and the "
                            "chunk downloaded). Created with mode 0700; a directory that is a symbolic link or "
                            "owned by another user is refused (the restore then downloads). Not set: "
                            "<temp dir>/airflow-stateful-cache-<uid>. Set to an empty value to turn the "
                            "cache off."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "/var/cache/airflow-stateful",
                        "default": None,
                    },
                    "restore_cache_max_bytes": {
                        "description": (
                            "Bytes the restore cache keeps at most, per directory; beyond it the least "
                            "recently used chunks are deleted. A checkpoint larger than this is not cached. "
                            "0 turns the cache off."
                        ),
                        "version_added": _ADDED,
                        "type": "integer",
                        "example": "4294967296",
                        "default": str(RESTORE_CACHE_MAX_BYTES),
                    },
                    "expected_checkpoint_interval": {
                        "description": (
                            "How long a writer may hold a live lease without committing a checkpoint before "
                            "it counts as stuck (alive but making no progress; distinct from dead, whose "
                            "lease expired). `airflow-stateful ls`/`stuck`, the UI, the CheckpointSensor's "
                            "stuck mode and the stateful.stuck metric use it for tasks that declare no "
                            "expected_checkpoint_interval of their own. Seconds or a duration like 30m."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "30m",
                        "default": "3600",
                    },
                    "release_after_success": {
                        "description": (
                            "How long after a task succeeded GC releases (deletes) the state of its DAG run. "
                            "Unset (the default): it ages out by GC's idle_for like any other state, as before. "
                            "Named identities (state across runs) are never released by success. Seconds or a "
                            "duration like 7d; 0 or never: unset."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "7d",
                        "default": "",
                    },
                    "keep_failed_for": {
                        "description": (
                            "How long GC keeps the per-run state of a task that failed for good (no retry "
                            "left) at least, whatever idle_for says, so that a task cleared in that time "
                            "resumes from its checkpoint. Seconds or a duration; 0 or never: no minimum."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "90d",
                        "default": "30d",
                    },
                    "airflow_conn_id": {
                        "description": (
                            "An Airflow connection (type http: host is Airflow's API server URL, login and "
                            "password a user that may read the DAGs) through which GC in the maintenance DAG "
                            "asks Airflow whether a run is finished before it deletes the run's state. GC keeps "
                            "a run's state when it cannot tell. Empty: GC judges by the head alone. The "
                            "airflow-stateful CLI asks Airflow's metadata database instead, where configured."
                        ),
                        "version_added": _ADDED,
                        "type": "string",
                        "example": "airflow_api",
                        "default": "",
                    },
                },
            }
        },
    }
