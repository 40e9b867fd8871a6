"""Determinism in one call: seeds and a fixed thread count (notebook outputs must not drift)."""
from __future__ import annotations

import os
import random


def setup(seed: int = 0, threads: int | None = None, grad: bool = False) -> None:
    """Seed python, numpy and torch; fix torch's CPU threads (default: COMPENDIUM_THREADS or 2);
    turn autograd off unless ``grad`` (nothing trains in most notebooks)."""
    import numpy as np
    import torch

    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads or int(os.environ.get("COMPENDIUM_THREADS", "2")))
    torch.set_grad_enabled(grad)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
