"""One figure style and one way to save figures: figures/<model>/<name>.png."""
from __future__ import annotations

from pathlib import Path

import matplotlib

from lib import paths


def setup() -> None:
    """Seaborn's paper style, fixed size and DPI, so figures look alike across notebooks."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.figsize": (7, 4), "figure.dpi": 100, "savefig.dpi": 120,
                                "savefig.bbox": "tight", "svg.hashsalt": "compendium"})


def save(fig, model_name: str, name: str) -> Path:
    """Save ``fig`` to figures/<model>/<name>.png and return the path (name like '01_probe_accuracy')."""
    if not name or "/" in name:
        raise ValueError(f"figure name must be a plain file stem, got {name!r}")
    path = paths.figures_dir(model_name) / f"{name}.png"
    fig.savefig(path, metadata={"Software": None})
    return path
