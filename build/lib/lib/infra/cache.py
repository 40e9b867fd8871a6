"""Cache of expensive artifacts (probes, preference pairs, fine-tuned models, activation statistics).

Keyed by kind, model and the parameters that produced them; every write goes to a temporary
name first and is renamed into place, so an interrupted run leaves nothing half-written.

An artifact derived from data (prompt texts, facts, preference pairs, labelled rows) carries
:func:`content_hash` of that data in its parameters, so changing one prompt builds it again instead
of reusing a result computed from the old prompts.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from lib.infra import paths


def _canonical(obj: Any) -> Any:
    """A JSON-able form of ``obj`` that is the same for equal contents: dicts by sorted key, tuples as
    lists, sets sorted, numpy/torch arrays by dtype, shape and a sha256 of their bytes, pandas frames
    by columns, index and values."""
    import numpy as np

    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {"__dict__": sorted(([str(k), _canonical(v)] for k, v in obj.items()), key=lambda kv: kv[0])}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return {"__set__": sorted(json.dumps(_canonical(v), sort_keys=True) for v in obj)}
    if isinstance(obj, Path):
        return {"__path__": str(obj)}
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            obj = obj.detach().cpu()
            if obj.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
                obj = obj.view(torch.int16)
            obj = obj.contiguous().numpy()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        if arr.dtype == object:
            return {"__objects__": _canonical(arr.tolist()), "shape": list(arr.shape)}
        return {"__array__": str(arr.dtype), "shape": list(arr.shape),
                "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
    try:
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            return {"__frame__": [str(c) for c in obj.columns], "index": _canonical(obj.index.tolist()),
                    "values": _canonical(obj.astype(object).where(obj.notna(), None).values.tolist())}
        if isinstance(obj, pd.Series):
            return {"__series__": str(obj.name), "index": _canonical(obj.index.tolist()),
                    "values": _canonical(obj.astype(object).where(obj.notna(), None).tolist())}
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"content_hash cannot hash a {type(obj).__name__}: pass texts, numbers, lists, dicts, "
                    "arrays, tensors or pandas frames")


def content_hash(obj: Any) -> str:
    """sha256 (hex) of a canonical JSON of ``obj``: texts, facts, pairs, labels, nested lists and
    dicts, numpy arrays, torch tensors (their bytes) and pandas frames. Equal contents give the same
    hash in any process or machine; one changed character or label gives another. Put it into the
    ``params`` of :func:`get_or_build` for every artifact derived from data."""
    blob = json.dumps(_canonical(obj), sort_keys=True, ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def key(params: dict) -> str:
    blob = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def path(kind: str, model_name: str, params: dict, suffix: str = "") -> Path:
    """Where the artifact ``kind`` for ``model_name`` made with ``params`` lives."""
    d = paths.CACHE / paths.slug(model_name)
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{kind}-{key(params)}{suffix}"


def atomic_write_text(target: Path, text: str) -> None:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; published files get the usual mode
    os.replace(tmp, target)


def atomic_save(obj: Any, target: Path, save: Callable[[Any, Path], None] | None = None,
                keep_existing: bool = False) -> None:
    """Write ``obj`` with ``save(obj, tmp_path)`` (default torch.save) and rename it to ``target``.
    Works for files and for folders (e.g. ``lambda m, p: m.save_pretrained(p)``). ``keep_existing``:
    a folder that another process wrote meanwhile (the same artifact, built beside this one) stays,
    and this copy is dropped, so no reader ever finds the folder half replaced."""
    import torch

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)) / "artifact"
    try:
        (save or (lambda o, p: torch.save(o, p)))(obj, tmp)
        if target.is_dir():
            if keep_existing:
                return
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def get_or_build(kind: str, model_name: str, params: dict, build: Callable[[], Any],
                 save: Callable[[Any, Path], None] | None = None, load: Callable[[Path], Any] | None = None,
                 suffix: str = ".pt", rebuild: bool = False) -> Any:
    """Return the cached artifact, or build it, save it atomically and return it."""
    import torch

    target = path(kind, model_name, params, suffix)
    loader = load or (lambda p: torch.load(p, weights_only=False))
    if target.exists() and not rebuild:
        return loader(target)
    obj = build()
    atomic_save(obj, target, save)
    return obj
