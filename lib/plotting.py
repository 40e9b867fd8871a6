"""One figure style and one way to save figures: figures/<model>/<name>.png (a run at non-default
parameters: results/<model>/runs/<key>/figures/<name>.png, see lib.params)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

from lib import params, paths


def setup() -> None:
    """Seaborn's paper style, fixed size and DPI, so figures look alike across notebooks."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.figsize": (7, 4), "figure.dpi": 100, "savefig.dpi": 120,
                                "savefig.bbox": "tight", "svg.hashsalt": "compendium"})


def save(fig, model_name: str, name: str) -> Path:
    """Save ``fig`` to figures/<model>/<name>.png and return the path (name like '01_probe_accuracy').
    When the run checked by lib.params.check is for this model and at non-default parameters, the
    figure goes to its run folder instead (results/<model>/runs/<key>/figures/), so an ad-hoc run
    never overwrites a tracked figure."""
    if not name or "/" in name:
        raise ValueError(f"figure name must be a plain file stem, got {name!r}")
    run = params.current()
    if run is not None and paths.slug(run.model_name) == paths.slug(model_name):
        folder = run.figures_dir()
    else:
        folder = paths.figures_dir(model_name)
    path = folder / f"{name}.png"
    fig.savefig(path, metadata={"Software": None})
    return path
