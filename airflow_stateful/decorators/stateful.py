"""``@stateful_task``, also registered as ``@task.stateful``: the TaskFlow form of StatefulPythonOperator.

.. code-block:: python

    @stateful_task(retries=3, schema_version=2, migrations={1: upgrade_v1_to_v2}, checkpoint_every=10)
    def enrich(rows: list[str], state: TaskState):
        for row in state.resume(rows):  # yields only the items earlier tries did not finish
            handle(row)
        return {"done": len(rows)}

It accepts every argument ``@task`` accepts plus the stateful ones of
:class:`~airflow_stateful.operators.stateful.StatefulOperator`. The function receives ``state`` when it
declares a parameter of that name; callers of the task do not pass it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory

from airflow_stateful.operators.python import STATE_ARG, StatefulPythonOperator


class _StatefulDecoratedOperator(DecoratedOperator, StatefulPythonOperator):
    """Wraps a ``@stateful_task`` function."""

    template_fields: Sequence[str] = StatefulPythonOperator.template_fields
    custom_operator_name: str = "@stateful_task"

    def __init__(
        self, *, python_callable: Callable[..., Any], op_args: Any, op_kwargs: Any, **kwargs: Any
    ) -> None:
        op_kwargs = dict(op_kwargs or {})
        parameters = inspect.signature(python_callable).parameters
        names = list(parameters)
        if STATE_ARG in parameters and STATE_ARG not in op_kwargs:
            if STATE_ARG in names[: len(op_args or ())]:
                raise TypeError(
                    f"{python_callable.__name__}: do not pass '{STATE_ARG}'; it is provided at run time"
                )
            # A placeholder so the call binds at parse time; the real TaskState is injected at run time.
            op_kwargs[STATE_ARG] = None
        kwargs_to_upstream = {"python_callable": python_callable, "op_args": op_args, "op_kwargs": op_kwargs}
        super().__init__(
            kwargs_to_upstream=kwargs_to_upstream,
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            **kwargs,
        )


def stateful_task(
    python_callable: Callable[..., Any] | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """Turn a function into a stateful task that resumes from its last checkpoint on retry."""
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_StatefulDecoratedOperator,
        **kwargs,
    )
