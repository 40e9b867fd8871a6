"""One setup call shared by paper A's notebooks 02-06: the sizes, the models, the probe and the direction."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from lib import metrics, models
from lib.infra import repro
from lib.models import Loaded
from lib.papers.dpo import neurons as dpo_neurons
from lib.papers.dpo.evaluation import PATCH_POSITIONS, evaluate, evaluate_each, prompt_sets, toxicity_perplexity_f1
from lib.papers.dpo.gate import DIRECTIONS, DirectionGate, sweep_directions
from lib.papers.dpo.probe import Probe
from lib.papers.dpo.sizes import Sizes
from lib.papers.dpo.training import base_and_dpo


@dataclass
class Setup:
    """Everything notebooks 02-06 share for one model (built by :func:`setup`; models by :meth:`load`)."""
    model_name: str
    spec: "models.ModelSpec"
    device: str
    seed: int
    sizes: Sizes
    eval_prompts: list
    stats_prompts: list
    prompt_kw: dict  # {"prompts": ...} for a user's file; {} for the challenge prompts (their cache keys stay)
    scorer: str  # as asked ("auto"): the cache keys resolve it
    scorer_name: str  # resolved
    requested_direction: str | None
    fallback: str
    positions: str
    same_vector: bool
    base_lm: Loaded | None = None
    dpo_lm: Loaded | None = None
    probe: Probe | None = None
    gate: DirectionGate | None = None
    direction: str | None = None  # the direction used
    w: torch.Tensor | None = None  # [d_model]
    pre_direction: object = None  # the verdict's precondition on the direction (lib.verdict.require)

    def _loaded(self):
        if self.base_lm is None:
            raise RuntimeError("call .load() first: the models are not loaded yet")

    def load(self, progress: bool | None = None) -> "Setup":
        """Base model, DPO model and probe (:func:`base_and_dpo`, cached), then notebook 01's direction
        gate over its sweep of steering settings (:func:`sweep_directions`, cached) and the direction it picks; prints what it loaded."""
        progress = repro.progress_on() if progress is None else progress
        self.base_lm, self.dpo_lm, self.probe = base_and_dpo(self.model_name, device=self.device, seed=self.seed,
                                                             progress=progress, **self.sizes.training())
        info = self.base_lm.info
        if not info.is_causal:
            raise ValueError(f"{self.model_name} is an encoder; paper A's notebooks need a decoder")
        print(f"base {self.base_lm.name} | DPO {self.dpo_lm.name} | {info.n_layers} layers x {info.d_mlp} neurons = "
              f"{self.n_neurons}")
        print(f"probe: validation accuracy {self.probe.val_accuracy:.3f}, Jigsaw sample {self.probe.jigsaw_accuracy:.3f}")
        if self.requested_direction is None:
            return self
        self.gate = sweep_directions(self.base_lm, self.probe, seed=self.seed, progress=progress)
        self.direction, self.w = self.gate.pick(self.requested_direction, fallback=self.fallback)
        self.pre_direction = self.gate.precondition(self.direction,
                                                    same_vector=self.direction != "toxic tokens" or self.same_vector)
        print("validated by the gate:", [k for k in self.gate.table.index if self.gate.validated(k)] or "none")
        print(f"this notebook uses the {self.direction!r} direction"
              + ("" if self.pre_direction.met else " (not validated here: the verdict cannot go beyond inconclusive)"))
        return self

    @property
    def info(self):
        self._loaded()
        return self.base_lm.info

    @property
    def n_neurons(self) -> int:
        return self.info.n_layers * self.info.d_mlp

    @property
    def dpo_sizes(self) -> dict:
        return self.sizes.dpo_sizes()

    @property
    def dpo_key(self) -> dict:
        """What identifies the DPO model in the cache keys of the statistics and reference evaluations."""
        self._loaded()
        return {"dpo_model": self.dpo_lm.name, "seed": self.seed, **self.dpo_sizes}

    def activations(self, progress: bool | None = None, texts: str = "own") -> dict:
        """Both models' mean MLP activations on the statistics prompts (``dpo_neurons.pair_stats``, cached):
        ``texts`` 'own', each model on its own generations (the paper); 'base', both on the base model's
        (the same-text variant)."""
        self._loaded()
        progress = repro.progress_on() if progress is None else progress
        return dpo_neurons.pair_stats(self.model_name, self.base_lm, self.dpo_lm, self.dpo_key, self.stats_prompts,
                                      max_new_tokens=self.sizes.max_new_tokens, k=self.sizes.last_k, progress=progress,
                                      texts=texts)

    def mean_activations(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """:meth:`activations` (each model on its own texts) checked as any model's must be, [n_layers, d_mlp] and
        finite, with a two-line report: (the base model's means, DPO's means, everything ``pair_stats`` returns)."""
        act = self.activations()
        m_base, m_dpo = act["base"], act["tuned"]  # [n_layers, d_mlp] mean activations
        info = self.base_lm.info
        if not m_base.shape == m_dpo.shape == (info.n_layers, info.d_mlp):
            raise AssertionError(f"mean activations of shape {tuple(m_base.shape)} and {tuple(m_dpo.shape)}, "
                                 f"expected {(info.n_layers, info.d_mlp)}")
        if not (torch.isfinite(m_base).all() and torch.isfinite(m_dpo).all()):
            raise AssertionError("a mean activation is not finite")
        print(f"{len(self.stats_prompts)} prompts; positions counted per layer: base {act['count']['base']}, "
              f"DPO {act['count']['tuned']}")
        print("shapes and finiteness: ok")
        return m_base, m_dpo, act

    def references(self) -> tuple[dict, dict]:
        """(base, DPO) evaluations at these sizes with per-prompt details, cached (03, 05 and 06 share them); checked:
        toxicity and F1 in [0, 1], perplexity above 1."""
        self._loaded()
        s = self.sizes
        ref = dpo_neurons.reference_evaluations(self.model_name, self.base_lm, self.dpo_lm, self.dpo_key,
                                                toxicity_perplexity_f1, n_prompts=s.n_prompts, n_wiki=s.n_wiki,
                                                max_new_tokens=s.max_new_tokens, scorer=self.scorer, progress=False,
                                                details=True, **self.prompt_kw)
        for name, ev in (("base", ref["base"]), ("DPO", ref["tuned"])):
            if not (0 <= ev["toxicity"] <= 1 and ev["perplexity"] > 1 and 0 <= ev["f1"] <= 1):
                raise AssertionError(f"the {name} evaluation is out of range: toxicity {ev['toxicity']}, perplexity "
                                     f"{ev['perplexity']}, F1 {ev['f1']}")
        return ref["base"], ref["tuned"]

    @staticmethod
    def reference_table(ev_base: dict, ev_dpo: dict) -> pd.DataFrame:
        """The base and DPO evaluations (:meth:`references`), one row each, without their per-prompt details."""
        summary = ["toxicity", "perplexity", "f1", "scorer", "n_prompts", "n_wiki"]
        return pd.DataFrame([{"model": "base", **{k: ev_base[k] for k in summary}},
                             {"model": "DPO", **{k: ev_dpo[k] for k in summary}}])

    def evaluate(self, lm: Loaded, table=None, *, toxicity_only: bool = False, positions: str | None = None) -> dict:
        """:func:`evaluate` at these sizes, prompts and scorer, with ``table`` active at ``positions``
        (default: the setup's)."""
        s = self.sizes
        return evaluate(lm, table, n_prompts=s.n_prompts, n_wiki=s.n_wiki, max_new_tokens=s.max_new_tokens,
                        scorer=self.scorer, toxicity_only=toxicity_only,
                        positions=self.positions if positions is None else positions, **self.prompt_kw)

    def evaluate_each(self, lm: Loaded, tables, *, positions: str | None = None, progress: bool | None = None,
                      copy_from: Loaded | None = None) -> list[dict]:
        """:func:`evaluate_each` (toxicity alone, several tables per batch) at these sizes, prompts and scorer
        (a bar over the batches unless progress bars are off: ``repro.progress_on``); ``copy_from``: neuron
        sets whose activations are copied from that model instead of tables."""
        s = self.sizes
        return evaluate_each(lm, tables, n_prompts=s.n_prompts, n_wiki=s.n_wiki, max_new_tokens=s.max_new_tokens,
                             scorer=self.scorer, positions=self.positions if positions is None else positions,
                             progress=repro.progress_on() if progress is None else progress, copy_from=copy_from,
                             **self.prompt_kw)


def setup(model_name: str = "smollm2-135m", device: str = "auto", seed: int = 0, overrides: dict | None = None, *,
          prompts: str = "", scorer: str = "auto", direction: str | None = "auto", fallback: str = "probe",
          positions: str = "last", evaluation: bool = True, statistics: bool = True, same_vector: bool = True,
          **sizes) -> Setup:
    """Paper A's one setup call (notebooks 02-06). Checks everything that can be checked before a model
    loads, and prints the model, device, scorer and sizes; :meth:`Setup.load` then loads the models,
    the probe and the direction.

    ``sizes``: the sizes a notebook sets as its own parameters (e.g. 03's ``n_prompts=32``);
    ``overrides``: the user's other fields of :class:`Sizes`. ``prompts``: a JSONL file of prompts
    (:func:`prompt_sets`; "" for the challenge prompts). ``direction``: 'auto' (the gate's best
    validated direction, else ``fallback``, the paper's direction for that notebook), a name in
    :data:`DIRECTIONS`, or None (no gate). ``positions``: where :meth:`Setup.evaluate` writes a table
    (:data:`PATCH_POSITIONS`). ``evaluation`` False: the notebook scores no prompts (04);
    ``statistics`` False: it takes no mean activations (02). ``same_vector`` False: the notebook
    builds its 'toxic tokens' direction from other words than the gate's, so the gate's result does
    not carry over."""
    sz = Sizes.of(overrides, **sizes)
    if direction is not None and direction != "auto" and direction not in DIRECTIONS:
        raise ValueError(f"direction must be 'auto' or one of {', '.join(DIRECTIONS)}, got {direction!r}")
    if fallback not in DIRECTIONS:
        raise ValueError(f"fallback must be one of {', '.join(DIRECTIONS)}, got {fallback!r}")
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    eval_prompts, stats_prompts = prompt_sets(prompts, sz.n_prompts if evaluation else 0,
                                              sz.n_stats_prompts if statistics else 0, sz.stats_offset)
    scorer_name = metrics.resolve_scorer(scorer)  # raises for an unknown scorer
    spec = models.resolve_spec(model_name)  # raises a one-line error for an unknown name
    if spec.kind != "causal":
        raise ValueError(f"{model_name} is an encoder; paper A's notebooks need a decoder (e.g. smollm2-135m, gpt2-medium)")
    device = models.resolve_device(device)
    defaults = Sizes()
    own = {k: v for k, v in sizes.items() if v != getattr(defaults, k)}
    print(f"model {spec.name} ({spec.hub_id}) on {device}; toxicity scorer {scorer_name}")
    print("sizes: lib.papers.dpo.Sizes" + (f", this notebook's {own}" if own else "")
          + (f", overrides {dict(sorted(overrides.items()))}" if overrides else " (no overrides)"))
    return Setup(model_name, spec, device, seed, sz, list(eval_prompts),
                 list(stats_prompts), {"prompts": list(eval_prompts)} if prompts and evaluation else {}, scorer,
                 scorer_name, direction, fallback, positions, same_vector)


