"""Thin shared library of the compendium: paths, models, hooks, metrics, data, results.

Import the modules you need: ``from lib import models, hooks, metrics``.
Each paper's story lives in its notebooks; this package holds only what several
notebooks (and every model family) share.
"""
import warnings

# tqdm.auto warns (with this machine's site-packages path) when ipywidgets is absent; the text bars are fine.
warnings.filterwarnings("ignore", message="IProgress not found")

from lib import paths  # noqa: E402,F401  (cheap; the heavy modules load on demand)

__all__ = ["paths", "models", "hooks", "metrics", "data", "results", "plotting", "cache"]
