"""Determinism in one call: seeds and a fixed thread count (notebook outputs must not drift)."""
from __future__ import annotations

import os
import random


def setup(seed: int = 0, threads: int | None = None, grad: bool = False) -> None:
    """Seed python, numpy and torch; fix torch's CPU threads (default: COMPENDIUM_THREADS or 2);
    turn autograd off unless ``grad`` (nothing trains in most notebooks)."""
    import numpy as np
    import torch

    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads <= 0):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads if threads is not None else env_threads())
    torch.set_grad_enabled(grad)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def env_threads(default: int = 2) -> int:
    """COMPENDIUM_THREADS as a positive integer (``default`` when unset or empty); else one line
    naming the variable and its value."""
    raw = os.environ.get("COMPENDIUM_THREADS", "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"COMPENDIUM_THREADS must be a positive integer (torch's CPU threads), got {raw!r}")
    return n
