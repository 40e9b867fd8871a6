"""Cache of expensive artifacts (probes, preference pairs, fine-tuned models, activation statistics).

Keyed by kind, model and the parameters that produced them; every write goes to a temporary
name first and is renamed into place, so an interrupted run leaves nothing half-written.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from lib import paths


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


def atomic_save(obj: Any, target: Path, save: Callable[[Any, Path], None] | None = None) -> None:
    """Write ``obj`` with ``save(obj, tmp_path)`` (default torch.save) and rename it to ``target``.
    Works for files and for folders (e.g. ``lambda m, p: m.save_pretrained(p)``)."""
    import torch

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)) / "artifact"
    try:
        (save or (lambda o, p: torch.save(o, p)))(obj, tmp)
        if target.is_dir():
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
