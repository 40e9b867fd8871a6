"""Every path of the compendium, derived from the project root (never the working directory)."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (lib/infra/paths.py)
DATA = ROOT / "data"
NOTEBOOKS = ROOT / "notebooks"
FIGURES = ROOT / "figures"
RESULTS = ROOT / "results"
PARAMS = ROOT / "params"
# Expensive artifacts (converted models, probes, DPO checkpoints, activation statistics).
CACHE = Path(os.environ.get("COMPENDIUM_CACHE", ROOT / ".cache")).resolve()
# Set by make test (and the test suite): the figures and per-notebook ledger records a run writes go under this
# folder (figures/<model>/, results/<model>/) instead of the repository's, so testing changes no tracked file.
OUTPUTS_ENV = "COMPENDIUM_OUTPUTS"


# Set by the command that publishes (``lib.infra.runner run``, which `make reproduce` runs for each notebook it names):
# only then does a run at the published parameters write the tracked figures and the ledger records. Any other
# run (papermill by hand, Jupyter, a dependency of a subset) writes to results/<model>/runs/<key>/ instead.
PUBLISH_ENV = "COMPENDIUM_PUBLISH"


def publishing() -> bool:
    """Whether this run publishes (COMPENDIUM_PUBLISH=1): see PUBLISH_ENV."""
    return os.environ.get(PUBLISH_ENV, "").strip() == "1"


def outputs_dir() -> Path | None:
    """The folder of COMPENDIUM_OUTPUTS, or None when a run writes into the repository (the published outputs)."""
    raw = os.environ.get(OUTPUTS_ENV, "").strip()
    return Path(raw) if raw else None


def slug(name: str) -> str:
    """A file-system-safe name for a model id or path: 'meta-llama/Llama-3.1-8B' -> 'meta-llama--Llama-3.1-8B'."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "--", str(name).strip().rstrip("/"))
    return s.strip("-") or "model"


def figures_dir(model_name: str) -> Path:
    d = FIGURES / slug(model_name)
    d.mkdir(parents=True, exist_ok=True)
    return d


def results_dir(model_name: str) -> Path:
    d = RESULTS / slug(model_name)
    d.mkdir(parents=True, exist_ok=True)
    return d
