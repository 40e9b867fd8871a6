"""One figure style and one way to save figures: figures/<model>/<name>.png and .svg (a run at
non-default parameters: results/<model>/runs/<key>/figures/, see lib.infra.params)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

from lib.infra import params, paths

MAX_VECTOR_ELEMENTS = 5000  # a collection with more points or paths than this is rasterized in the SVG


def setup() -> None:
    """Seaborn's paper style, fixed size and DPI, and constrained layout (titles, suptitles and
    colour bars do not overprint each other), so figures look alike across notebooks."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
    matplotlib.rcParams.update({"figure.figsize": (7, 4), "figure.dpi": 100, "savefig.dpi": 120,
                                "savefig.bbox": "tight", "svg.hashsalt": "compendium",
                                "figure.constrained_layout.use": True})


def save(fig, run: params.Run | str, name: str) -> Path:
    """Save ``fig`` to figures/<model>/<name>.png, with an SVG beside it, and return the PNG's path
    (name like '01_probe_accuracy'). Neither file carries a date or software tag (reproducible bytes).
    ``run``: the notebook's run (:func:`lib.nb.start`): at non-default parameters, or when the run does not
    publish, the figure goes to its run folder instead (results/<model>/runs/<key>/figures/), so an ad-hoc run
    never overwrites a tracked figure; or a model name, for figures/<model>/ itself."""
    if not name or "/" in name:
        raise ValueError(f"figure name must be a plain file stem, got {name!r}")
    model_name = run if isinstance(run, str) else run.model_name
    if paths.outputs_dir() is not None:  # a test run: never the repository's figures
        folder = paths.outputs_dir() / "figures" / paths.slug(model_name)
        folder.mkdir(parents=True, exist_ok=True)
    else:
        folder = paths.figures_dir(model_name) if isinstance(run, str) else run.figures_dir()
    path = folder / f"{name}.png"
    mark = f"compendium figure {fingerprint(fig)}"
    if path.exists() and path.with_suffix(".svg").exists() and _mark_of(path) == mark:
        return path  # the same numbers drawn again: the files stay as they are (no float-level redraw noise)
    fig.savefig(path, metadata={"Software": None, "Comment": mark})
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


SIGNIFICANT = 4  # digits of every drawn number that the fingerprint keeps: float noise below them is no change


def _rounded(values) -> list:
    import numpy as np

    a = np.asarray(values, dtype=float).ravel()
    if a.size == 0:
        return []
    with np.errstate(divide="ignore", invalid="ignore"):
        mag = np.where(np.isfinite(a) & (a != 0), np.floor(np.log10(np.abs(a))), 0)
        scale = 10.0 ** (mag - (SIGNIFICANT - 1))
        return np.where(np.isfinite(a), np.round(a / scale) * scale, a).tolist()


def fingerprint(fig) -> str:
    """A hash of what ``fig`` draws: every line's, collection's, patch's and image's numbers (to SIGNIFICANT
    digits), every text, the axes' limits, scales and labels. Equal numbers give an equal fingerprint, so
    :func:`save` leaves a figure's files alone when a run draws the same thing again."""
    import hashlib
    import json

    import numpy as np

    parts = [list(fig.get_size_inches())]
    for ax in fig.axes:
        parts += [ax.get_xscale(), ax.get_yscale(), _rounded(ax.get_xlim()), _rounded(ax.get_ylim()),
                  ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        for line in ax.get_lines():
            parts += ["line", _rounded(line.get_xydata()), line.get_label(), str(line.get_color())]
        for c in ax.collections:
            arr = c.get_array()
            parts += ["collection", _rounded(c.get_offsets()), _rounded(arr) if arr is not None else None,
                      _rounded(np.asarray(c.get_facecolors()))]
            parts += [_rounded(path.vertices) for path in c.get_paths()[:2000]]
        for patch in ax.patches:
            parts += ["patch", _rounded(patch.get_path().vertices), _rounded(patch.get_patch_transform().get_matrix())]
        for im in ax.get_images():
            parts += ["image", _rounded(im.get_array()), _rounded(im.get_extent())]
        parts += [t.get_text() for t in ax.texts]
        parts += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    parts += [t.get_text() for t in fig.texts]
    blob = json.dumps(parts, default=str, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _mark_of(png: Path) -> str | None:
    """The fingerprint mark kept in a PNG's text chunk by :func:`save` (None when there is none)."""
    try:
        from PIL import Image

        with Image.open(png) as im:
            return im.text.get("Comment") if hasattr(im, "text") else None
    except Exception:  # noqa: BLE001 - an unreadable file is simply drawn again
        return None
