"""Paper C's units: "every output unit of up_proj, gate_proj and down_proj" in every layer, addressed as a named
point (:func:`lib.hooks.points`) plus an index, with one flat index over all of them; recording their mean
responses and switching them off use the one hook mechanism."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from lib import hooks
from lib.models import Loaded


# Where a "neuron" can live in an MLP block, and its point: 'act' is ``mlp.hook_post`` (what
# MLPRecorder and intervene read: act(gate) * up for gated MLPs); 'up', 'gate' and 'down' are the
# *output units* of those linear maps (paper C's neurons: "every output unit of up_proj, gate_proj
# and down_proj"): ``mlp.hook_up``, ``mlp.hook_gate``, ``mlp.hook_out``. GPT-2 and BERT have no gate;
# GPT-2's 'up' is c_fc's output (before the GELU), 'down' c_proj's.
SITE_POINTS = {"act": "mlp.hook_post", "up": "mlp.hook_up", "gate": "mlp.hook_gate", "down": "mlp.hook_out"}
SITES = tuple(SITE_POINTS)


@dataclass(frozen=True)
class Units:
    """A flat index over the neurons of several MLP sites in every layer: site-major, then layer,
    then unit (the order of :meth:`blocks`). ``Units.of(lm, ("up", "gate", "down"))``. Each unit is
    a point and an index: :meth:`point`, :meth:`group`."""
    sites: tuple[str, ...]
    n_layers: int
    widths: tuple[int, ...]  # one per site

    @classmethod
    def of(cls, lm: Loaded, sites: Sequence[str]) -> "Units":
        sites = tuple(sites)
        if not sites or len(set(sites)) != len(sites):
            raise ValueError(f"sites must be distinct names from {SITES}, got {sites!r}")
        info = lm.info
        names = set(hooks.point_names(lm, 0))
        have = [s for s, p in SITE_POINTS.items() if f"blocks.0.{p}" in names]
        widths = []
        for s in sites:
            if s not in SITES:
                raise ValueError(f"unknown MLP site {s!r}: use one of {', '.join(SITES)}")
            if s not in have:
                raise ValueError(f"{info.family} models have no {s!r} projection (sites there: {', '.join(have)})")
            widths.append(info.d_model if s == "down" else info.d_mlp)
        return cls(sites, info.n_layers, tuple(widths))

    @staticmethod
    def point(site: str, layer: int) -> str:
        """The point name of ``site`` in block ``layer``, e.g. 'blocks.3.mlp.hook_up'."""
        return f"blocks.{layer}.{SITE_POINTS[site]}"

    @property
    def size(self) -> int:
        return self.n_layers * sum(self.widths)

    def blocks(self) -> list[tuple[str, int, int, int]]:
        """(site, layer, offset, width) of every contiguous block of the flat index."""
        out, off = [], 0
        for s, w in zip(self.sites, self.widths):
            for L in range(self.n_layers):
                out.append((s, L, off, w))
                off += w
        return out

    def split(self, flat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(site index, layer, unit) arrays of flat indices."""
        flat = np.asarray(flat, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.size):
            raise ValueError(f"unit index out of range 0..{self.size - 1}")
        starts = np.cumsum([0] + [self.n_layers * w for w in self.widths])
        site = np.searchsorted(starts, flat, side="right") - 1
        rest = flat - starts[site]
        w = np.asarray(self.widths)[site]
        return site, rest // w, rest % w

    def group(self, flat) -> dict[str, list[int]]:
        """{point name: unit indices} of flat indices (points in flat order, indices as given)."""
        site, layer, unit = self.split(flat)
        out: dict[tuple[int, int], list[int]] = {}
        for s, L, i in zip(site.tolist(), layer.tolist(), unit.tolist()):
            out.setdefault((s, L), []).append(i)
        return {self.point(self.sites[s], L): idx for (s, L), idx in sorted(out.items())}

    def stratum(self, flat) -> np.ndarray:
        """(site, layer) block number of each flat index: what a layer-matched control matches."""
        site, layer, _ = self.split(flat)
        return site * self.n_layers + layer

    def labels(self, flat) -> list[str]:
        site, layer, unit = self.split(flat)
        return [f"{self.sites[s]}:L{L}N{i}" for s, L, i in zip(site, layer, unit)]


class UnitRecorder(hooks.Attached):
    """Per-sequence masked means of every unit in ``units`` (all its sites and layers), as one
    [n_sequences, units.size] float tensor in the flat order. Set ``rec.mask`` ([batch, pos]) before
    each forward; forwards run while ``rec.active`` is False (e.g. KV-cached decoding steps) are
    not recorded."""

    def __init__(self, lm: Loaded, units: Units, dtype=torch.float16):
        self.lm, self.units, self.dtype = lm, units, dtype
        self.mask: torch.Tensor | None = None
        self.active = True
        self._rows: list[list[torch.Tensor]] = []  # per forward: one tensor per block
        self._cur: list[torch.Tensor] | None = None

    def _record(self, slot: int):
        def record(x):
            if not self.active:
                return
            x = x.detach()
            m = self.mask if self.mask is not None else torch.ones(x.shape[:2], device=x.device)
            m = m.to(x.device, torch.float32)[:, -x.shape[1]:]
            mean = (x.float() * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
            self._cur[slot] = mean.to(self.dtype).cpu()
        return record

    def _points(self) -> list:
        return [(Units.point(site, L), self._record(slot)) for slot, (site, L, _, _) in enumerate(self.units.blocks())]

    def begin(self):
        """Call before each recorded forward."""
        self._cur = [None] * len(self.units.blocks())

    def end(self):
        """Call after each recorded forward: keeps its rows."""
        if self._cur is not None and self.active:
            if any(t is None for t in self._cur):
                raise RuntimeError("a site was not reached in the forward pass")
            self._rows.append(torch.cat(self._cur, dim=1))
        self._cur = None

    def result(self) -> torch.Tensor:
        return torch.cat(self._rows) if self._rows else torch.zeros(0, self.units.size, dtype=self.dtype)


@contextlib.contextmanager
def zero_units(lm: Loaded, units: Units, flat):
    """Set the given units (flat indices of ``units``) to 0 at every position of every forward
    pass while the block is active, prompt and KV-cached generation alike."""
    flat = np.unique(np.asarray(flat, dtype=np.int64).reshape(-1))

    def zero(idx):
        def f(x):
            x = x.clone()
            x[..., idx.to(x.device)] = 0
            return x
        return f

    with hooks.points(lm, {p: zero(torch.tensor(idx)) for p, idx in units.group(flat).items()}):
        yield flat
