"""Paper A's sizes: one dataclass holds every default size of notebooks 02-06 (papermill parameters and a
notebook's ``overrides`` scale them)."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

# the sizes that train the DPO model (the keywords of lib.papers.dpo.training.base_and_dpo)
TRAINING_KEYS = ("n_probe_per_class", "probe_max_length", "n_pairs", "pair_offset", "steer_scale", "steer_depth",
                 "dpo_steps", "dpo_lr", "dpo_batch_size", "beta", "n_prompts", "n_wiki", "max_new_tokens",
                 "min_distinct2")


@dataclass(frozen=True)
class Sizes:
    """Paper A's sizes, shared by notebooks 02-06 (CPU-sized; the probe, the pairs, DPO and the evaluation, then the
    mean-activation statistics of 03-06); checks itself. Each field's default is the one default of that size in lib. A notebook changes them through its ``overrides`` parameter."""
    n_probe_per_class: int = 300  # Davidson tweets per class for the probe (paper: ~159k Jigsaw comments)
    probe_max_length: int = 64  # tokens per tweet
    n_pairs: int = 64  # preference pairs wanted (paper: 24,576)
    pair_offset: int = 1000  # pairs use wiki_samples rows from here on (evaluation uses the first rows)
    steer_scale: float = 8.0  # multiple of the probe's class-mean difference added to the residual stream
    steer_depth: float = 1 / 3  # the steer is added after block round(steer_depth * n_layers)
    dpo_steps: int = 32  # optimizer steps
    dpo_lr: float = 3e-6  # learning rate (paper: 1e-6 to 1e-5, RMSprop; RMSprop's first steps are ~10x lr per weight)
    dpo_batch_size: int = 4  # pairs per step (paper: 4)
    beta: float = 0.1  # DPO beta (paper: 0.1)
    n_prompts: int = 64  # challenge prompts for toxicity (paper: 1,199)
    n_wiki: int = 32  # wiki_samples rows for perplexity and F1 (paper: 2,064)
    max_new_tokens: int = 20  # greedy tokens per continuation (paper: 20)
    min_distinct2: float = 0.5  # a pair is kept only when its rejected text's distinct-2 reaches this (no loops)
    n_stats_prompts: int = 64  # challenge prompts each model continues for its mean activations (paper: 1,199)
    stats_offset: int = 600  # they start at this challenge prompt, after the evaluation prompts
    last_k: int = 20  # positions averaged at the end of prompt + continuation (paper: 20)

    # the sizes that identify the DPO model in 03-06's cache keys and records (their names since notebook 02)
    DPO_KEYS = ("n_probe_per_class", "n_pairs", "steer_scale", "steer_depth", "dpo_steps", "dpo_lr", "beta", "max_new_tokens")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, f.name, float(v))  # 8 from papermill's YAML is 8.0
                v = float(v)
            kind = int if f.type == "int" else float
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ValueError(f"{f.name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            if f.name in ("pair_offset", "stats_offset"):
                if v < 0:
                    raise ValueError(f"{f.name} must be a non-negative integer, got {v!r}")
            elif f.name in ("steer_depth", "min_distinct2"):
                if not 0 <= v <= 1:
                    raise ValueError(f"{f.name} must lie in [0, 1], got {v!r}")
            elif not v > 0:
                raise ValueError(f"{f.name} must be positive, got {v!r}")

    @classmethod
    def of(cls, overrides: dict | None = None, **notebook) -> "Sizes":
        """The sizes of one run: ``notebook``, the sizes a notebook sets as its own parameters, and the
        user's ``overrides`` (fields of this class; naming a notebook's own parameter again is an error)."""
        overrides = dict(overrides or {})
        names = [f.name for f in dataclasses.fields(cls)]
        for k in sorted({*overrides, *notebook} - set(names)):
            close = difflib.get_close_matches(k, names, n=1)
            raise ValueError(f"unknown size {k!r}" + (f": did you mean {close[0]!r}?" if close else "")
                             + f" (fields of lib.papers.dpo.Sizes: {', '.join(names)})")
        twice = sorted(set(overrides) & set(notebook))
        if twice:
            raise ValueError(f"{', '.join(twice)}: a parameter of this notebook; set it there, not in overrides")
        return cls(**notebook, **overrides)

    def dpo_sizes(self) -> dict:
        return {k: getattr(self, k) for k in self.DPO_KEYS}

    def training(self) -> dict:
        """The keyword sizes of :func:`~lib.papers.dpo.training.base_and_dpo` (:data:`TRAINING_KEYS`)."""
        return {k: getattr(self, k) for k in TRAINING_KEYS}
