"""The in-pod checkpoint client: ``python -m airflow_stateful.client restore|save|run``.

It runs inside Kubernetes pods that have only boto3 (no Airflow), so it imports the storage core alone.
StatefulKubernetesPodOperator takes the identity's lease before the pod starts and passes the pod what it
needs in ``STATEFUL_*`` environment variables; credentials come from boto3's standard chain (environment,
files, IRSA / web identity), never from the operator.
"""
