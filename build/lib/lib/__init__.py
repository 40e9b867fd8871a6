"""Thin shared library of the compendium, in three layers whose imports point one way (papers -> core -> infra):

* the core, here: models (loading), hooks, metrics (generation and scores), stats, verdict, data, plotting,
  shared by every paper and model family: ``from lib import models, hooks, metrics``;
* :mod:`lib.papers`: each paper's own code, one package per paper (a paper never imports another);
* :mod:`lib.infra`: paths, cache, seeds, the measurement store, parameters, ledgers, running and testing.

Each paper's story lives in its notebooks. ``python -m lib --help`` lists the commands.
"""
import importlib.util
import os
import sys
import warnings

# Outside the compendium's environment (`python3 -m lib ...` with the system Python) the first heavy
# import would fail with a bare ModuleNotFoundError: say instead which package is missing and what to run.
# find_spec only looks for the package, it imports nothing. lib.infra.colab runs before anything is installed
# (it installs the environment on Colab and Binder), so `python -m lib.infra.colab` is let through.
CORE_PACKAGES = ("numpy", "pandas", "torch", "transformers", "papermill")


def _check_environment() -> None:
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["lib.infra.colab"]:
        return
    missing = next((name for name in CORE_PACKAGES if importlib.util.find_spec(name) is None), None)
    if missing:
        raise SystemExit(f"lib needs the package {missing!r}, which {sys.executable} cannot import: run `make setup` "
                         "and use .venv/bin/python (or activate .venv)")


_check_environment()

# tqdm.auto warns (with this machine's site-packages path) when ipywidgets is absent; the text bars are fine.
warnings.filterwarnings("ignore", message="IProgress not found")

# Bars off (COMPENDIUM_PROGRESS=0, set by the runner, `make reproduce` and nbval): transformers' and
# the hub's bars ("Loading weights") read this variable when transformers is first imported.
if os.environ.get("COMPENDIUM_PROGRESS", "").strip().lower() in {"0", "false", "no", "off"}:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


__all__ = ["models", "hooks", "metrics", "stats", "verdict", "data", "plotting"]
