"""StatefulPythonOperator: a PythonOperator whose callable may take ``state`` and resume on retry."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator

from airflow_stateful.core.errors import InvalidValueError
from airflow_stateful.core.records.code_identity import fingerprint_callable
from airflow_stateful.operators.stateful import StatefulOperator
from airflow_stateful.task_state import TaskState

STATE_ARG = "state"


class StatefulPythonOperator(StatefulOperator, PythonOperator):
    """Runs ``python_callable``; when it declares a ``state`` parameter it receives the :class:`TaskState`.

    Takes every argument of ``PythonOperator`` plus the stateful ones of :class:`StatefulOperator`.

    .. code-block:: python

        def enrich(rows, state):
            for row in state.resume(rows):
                handle(row)


        StatefulPythonOperator(task_id="enrich", python_callable=enrich, op_args=[rows], retries=3)
    """

    template_fields: Sequence[str] = (*PythonOperator.template_fields, *StatefulOperator.template_fields)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if inspect.iscoroutinefunction(self.python_callable):
            raise InvalidValueError(
                f"{self.task_id}: async callables are not supported by StatefulPythonOperator yet; use a def."
            )
        self._wants_state = STATE_ARG in inspect.signature(self.python_callable).parameters

    def code_fingerprint(self) -> str | None:
        """The fingerprint of ``python_callable``: what a "code change" means for this operator."""
        return fingerprint_callable(self.python_callable)

    def execute_stateful(self, context: Any, state: TaskState) -> Any:
        if self._wants_state:
            # PythonOperator merges op_kwargs into the context and passes the callable the names it declares.
            self.op_kwargs = {**self.op_kwargs, STATE_ARG: state}
        return PythonOperator.execute(self, context)
