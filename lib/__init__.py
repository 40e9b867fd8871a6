"""Thin shared library of the compendium: paths, models, hooks, metrics, data, results.

Import the modules you need: ``from lib import models, hooks, metrics``.
Each paper's story lives in its notebooks; this package holds only what several
notebooks (and every model family) share.
"""
import os
import warnings

# tqdm.auto warns (with this machine's site-packages path) when ipywidgets is absent; the text bars are fine.
warnings.filterwarnings("ignore", message="IProgress not found")

# Bars off (COMPENDIUM_PROGRESS=0, set by the runner, `make reproduce` and nbval): transformers' and
# the hub's bars ("Loading weights") read this variable when transformers is first imported.
if os.environ.get("COMPENDIUM_PROGRESS", "").strip().lower() in {"0", "false", "no", "off"}:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from lib import paths  # noqa: E402,F401  (cheap; the heavy modules load on demand)

__all__ = ["paths", "models", "hooks", "metrics", "data", "results", "plotting", "cache"]
