"""One figure style and one way to save figures: figures/<model>/<name>.png and .svg (a run at
non-default parameters: results/<model>/runs/<key>/figures/, see lib.params)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

from lib import params, paths

MAX_VECTOR_ELEMENTS = 5000  # a collection with more points or paths than this is rasterized in the SVG


def setup() -> None:
    """Seaborn's paper style, fixed size and DPI, and constrained layout (titles, suptitles and
    colour bars do not overprint each other), so figures look alike across notebooks."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.figsize": (7, 4), "figure.dpi": 100, "savefig.dpi": 120,
                                "savefig.bbox": "tight", "svg.hashsalt": "compendium",
                                "figure.constrained_layout.use": True})


def save(fig, model_name: str, name: str) -> Path:
    """Save ``fig`` to figures/<model>/<name>.png, with an SVG beside it, and return the PNG's path
    (name like '01_probe_accuracy'). Neither file carries a date or software tag (reproducible bytes).
    When the run checked by lib.params.check is for this model and at non-default parameters, the
    figure goes to its run folder instead (results/<model>/runs/<key>/figures/), so an ad-hoc run
    never overwrites a tracked figure."""
    if not name or "/" in name:
        raise ValueError(f"figure name must be a plain file stem, got {name!r}")
    run = params.current()
    if paths.outputs_dir() is not None:  # a test run: never the repository's figures
        folder = paths.outputs_dir() / "figures" / paths.slug(model_name)
        folder.mkdir(parents=True, exist_ok=True)
    elif run is not None and paths.slug(run.model_name) == paths.slug(model_name):
        folder = run.figures_dir()
    else:
        folder = paths.figures_dir(model_name)
    path = folder / f"{name}.png"
    fig.savefig(path, metadata={"Software": None})
    # In the SVG, scatter and mesh layers of many elements (every neuron of a model) are embedded as
    # images; axes, text and lines stay vector (an SVG of 46k points is several MB and slow to open).
    dense = [a for ax in fig.axes for a in ax.collections
             if not a.get_rasterized() and len(a.get_offsets()) + len(getattr(a, "get_paths", list)()) > MAX_VECTOR_ELEMENTS]
    for a in dense:
        a.set_rasterized(True)
    try:
        fig.savefig(path.with_suffix(".svg"), metadata={"Date": None, "Creator": None})
    finally:
        for a in dense:
            a.set_rasterized(False)
    return path
