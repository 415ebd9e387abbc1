"""Helpers for testing stateful DAGs against a real S3 endpoint (used by our own tests and benchmarks)."""
