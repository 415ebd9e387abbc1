"""The package version, read by hatchling at build time and by the code at run time."""

from __future__ import annotations

__version__ = "0.1.0"
