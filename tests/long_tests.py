"""Whether this run is ``make soak``'s (``STATEFUL_LONG_TESTS=1``): the longer scenarios and repetitions that
``make test`` leaves out to stay under 15 minutes run only then. One place that reads the variable."""

from __future__ import annotations

import os

LONG_TESTS = os.environ.get("STATEFUL_LONG_TESTS") == "1"
