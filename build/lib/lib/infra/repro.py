"""Determinism in one call: seeds and a fixed thread count (notebook outputs must not drift);
and one switch for progress bars (on when you run a notebook yourself, off in stored outputs)."""
from __future__ import annotations

import contextlib
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


# Progress bars: shown in interactive runs; the runner, `make reproduce` and nbval set
# COMPENDIUM_PROGRESS=0 (see quiet_env), so executed notebooks store no bar output.
PROGRESS_ENV = "COMPENDIUM_PROGRESS"
_OFF = {"0", "false", "no", "off"}


def progress_on() -> bool:
    """False when COMPENDIUM_PROGRESS is 0 / false / no / off; true otherwise (unset included)."""
    raw = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if raw in _OFF or raw in {"", "1", "true", "yes", "on"}:
        return raw not in _OFF
    raise ValueError(f"{PROGRESS_ENV} must be 0 or 1 (progress bars off or on), got {raw!r}")


def quiet_env() -> dict[str, str]:
    """Environment for non-interactive executions: lib's bars and transformers' / the hub's bars off."""
    return {PROGRESS_ENV: "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def bar(iterable=None, *, progress: bool = True, **kwargs):
    """tqdm.auto's bar, shown only when ``progress`` and COMPENDIUM_PROGRESS allow it."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not (progress and progress_on()), **kwargs)


@contextlib.contextmanager
def library_bars(progress: bool = True):
    """Within the block, the bars of Hugging Face datasets and transformers (dataset maps, shard
    writing) and TRL's (it reads TQDM_DISABLE, e.g. for the reference log-probabilities of DPO) show
    only when ``progress`` and COMPENDIUM_PROGRESS allow it; their state is restored after."""
    import datasets
    from transformers.utils import logging as hf_logging

    on = progress and progress_on()
    was = datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled(), os.environ.get("TQDM_DISABLE")
    if not on:
        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()
        os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if was[0]:
            datasets.enable_progress_bars()
        if was[1]:
            hf_logging.enable_progress_bar()
        if was[2] is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = was[2]
