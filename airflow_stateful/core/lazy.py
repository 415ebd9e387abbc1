"""Names a package exports but loads on first use (PEP 562), so importing one module loads only what it needs.

``airflow_stateful`` (Airflow imports ``get_provider_info`` while its configuration loads: an eager import there
is a circular import), ``airflow_stateful.core`` and ``airflow_stateful.core.stores`` each map their exported
names to the modules that define them and answer ``__getattr__`` with :func:`load`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any


def load(package: str, where: Mapping[str, str], name: str) -> Any:
    """``name`` of ``package``, imported from the module ``where`` names for it, and kept in the package."""
    module = where.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[package], name, value)
    return value
