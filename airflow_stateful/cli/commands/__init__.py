"""The verbs of ``airflow-stateful``, grouped by subject; :mod:`airflow_stateful.cli.definition` names which
function runs each, and imports it only when that verb runs."""
