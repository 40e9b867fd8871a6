"""Thin shared library of the compendium: paths, models, hooks, metrics, data, results.

Import the modules you need: ``from lib import models, hooks, metrics``.
Each paper's story lives in its notebooks; this package holds only what several
notebooks (and every model family) share.
"""
from lib import paths  # noqa: F401  (cheap; the heavy modules load on demand)

__all__ = ["paths", "models", "hooks", "metrics", "data", "results", "plotting", "cache"]
