"""Kubernetes training: a long training job in a pod that resumes from its last checkpoint after any stop.

Two tasks train the same kind of model in two ways:

* ``train_wrapped``: the image contains the client (``pip install airflow-provider-stateful`` without
  extras is enough: the client needs boto3 only), so the job's command runs under
  ``python -m airflow_stateful.client run``, which restores ``/state``, saves it every 5 minutes, and once
  more when the job exits or the pod is stopped;
* ``train_unchanged_image``: the image cannot be changed, so an init container from ``client_image``
  restores ``/state`` and a native sidecar (Kubernetes >= 1.29) saves it.

Credentials come from the Kubernetes Secret ``stateful-s3`` (keys ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``) or, with ``service_account_name``, from workload identity; the Airflow
connection's credentials never reach the pod. See docs/kubernetes.md.

This DAG needs a Kubernetes cluster and an S3 bucket that both the workers and the pods reach, so the test
suite only imports it (tests/test_dags.py); it is not run with ``dag.test()``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag

from airflow_stateful.operators.kubernetes import StatefulKubernetesPodOperator


def v1_to_v2(value: dict[str, Any] | None) -> dict[str, Any]:
    """Version 1 of the job wrote ``{"epoch": n}``; version 2 also records the learning rate schedule."""
    return {"epoch": (value or {}).get("epoch", 0), "schedule": "cosine"}


@dag(
    dag_id="kubernetes_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 3, "retry_delay": timedelta(minutes=1)},
    tags=["example", "stateful", "kubernetes"],
)
def kubernetes_training() -> None:
    # [START kubernetes_training_wrapped]
    StatefulKubernetesPodOperator(
        task_id="train_wrapped",
        image="registry.example.com/trainer:2",
        cmds=["python", "train.py", "--checkpoint-dir", "/state"],
        namespace="ml",
        backend_url="s3://ml-state/checkpoints",
        credentials_secret="stateful-s3",
        schema_version=2,
        migrations={1: v1_to_v2},
        save_every=timedelta(minutes=5),
        termination_grace_period=120,
    )
    # [END kubernetes_training_wrapped]

    # [START kubernetes_training_sidecar]
    StatefulKubernetesPodOperator(
        task_id="train_unchanged_image",
        image="registry.example.com/vendor-trainer:7",
        cmds=["/opt/train", "--out", "/state"],
        namespace="ml",
        identity="vendor-model",  # one model trained across DAG runs
        backend_url="s3://ml-state/checkpoints",
        state_mode="sidecar",
        client_image="registry.example.com/stateful-client:1",
        service_account_name="trainer",  # workload identity (IRSA, GKE): no Secret needed
        termination_grace_period=300,
        startup_timeout_seconds=900,  # restoring a large checkpoint happens before the pod "starts"
    )
    # [END kubernetes_training_sidecar]


dag_object = kubernetes_training()
