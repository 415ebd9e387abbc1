"""``check``: try the deployment's configuration before a task does.

Every configuration mistake (a mistyped ``conn_id``, wrong keys, an endpoint that is not S3, a missing bucket, an
endpoint that ignores conditional writes, a signing connection that does not exist) used to surface only when a
task first ran. ``check`` reads ``[stateful]`` and the connections exactly as a worker does (through
:class:`~airflow_stateful.hooks.state.StateHook`, Airflow's configuration, secrets backends and database
included), then writes, reads back, lists and deletes a probe object under the configured prefix and tries both
conditional writes (:func:`airflow_stateful.core.stores.probe.probe_store`), and asks Airflow's REST API when
``[stateful] airflow_conn_id`` is set, as the maintenance DAG's GC would.

One line per check (``ok``, ``FAIL``, ``warn``, ``skip``; what was checked; for a failure, what to fix, naming
the setting), or JSON with ``--json``. Exit 0 when nothing failed (warnings included), 2 on any failure: every
one is a configuration, credential or reachability problem. No secret is printed: the store's and the hooks'
messages never hold one, and nothing else here reads a secret.

The verb opens the store itself, step by step (``opens_store`` in its parser), so that a step that fails is a
line of its own and the steps after it still run where they can.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from airflow_stateful.cli.exit_codes import EXIT_OK, EXIT_USAGE
from airflow_stateful.cli.opening import logs_to_stderr
from airflow_stateful.core.stores.base import ObjectStore
from airflow_stateful.core.stores.local import LocalObjectStore
from airflow_stateful.core.stores.probe import FAIL, OK, SKIP, WARN, Finding, describe_error, probe_store

if TYPE_CHECKING:
    from airflow_stateful.hooks.state import StateHook

_CHECK_DAG = "~airflow-stateful-check"
"""The DAG the Airflow API check asks about: Airflow's DAG ids cannot hold ``~``, so it never exists."""


def cmd_check(args: argparse.Namespace, store: ObjectStore | None = None) -> int:
    """Run every check and print them; the ``store`` argument is unused (``main`` opens none for this verb)."""
    findings = list(_checks(args))
    if args.json:
        json.dump([f.to_json() for f in findings], args.out, indent=2)
        args.out.write("\n")
    else:
        width = max(len(f.check) for f in findings)
        for f in findings:
            fix = f" -> fix: {f.fix}" if f.fix else ""
            print(f"{f.status:<4}  {f.check:<{width}}  {f.detail}{fix}", file=args.out)
    return EXIT_USAGE if any(f.status == FAIL for f in findings) else EXIT_OK


def _checks(args: argparse.Namespace) -> list[Finding]:
    findings: list[Finding] = []
    try:
        from airflow_stateful.hooks.state import StateHook

        endpoint_url = args.endpoint_url or os.environ.get("STATEFUL_S3_ENDPOINT_URL") or None
        hook = StateHook(backend_url=args.backend, conn_id=args.conn_id, endpoint_url=endpoint_url)
    except Exception as exc:
        logs_to_stderr()
        fix = "the option the message names, in [stateful] of airflow.cfg or AIRFLOW__STATEFUL__<OPTION>"
        return [Finding("settings", FAIL, describe_error(exc), fix)]
    logs_to_stderr()  # after Airflow (imported above) configured logging: keep stdout for the result
    try:
        settings = hook.settings
        findings.append(Finding("settings", OK, _settings_line(args, hook)))
        s3 = urlparse(hook.backend_url).scheme == "s3"
        connection_ok = _connection(args, hook, findings) if s3 else True
        signing_ok = _signing(hook, findings)
        if connection_ok and signing_ok:
            _probe(args, hook, findings, s3=s3)
        else:
            findings.append(Finding("store", SKIP, "not probed: fix the failures above first"))
        _airflow_api(settings.airflow_conn_id, findings)
    finally:
        hook.close()
    return findings


def _settings_line(args: argparse.Namespace, hook: StateHook) -> str:
    backend = f"{hook.backend_url} (--backend)" if args.backend else f"{hook.backend_url}"
    conn = "(--conn-id)" if args.conn_id else ""
    return (
        f"[stateful] read as a worker reads it: backend_url {backend}, conn_id {hook.conn_id!r}{conn}, "
        f"lease_ttl {hook.lease_ttl:g}s, keep_last {hook.keep_last}"
    )


def _conn_setting(args: argparse.Namespace) -> str:
    return "--conn-id" if args.conn_id else "[stateful] conn_id"


def _connection(args: argparse.Namespace, hook: StateHook, findings: list[Finding]) -> bool:
    """The S3 connection, read and checked as the store will use it; ``False`` when it cannot be used."""
    from airflow_stateful.s3_connection import missing_connection_source

    setting = _conn_setting(args)
    if not hook.conn_id:
        findings.append(
            Finding("connection", OK, f"{setting} is empty: credentials from boto3's standard chain")
        )
        return True
    try:
        options = hook.s3_options()
    except Exception as exc:
        fix = f"the connection {hook.conn_id!r} ({setting}): the key the message names"
        findings.append(Finding("connection", FAIL, describe_error(exc), fix))
        return False
    source = hook.credential_source  # in words, set by s3_options(); never a secret
    if source == missing_connection_source(hook.conn_id):
        findings.append(
            Finding(
                "connection",
                WARN,
                f"the connection {hook.conn_id!r} ({setting}) does not exist: boto3's standard credential chain "
                "is used, with no endpoint_url or region from a connection. Right for an instance role or IRSA; "
                f"otherwise {setting} is mistyped",
            )
        )
        return True
    endpoint = hook.endpoint_url or options.get("endpoint_url") or "AWS"
    region = options.get("region_name") or "boto3's default"
    findings.append(
        Finding(
            "connection",
            OK,
            f"connection {hook.conn_id!r} ({setting}): credentials from {source}, endpoint {endpoint}, "
            f"region {region}",
        )
    )
    return True


def _signing(hook: StateHook, findings: list[Finding]) -> bool:
    """The head signing policy, as every reader and writer will use it; ``False`` when it is unusable."""
    settings = hook.settings
    try:
        signer = hook.head_signer()
    except Exception as exc:
        conn = settings.signing_conn_id
        fix = (
            f"[stateful] signing_conn_id {conn!r}: a connection whose password (16+ bytes) is the key, extra "
            "key_id optional"
            if conn
            else "[stateful] signing_conn_id (a connection whose password is the key), or unset "
            "require_signed_heads"
        )
        findings.append(Finding("signing", FAIL, describe_error(exc), fix))
        return False
    if signer is None:
        findings.append(Finding("signing", OK, "[stateful] signing_conn_id is empty: heads are not signed"))
        return True
    required = "required" if signer.required else "not required (require_signed_heads is off)"
    findings.append(
        Finding(
            "signing",
            OK,
            f"heads signed with the password of connection {settings.signing_conn_id!r} (key id "
            f"{signer.key_id!r}, {len(signer.key)} bytes), signatures {required}; high-water marks kept as "
            "Airflow Variables stateful_mark_<hash>",
        )
    )
    return True


def _probe(args: argparse.Namespace, hook: StateHook, findings: list[Finding], *, s3: bool) -> None:
    where = "--backend" if args.backend else "[stateful] backend_url"
    try:
        store = hook.get_store()
    except Exception as exc:
        findings.append(Finding("store", FAIL, describe_error(exc), f"{where}, and the connection's extra"))
        return
    local = store if isinstance(store, LocalObjectStore) else None
    created = local is not None and not local.exists()
    if s3:
        fix = f"check {where} (bucket, prefix), {_conn_setting(args)} {hook.conn_id!r} (its keys, extra endpoint_url)"
    else:
        fix = f"check {where}: a directory this user may create and write"
    findings.extend(probe_store(store, fix=fix))
    if local is not None and created and local.exists():
        findings.append(
            Finding(
                "directory",
                WARN,
                f"{local.root} did not exist: the probe created it, as a task's first write would. Make sure "
                f"{where} names the directory you meant, on a disk every worker of this machine shares",
            )
        )


def _airflow_api(conn_id: str, findings: list[Finding]) -> None:
    """Airflow's REST API through ``[stateful] airflow_conn_id``, asked as GC asks (a task instance's state)."""
    if not conn_id:
        findings.append(
            Finding(
                "airflow-api",
                OK,
                "[stateful] airflow_conn_id is empty: the maintenance DAG's GC decides by the heads' outcomes",
            )
        )
        return
    fix = (
        f"[stateful] airflow_conn_id {conn_id!r}: a connection of type http, host the API server's URL, "
        "login/password a user that may read the DAGs (or extra token)"
    )
    try:
        from airflow_stateful.hooks.airflow_api import AirflowApiHook

        states = AirflowApiHook(airflow_conn_id=conn_id).run_states()
    except Exception as exc:
        findings.append(Finding("airflow-api", FAIL, describe_error(exc), fix))
        return
    answer = states.ask(dag_id=_CHECK_DAG, run_id="~check", task_id="~check", map_index=-1)
    if answer.error:
        findings.append(
            Finding("airflow-api", FAIL, f"Airflow's REST API could not be asked: {answer.error}", fix)
        )
    elif answer.dag_known:
        findings.append(
            Finding(
                "airflow-api",
                WARN,
                f"{states.base_url} answered as if a DAG {_CHECK_DAG!r} existed: is it Airflow's API server?",
            )
        )
    else:
        findings.append(
            Finding(
                "airflow-api",
                OK,
                f"Airflow's REST API at {states.base_url} answered (connection {conn_id!r})",
            )
        )
