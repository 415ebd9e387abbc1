"""The Stateful view that :mod:`airflow_stateful.plugins.stateful_view` mounts in Airflow's api-server.

* :mod:`.urls`: the one URL prefix the plugin declares and the pages link by;
* :mod:`.app`: the FastAPI app (its routes, security headers, error pages, the work gate);
* :mod:`.access`: who may see what (Airflow's auth manager, DAG by DAG);
* :mod:`.rows`: the listing of identities, :mod:`.task` and :mod:`.run`: the Checkpoints tabs of a task
  instance and of a DAG run, :mod:`.chart`: the tab's progress chart;
* :mod:`.budget`: what one tab may still read, and the one reader of manifests that obeys it;
* :mod:`.params`: what a request asks for, read from its path and query and checked first.

This package imports nothing on purpose: the plugin module imports :mod:`.urls` in every process that loads
plugins (task processes included), and must not pull in the view, which needs the api-server's security module
and Airflow's DB models.
"""

from __future__ import annotations
