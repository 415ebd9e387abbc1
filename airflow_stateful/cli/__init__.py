"""The ``airflow-stateful`` command line: inspect, verify, roll back and unlock checkpointed state."""
