"""SAOBP and GTD: our RECONSTRUCTION of the refinement and its statistics (paper B, notebooks 07-10).

This module is the one place where the reconstructed equations live. They are *not* the authors'
method: neither the body nor the code of Lee et al., *Mitigating Attention Localization in Small Scale:
Self-Attention Refinement via One-step Belief Propagation* (Findings of EMNLP 2025, arXiv 2509.07324,
code ``nakyungLee20/SAOBP``) could be reached (``../shared/papers/saobp.md``). What we built on:

* the abstract: attention "localizes"; SAOBP refines self-attention by *one step of belief
  propagation* that injects multi-hop relations; *Global Token Dependency* (GTD) measures the
  relative contribution of multi-hop links in the attention graph; SAOBP prevents entropy collapse in
  deeper layers and keeps GTD at task-appropriate levels;
* one unverified third-party summary: the BP step uses a *repulsive Potts prior*.

Everything below that is more specific than those sentences is our choice. Per layer and head, with
masked logits S [b, h, q, k] and A = softmax(S) over the valid keys:

* (choice) Tokens are nodes; node i holds "which token i attends to" with unary belief A_i. A Potts
  potential psi(x_i = j, x_k = l) = exp(J [j == l]); J < 0 is repulsive (the summary's prior).
* (choice) One message step from the unary beliefs, unnormalised: m_{k->i}(j) = sum_l psi(j, l) A_kl
  = 1 + g A_kj, g = exp(J) - 1 in (-1, 0) for J < 0.
* (choice) The multi-hop term M_ij = sum_{k != i} A_ik log(1 + g A_kj) (~ g (A~ A)_ij, A~ = A without
  its diagonal), k over valid (real, unmasked) tokens only: each message weighted by how much i
  attends to k, added in log space.
* (choice) Refined attention A' = softmax(S + M); masked keys stay masked, causal models stay causal
  (A_ik A_kj is non-zero only for j <= k <= i). Since log(1 + g A_kj) lies in [J, 0], a repulsive J
  lowers the logits of keys that the tokens i attends to already attend to strongly.
* (choice) J per layer and head. By default (``mode="repulsive"``) J = -softplus(theta) with theta
  the trained parameter, so J < 0 by construction, whatever the optimiser does; ``mode="free"`` is the
  earlier unconstrained variant (J = theta, either sign; J = 0 is exactly the plain model, J > 0 an
  attractive prior). J = 0 cannot be represented in the repulsive mode: the plain model is the model
  without SAOBP attached.
* (choice) GTD, defined by the abstract only in words, in two variants: GTD_2hop(A) =
  mean_i sum_j max(0, (A^2)_ij - A_ij), the mass two hops reach beyond one (0 for identity, uniform
  or single-hub attention, 1 per row for a chain), and, for SAOBP models, GTD_msg =
  ||M||_F / (||S_c||_F + ||M||_F), the message's share of the refined logits (S_c: S centred over
  each row's valid keys).
* (choice) A head is "collapsed" when its mean normalised entropy is below ``COLLAPSE_THRESHOLD``.

It plugs into :func:`lib.hooks.attention` (the points ``blocks.{L}.attn.hook_attn_scores`` of
:func:`lib.hooks.points`) as the ``refine`` callback, so it works for every family the hooks support.
:class:`SAOBP` keeps J per layer and head as a parameter; :func:`attach` keeps it with the loaded model
(``lm.saobp`` of the :class:`lib.models.Loaded`, never on the Hugging Face modules), where :func:`active`
and :func:`lib.papers.saobp.scratch.train` find it.

Statistics streamed per layer (:class:`AttentionStats`): attention entropy (raw and normalised, from
:func:`lib.metrics.attention_entropy`), GTD_2hop and (with SAOBP) GTD_msg.

The small models trained from scratch, their data and their training loop are in :mod:`lib.papers.saobp.scratch`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F

from lib import hooks, metrics, models
from lib.infra import repro

COLLAPSE_THRESHOLD = 0.1  # a head is "collapsed" when its mean normalised entropy is below this
J_MODES = ("repulsive", "free")  # J = -softplus(theta) (J < 0 by construction), or J = theta (the earlier variant)
DEFAULT_J = -1.0  # initial J when none is given: a moderate repulsive prior (g = exp(-1) - 1 = -0.63)


# ----------------------------------------------------------------------------- the refinement


def _probs(scores: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """A = softmax(S) in float32 with invalid keys set to exactly 0 (also in fully masked rows)."""
    A = torch.softmax(scores.float(), dim=-1)
    return A if valid is None else A.masked_fill(~valid, 0.0)


def _per_head(J, n_heads: int, like: torch.Tensor) -> torch.Tensor:
    J = torch.as_tensor(J, dtype=torch.float32, device=like.device)
    if J.ndim == 0:
        J = J.expand(n_heads)
    if J.shape != (n_heads,):
        raise ValueError(f"J must be a scalar or have one value per head ({n_heads}), got shape {tuple(J.shape)}")
    return J.view(1, n_heads, 1, 1)


def messages(scores: torch.Tensor, valid: torch.Tensor | None, J) -> torch.Tensor:
    """The multi-hop term M [b, h, q, k] (float32) for logits ``scores`` [b, h, n, n].

    J: a scalar or one value per head; g = exp(J) - 1. Needs the square self-attention matrix
    (all queries present), so it refuses KV-cached decoding steps.
    """
    b, h, q, k = scores.shape
    if q != k:
        raise ValueError(f"SAOBP needs square self-attention (got {q} queries, {k} keys); "
                         "run full forward passes (use_cache=False), not cached decoding")
    A = _probs(scores, valid)  # [b, h, n, n]
    g = torch.expm1(_per_head(J, h, A))  # [1, h, 1, 1]
    log_msg = torch.log1p(g * A)  # log m_{k->i}(j) = log(1 + g A_kj): row k is "query k"
    eye = torch.eye(q, dtype=torch.bool, device=A.device)
    A_off = A.masked_fill(eye, 0.0)  # k != i; invalid keys k already have A_ik = 0
    return A_off @ log_msg  # [b, h, n, n]


def query_mask(valid: torch.Tensor | None, shape) -> torch.Tensor:
    """Real query tokens [b, q] from a square validity mask: query i is real iff key i is valid for it."""
    b, _, q, k = shape
    if valid is None:
        return torch.ones(b, q, dtype=torch.bool)
    return torch.diagonal(valid[:, 0], dim1=-2, dim2=-1).cpu() if q == k else valid[:, 0].any(-1).cpu()


def gtd_msg(scores: torch.Tensor, M: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """GTD_msg per [b, h]: ||M||_F / (||S_c||_F + ||M||_F) over valid (query, key) entries.

    S_c is S centred over each row's valid keys (softmax ignores a row constant)."""
    S = scores.float()
    v = torch.ones_like(S, dtype=torch.bool) if valid is None else valid.expand_as(S)
    qm = query_mask(valid, S.shape).to(S.device)[:, None, :, None]
    v = v & qm
    n = v.sum(-1, keepdim=True).clamp_min(1)
    Sz = S.masked_fill(~v, 0.0)
    Sc = (Sz - Sz.sum(-1, keepdim=True) / n).masked_fill(~v, 0.0)
    m_norm = M.float().masked_fill(~v, 0.0).pow(2).sum((-1, -2)).sqrt()
    s_norm = Sc.pow(2).sum((-1, -2)).sqrt()
    return m_norm / (s_norm + m_norm).clamp_min(1e-12)


def gtd_2hop(probs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GTD_2hop per [b, h] = mean over real queries i of sum_j max(0, (A^2)_ij - A_ij).

    The mass that two hops put on tokens beyond what one hop gives: 0 for identity, uniform or
    single-hub attention, 1 per row for a chain i -> i+1."""
    A = probs.float()
    if valid is not None:
        A = A.masked_fill(~valid, 0.0)
    qm = query_mask(valid, A.shape).to(A.device)  # [b, q]
    A = A * qm[:, None, :, None]  # padding queries neither count nor relay
    extra = (A @ A - A).clamp_min(0).sum(-1)  # [b, h, q]
    q = qm[:, None, :].float()
    return (extra * q).sum(-1) / q.sum(-1).clamp_min(1)


def _softplus_inv(x: torch.Tensor) -> torch.Tensor:
    """theta with softplus(theta) = x, for x > 0 (stable for small and large x; float64 inside)."""
    x = x.double()
    return (x + torch.log(-torch.expm1(-x))).float()


def initial_theta(J, n_layers: int, n_heads: int, mode: str = "repulsive") -> torch.Tensor:
    """The parameter theta [n_layers, n_heads] that gives the initial ``J`` (a number, one per head, or
    [n_layers, n_heads]) in ``mode``. The repulsive mode needs every J < 0; ``mode="free"`` takes any
    finite J."""
    if mode not in J_MODES:
        raise ValueError(f"unknown SAOBP mode {mode!r}: use one of {', '.join(J_MODES)}")
    J = torch.as_tensor(J, dtype=torch.float64).detach().cpu()
    try:
        J = J.expand(n_layers, n_heads).clone()
    except RuntimeError:
        raise ValueError(f"J must be a number, one value per head ({n_heads}) or [n_layers, n_heads] = "
                         f"[{n_layers}, {n_heads}], got shape {tuple(J.shape)}") from None
    if not torch.isfinite(J).all():
        raise ValueError(f"J must be finite, got {J.flatten()[~torch.isfinite(J.flatten())][0].item()}")
    if mode == "free":
        return J.float()
    if (J >= 0).any():
        raise ValueError(f"mode='repulsive' needs J < 0 (J = -softplus(theta)), got J = {J.max().item():g}; "
                         "J = 0 is the plain model: do not attach SAOBP, or use mode='free' for J >= 0")
    return _softplus_inv(-J)


class SAOBP(nn.Module):
    """J per layer and head ([n_layers, n_heads]); call it as the ``refine`` of :func:`hooks.attention`.

    The trained parameter is ``theta``; :attr:`J` is the effective J: -softplus(theta) with
    ``mode="repulsive"`` (the default, J < 0 by construction) or theta itself with ``mode="free"`` (the
    earlier unconstrained variant). ``learnable=False`` keeps J fixed (a sweep). ``observer(scores, M,
    valid, layer)`` if set sees every message (e.g. :class:`AttentionStats` for GTD_msg)."""

    def __init__(self, n_layers: int, n_heads: int, J=DEFAULT_J, learnable: bool = True, mode: str = "repulsive"):
        super().__init__()
        self.mode = mode
        self.theta = nn.Parameter(initial_theta(J, n_layers, n_heads, mode), requires_grad=learnable)
        self.observer: Callable | None = None

    @property
    def J(self) -> torch.Tensor:
        """The effective J [n_layers, n_heads] (differentiable in theta)."""
        return -F.softplus(self.theta) if self.mode == "repulsive" else self.theta

    @property
    def g(self) -> torch.Tensor:
        return torch.expm1(self.J.detach())

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, shape={tuple(self.theta.shape)}, learnable={self.theta.requires_grad}"

    def forward(self, scores, valid, layer: int):
        L = int(layer)
        M = messages(scores, valid, self.J[L])
        if self.observer is not None:
            self.observer(scores, M, valid, L)
        return scores + M.to(scores.dtype)


def attach(lm: models.Loaded, J=DEFAULT_J, learnable: bool = True, mode: str = "repulsive") -> SAOBP:
    """Attach an :class:`SAOBP` to the loaded model as ``lm.saobp`` (on the :class:`lib.models.Loaded`, not
    on the Hugging Face model: :func:`active` runs it, :func:`lib.papers.saobp.scratch.train` trains it).

    J: the initial J (a number, one per head, or [n_layers, n_heads]); with ``mode="repulsive"`` every
    value must be < 0 (ValueError otherwise: the plain model is the model without SAOBP, and
    ``mode="free"`` takes J >= 0)."""
    info = lm.info
    mod = SAOBP(info.n_layers, info.n_heads, J, learnable, mode).to(next(lm.model.parameters()).device)
    lm.saobp = mod
    return mod


def get(lm: models.Loaded) -> SAOBP | None:
    return getattr(lm, "saobp", None)


def detach(lm: models.Loaded) -> None:
    """Back to the plain model: forget the attached SAOBP."""
    lm.saobp = None


@contextlib.contextmanager
def active(lm: models.Loaded, capture: Callable | None = None):
    """Run the model with its attached SAOBP (if any) and an optional capture (e.g. AttentionStats).

    Without an attached SAOBP this is the plain model through the same eager attention function."""
    mod = get(lm)
    if mod is not None and isinstance(capture, AttentionStats):
        mod.observer = capture.observe
    try:
        with hooks.attention(lm, refine=mod, capture=capture):
            yield
    finally:
        if mod is not None:
            mod.observer = None


# ----------------------------------------------------------------------------- streamed statistics


def thirds(n_layers: int) -> tuple[list[int], list[int]]:
    """(first third, last third) of the layer indices, at least one layer each: the depth comparison of
    notebooks 07, 08 and 10."""
    k = max(1, n_layers // 3)
    return list(range(k)), list(range(n_layers - k, n_layers))


def depth_fall(per_layer) -> np.ndarray | float:
    """07's statistic: the mean of the last third of the layers minus that of the first third, over the
    last axis of ``per_layer`` ([..., n_layers], e.g. per text); negative = falls with depth, 0 for one layer."""
    x = np.asarray(per_layer, dtype=float)
    first, last = thirds(x.shape[-1])
    out = x[..., last].mean(-1) - x[..., first].mean(-1)
    return float(out) if out.ndim == 0 else out


def without_sink(probs: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sink mass [b, h, q], probs with the sink removed and renormalised [b, h, q, k], their valid
    mask): the sink is each row's first visible key (the first real token for left-padded decoders,
    [CLS] for BERT)."""
    p = probs.float()
    b, h, q, k = p.shape
    v = torch.ones(b, 1, q, k, dtype=torch.bool, device=p.device) if valid is None else valid.to(p.device)
    first = v.int().argmax(-1, keepdim=True)  # [b, 1|h, q, 1]: the first visible key
    sink = torch.zeros_like(v).scatter_(-1, first, True) & v
    mass = (p * sink).sum(-1)
    v2 = v & ~sink
    rest = p.masked_fill(~v2, 0.0)
    rest = rest / rest.sum(-1, keepdim=True).clamp_min(1e-30)
    return mass, rest, v2


class AttentionStats:
    """Per-layer, per-head running means over sequences of normalised / raw entropy, GTD_2hop and
    (for SAOBP) GTD_msg. Use as ``capture`` of :func:`active` (or of :func:`hooks.attention`).

    The attention-sink variant: ``sink_mass`` is the attention each query puts on its first visible key
    (the first real token: BOS or [CLS], the usual sink; in a decoder the first query, which sees only that
    key, counts with mass 1), and ``entropy_norm_nosink`` the normalised
    entropy of the row with that key removed and the rest renormalised (over the other visible keys;
    queries that see only the sink are skipped), so a fall in entropy that is only a growing sink
    shows as a fall in ``entropy_norm`` but not in ``entropy_norm_nosink``."""

    METRICS = ("entropy", "entropy_norm", "gtd_2hop", "gtd_msg", "sink_mass", "entropy_norm_nosink")

    def __init__(self, n_layers: int, n_heads: int, keep_sequences: bool = False):
        self.sums = {m: torch.zeros(n_layers, n_heads, dtype=torch.float64) for m in self.METRICS}
        self.counts = {m: torch.zeros(n_layers, dtype=torch.float64) for m in self.METRICS}
        self.keep = keep_sequences  # also keep each sequence's head mean: self.seq[metric][L] = list
        self.seq = {m: [[] for _ in range(n_layers)] for m in self.METRICS}

    def _add(self, name, L, per_bh):
        v = per_bh.detach().double().cpu()  # [b, h]
        self.sums[name][L] += v.sum(0)
        self.counts[name][L] += v.shape[0]
        if self.keep:
            self.seq[name][L] += v.mean(1).tolist()

    def per_sequence(self, name: str) -> np.ndarray:
        """[n_sequences, n_layers] head-mean of ``name`` per sequence (needs keep_sequences=True)."""
        if not self.keep:
            raise ValueError("per_sequence needs AttentionStats(..., keep_sequences=True)")
        return np.array(self.seq[name], dtype=float).T

    def __call__(self, probs, valid, layer: int):
        L = int(layer)
        qm = query_mask(valid, probs.shape)
        raw, norm = metrics.attention_entropy(probs.detach(), None if valid is None else valid.detach(), qm)
        self._add("entropy", L, raw)
        self._add("entropy_norm", L, norm)
        self._add("gtd_2hop", L, gtd_2hop(probs.detach(), None if valid is None else valid.detach()))
        mass, rest, rest_valid = without_sink(probs.detach(), None if valid is None else valid.detach())
        self._add("sink_mass", L, (mass * qm[:, None]).sum(-1) / qm[:, None].sum(-1).clamp_min(1))
        self._add("entropy_norm_nosink", L, metrics.attention_entropy(rest, rest_valid, qm)[1])

    def observe(self, scores, M, valid, layer: int):
        self._add("gtd_msg", int(layer), gtd_msg(scores.detach(), M.detach(), valid))

    def per_head(self, name: str) -> torch.Tensor:
        """[n_layers, n_heads] mean over sequences (NaN where nothing was seen)."""
        c = self.counts[name][:, None]
        return torch.where(c > 0, self.sums[name] / c.clamp_min(1), torch.full_like(self.sums[name], float("nan")))

    def table(self, threshold: float = COLLAPSE_THRESHOLD) -> pd.DataFrame:
        """One row per layer: head means of each metric and the fraction of collapsed heads."""
        df = pd.DataFrame({m: self.per_head(m).mean(1).numpy() for m in self.METRICS})
        df["collapsed_frac"] = (self.per_head("entropy_norm") < threshold).double().mean(1).numpy()
        df.index.name = "layer"
        return df


def trim(batch: dict) -> dict:
    """Drop the columns that are padding in every row of a right-padded batch (faster, same result)."""
    am = batch.get("attention_mask")
    if am is None or not bool(am[:, -1].eq(0).all()):
        return batch
    n = int(am.sum(1).max())
    return {k: v[:, :n] if v.ndim == 2 else v for k, v in batch.items()}


def batches(enc: dict, batch_size: int):
    """Consecutive trimmed mini-batches of an encoding (a dict of equally long tensors)."""
    n = len(next(iter(enc.values())))
    for i in range(0, n, batch_size):
        yield trim({k: v[i:i + batch_size] for k, v in enc.items()})


def attention_stats(lm: models.Loaded, enc: dict, batch_size: int = 16, progress: bool = False,
                    desc: str = "attention", keep_sequences: bool = False) -> AttentionStats:
    """Stream :class:`AttentionStats` over encoded inputs (labels are dropped; no gradients)."""

    stats = AttentionStats(lm.info.n_layers, lm.info.n_heads, keep_sequences)
    model = lm.model
    was = model.training
    model.eval()
    inputs = {k: v for k, v in enc.items() if k != "labels"}
    n = len(inputs["input_ids"])
    try:
        with active(lm, capture=stats), torch.no_grad():
            for b in repro.bar(list(batches(inputs, batch_size)), desc=desc, progress=progress,
                               total=math.ceil(n / batch_size)):
                model(**{k: v.to(lm.device) for k, v in b.items()}, **no_cache(lm))
    finally:
        model.train(was)
    return stats


def no_cache(lm) -> dict:
    """Forward keyword arguments for full (uncached) passes: SAOBP needs the square attention matrix."""
    return {"use_cache": False} if lm.info.is_causal else {}
