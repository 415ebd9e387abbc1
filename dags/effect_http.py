"""Effect keys, pattern 2: HTTP calls with an ``Idempotency-Key`` header, so a retry charges nobody twice.

A ``@stateful_task`` POSTs one charge per invoice to a payment API and checkpoints every 4 invoices. A retry
resumes from the last checkpoint, so it repeats the calls made after that checkpoint, including one whose
answer the crash lost. Each call carries ``Idempotency-Key: state.effect_key(f"charge-{n}")``, the same in
both tries. An API that honours the header (Stripe, Adyen, PayPal; the IETF draft "The Idempotency-Key HTTP
Header Field") applies the first request with a key and answers every repeat with the stored response: the
retry learns the charge id of the first call instead of charging again. Without the header, each repeated
call would be a second charge.

The endpoint is the run parameter ``endpoint``, else ``STATEFUL_DEMO_HTTP_URL``. The test suite runs the DAG
against a small server honouring the header (tests/test_effect_dags.py). Only the standard library is used;
``HttpHook`` of apache-airflow-providers-http sends the same header with ``headers=``.

Run parameter ``fail_at_item`` (default -1: never): on try 1 the task crashes right after the call for that
invoice returned, before the next checkpoint. Run it alone against such an endpoint::

    export STATEFUL_DEMO_HTTP_URL=http://127.0.0.1:8000/charges
    AIRFLOW__CORE__DAGS_FOLDER=dags python dags/effect_http.py
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, get_current_context

from airflow_stateful import TaskState, stateful_task
from airflow_stateful.compat import AirflowFailException

log = logging.getLogger(__name__)

INVOICES = 10
CHECKPOINT_EVERY = 4


def post_charge(url: str, invoice: int, idempotency_key: str) -> dict[str, Any]:
    """POST one charge; the API answers a repeated key with the first call's response."""
    body = json.dumps({"invoice": invoice, "cents": 100 * (invoice + 1)}).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": idempotency_key}
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:  # raises on 4xx and 5xx
        if response.headers.get("Idempotent-Replayed") == "true":
            log.info("invoice %d: already charged by an earlier try, the API replayed its answer", invoice)
        result: dict[str, Any] = json.load(response)
        return result


@dag(
    dag_id="effect_http",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    params={"fail_at_item": -1, "endpoint": ""},
    tags=["stateful", "example"],
)
def effect_http() -> None:
    # [START effect_http]
    @stateful_task(retries=1, retry_delay=timedelta(0), checkpoint_every=CHECKPOINT_EVERY)
    def charge_invoices(state: TaskState) -> dict[str, list[str]]:
        context = get_current_context()
        try_number, fail_at_item = context["ti"].try_number, int(context["params"]["fail_at_item"])
        url = context["params"]["endpoint"] or os.environ.get("STATEFUL_DEMO_HTTP_URL")
        if not url:
            raise AirflowFailException("set the run parameter 'endpoint' or STATEFUL_DEMO_HTTP_URL")
        state.value = state.value or {"charge_ids": []}
        for n in state.resume(range(INVOICES)):  # a retry starts at the last checkpoint, not at 0
            charge = post_charge(url, n, idempotency_key=state.effect_key(f"charge-{n}"))
            if try_number == 1 and n == fail_at_item:
                raise RuntimeError(f"simulated crash after charging invoice {n}: its answer is lost")
            state.value = {"charge_ids": [*state.value["charge_ids"], charge["id"]]}
        return state.value

    # [END effect_http]
    charge_invoices()


dag_object = effect_http()

if __name__ == "__main__":
    dag_object.test(run_conf={"fail_at_item": 6})
