"""Where Airflow's api-server mounts the Stateful view: the one prefix the plugin declares and the pages link by.

Its own module so that the plugin (:mod:`airflow_stateful.plugins.stateful_view`) and the view's pages
(:mod:`.app`, :mod:`.rows`) both import it, and neither imports the other for it.
"""

from __future__ import annotations

URL_PREFIX = "/stateful"
"""The view's mount point under the api-server (``fastapi_apps`` ``url_prefix``)."""
