"""One hook mechanism for GPT-2, Llama, Gemma-2, Mistral and BERT: :func:`points`.

``with hooks.points(lm, {name: fn, ...}):`` attaches functions at *named points* of the real Hugging
Face module tree (plain PyTorch hooks); every handle lives inside the block and is removed on exit,
even on error. Nothing is stored on the Hugging Face modules. Every tool below (recording, patching,
zeroing, steering, copying, attention capture and refinement) is a small function on top of it.

Point names (TransformerLens-style; L is a block index 0..n_layers-1, negative counting from the end),
with what the attached function is called with:

* ``blocks.{L}.hook_resid_pre`` (x): the residual stream entering block L.
* ``blocks.{L}.hook_resid_post`` (x): the output of block L, the residual stream after it.
* ``blocks.{L}.mlp.hook_up`` (x): the up projection's output units (GPT-2 ``c_fc``, before the GELU;
  BERT ``intermediate.dense``).
* ``blocks.{L}.mlp.hook_gate`` (x): the gate projection's output units (gated MLPs: Llama, Gemma-2,
  Mistral).
* ``blocks.{L}.mlp.hook_post`` (x): the MLP's neurons, the input of its output projection ``W_out``:
  after the nonlinearity, ``act(gate) * up`` for gated MLPs.
* ``blocks.{L}.mlp.hook_out`` (x): the output projection's output units, the MLP's output (BERT:
  before its residual add and LayerNorm).
* ``blocks.{L}.attn.hook_attn_scores`` (scores, valid): the masked attention logits [batch, heads, q, k].
* ``blocks.{L}.attn.hook_pattern`` (probs, valid): the attention probabilities [batch, heads, q, k].
* ``input`` (args, kwargs): the model's forward call, before anything runs.

A function returns None to leave what it got as it is, or a tensor that replaces it downstream (at
``input``: an (args, kwargs) pair). Several functions at one point run in the order given, each on
what the one before returned. ``valid`` is a bool mask [batch, 1, q, k] of the keys each query may
see (None: all); masked keys stay masked whatever a scores function returns. The attention points
route the model's attention through one eager function (:func:`_attention`, registered with
transformers' ``AttentionInterface``) while the block is open; the functions reach it as a keyword
argument of that call, passed by a hook on the attention module. :func:`resolve` maps a name to its
(module, kind); :func:`point_names` lists the names of a model.

``blocks.{L}.mlp.hook_post`` is TransformerLens' point of the same name; zeroing a neuron there
removes exactly its value vector ``W_out[i]`` from the residual stream.

**A neuron is a point and an index into its last dimension**: (``blocks.{L}.mlp.hook_post``, i) is
neuron i of block L. :class:`Edit` (layer, neuron) is that address at ``mlp.hook_post``
(:attr:`Edit.point`); :class:`Units` numbers the units of several MLP points (its *sites* 'act', 'up',
'gate', 'down' are ``hook_post``, ``hook_up``, ``hook_gate``, ``hook_out``: :data:`SITE_POINTS`) with
one flat index, and :meth:`Units.group` turns flat indices back into {point: indices}.

On top of :func:`points`:

* :class:`MLPRecorder` / :func:`mlp_activation_stats`: per-neuron sum, count and mean at
  ``mlp.hook_post`` over chosen positions, reduced as the forward streams, optionally per sequence.
* :func:`intervene`: set / scale / add / zero neurons during forward passes and generation;
  :func:`intervene_each`: one table per copy of each prompt, several conditions in one batch.
* :func:`copy_activations` / :func:`copy_activations_each`: same-text patching from another model.
* :func:`pooled_residuals`, :func:`residual_means`, :func:`residual_norm`: the residual stream.
* :func:`residual_add`: add a vector after chosen blocks (activation addition).
* :func:`attention`, :class:`AttentionRecorder`: capture patterns, plug in a refinement (SAOBP).
* :class:`UnitRecorder`, :func:`zero_units`: paper C's units.
* :func:`value_vectors`, :func:`cosine_with`, :func:`logit_lens`: what each neuron writes.

Layers, everywhere: an int L is block L, 0..n_layers-1, negative counting from the end (-1 = the
last block), as :meth:`lib.models.ModelInfo.check_layer` accepts. The residual stream "at layer L"
is the output of block L (``blocks.{L}.hook_resid_post``, what :func:`residual_add` edits); the
residual stream also has the points 'embed' (the embeddings, ``blocks.0.hook_resid_pre``) and
'final' (after the final norm): :func:`residual_point`.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from lib.infra import repro
from lib.models import Loaded

MODES = ("set", "scale", "add", "zero")
POSITIONS = ("all", "last_k", "from")


# ----------------------------------------------------------------------------- named points

# Module paths (relative to model.base_model) that are not in ModelInfo (which has the MLP output
# projection, ``info.mlp_out``, and the attention module, ``info.attention``).
_LLAMA_LIKE = {"block": "layers.{L}", "up": "layers.{L}.mlp.up_proj", "gate": "layers.{L}.mlp.gate_proj"}
_MODULES = {"gpt2": {"block": "h.{L}", "up": "h.{L}.mlp.c_fc"},
            "llama": _LLAMA_LIKE, "gemma2": _LLAMA_LIKE, "mistral": _LLAMA_LIKE,
            "bert": {"block": "encoder.layer.{L}", "up": "encoder.layer.{L}.intermediate.dense"}}
# point (after 'blocks.{L}.') -> (module, kind): 'input' / 'output' of the module, or the attention
# function's 'scores' / 'pattern' inside it
_POINTS = {"hook_resid_pre": ("block", "input"), "hook_resid_post": ("block", "output"),
           "mlp.hook_up": ("up", "output"), "mlp.hook_gate": ("gate", "output"),
           "mlp.hook_post": ("down", "input"), "mlp.hook_out": ("down", "output"),
           "attn.hook_attn_scores": ("attn", "scores"), "attn.hook_pattern": ("attn", "pattern")}
INPUT = "input"  # the model's forward call


def _template(lm: Loaded, module: str) -> str | None:
    if module == "down":
        return lm.info.mlp_out
    if module == "attn":
        return lm.info.attention
    return _MODULES[lm.info.family].get(module)


def point_names(lm: Loaded, layer: int | None = None) -> list[str]:
    """The point names of ``lm`` (of one block with ``layer``), in the order of the table above."""
    layers = range(lm.info.n_layers) if layer is None else [lm.info.check_layer(layer)]
    return [f"blocks.{L}.{p}" for L in layers for p, (m, _) in _POINTS.items()
            if _template(lm, m) is not None] + ([INPUT] if layer is None else [])


def resolve(lm: Loaded, name: str) -> tuple[torch.nn.Module, str]:
    """(module, kind) of the point ``name``: kind 'input' / 'output' (the module's first input or its
    output), 'scores' / 'pattern' (inside the attention module) or 'call' (``input``: the model)."""
    if name == INPUT:
        return lm.model, "call"
    m = re.fullmatch(r"blocks\.(-?\d+)\.(.+)", name) if isinstance(name, str) else None
    spec = _POINTS.get(m.group(2)) if m else None
    template = _template(lm, spec[0]) if spec else None
    if template is None:
        info = lm.info
        valid = [f"blocks.{{L}}.{p}" for p, (mod, _) in _POINTS.items() if _template(lm, mod) is not None]
        raise ValueError(f"unknown point {name!r} for {info.name} ({info.family}): valid points are "
                         f"{', '.join(valid)} (L in 0..{info.n_layers - 1}) and {INPUT!r}")
    L = lm.info.check_layer(int(m.group(1)))
    return lm.model.base_model.get_submodule(template.format(L=L)), spec[1]


def _on_input(fn):
    def hook(module, args, kwargs):
        y = fn(args[0] if args else kwargs["hidden_states"])
        if y is None:
            return None
        return ((y,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})
    return hook


def _on_output(fn):
    def hook(module, args, output):
        y = fn(output[0] if isinstance(output, tuple) else output)
        if y is None:
            return None
        return (y,) + tuple(output[1:]) if isinstance(output, tuple) else y
    return hook


def _on_call(fn):
    return lambda module, args, kwargs: fn(args, kwargs)


@contextlib.contextmanager
def points(lm: Loaded, fns):
    """Attach functions at named points (see the module docstring) while the block is open.

    ``fns``: {name: fn} or [(name, fn), ...] (a list may name a point twice). Every name is checked
    before anything is attached (ValueError naming the valid points). All handles are removed and
    the model's attention implementation restored on exit, even on error.

        with hooks.points(lm, {"blocks.1.mlp.hook_post": lambda x: seen.append(x.detach())}):
            lm.model(**enc)
    """
    pairs = list(fns.items()) if isinstance(fns, dict) else list(fns)
    resolved = [(resolve(lm, name), fn) for name, fn in pairs]
    plugs: dict[torch.nn.Module, dict[str, list]] = {}  # attention module -> its scores and pattern functions
    handles = []
    model, previous = lm.model, None
    try:
        for (module, kind), fn in resolved:
            if kind == "input":
                handles.append(module.register_forward_pre_hook(_on_input(fn), with_kwargs=True))
            elif kind == "output":
                handles.append(module.register_forward_hook(_on_output(fn)))
            elif kind == "call":
                handles.append(module.register_forward_pre_hook(_on_call(fn), with_kwargs=True))
            else:
                plugs.setdefault(module, {"scores": [], "pattern": []})[kind].append(fn)
        if plugs:
            _register()
            previous = model.config._attn_implementation
            model.set_attn_implementation(ATTN_NAME)
            for module, plug in plugs.items():
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, plug=plug: (args, {**kwargs, _PLUG: plug}), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()
        if previous is not None:
            model.set_attn_implementation(previous)


# ----------------------------------------------------------------------------- the attention points

ATTN_NAME = "compendium"
_PLUG = "compendium_points"  # the keyword under which an attention module hands its functions to _attention
_registered = False


def _register():
    """Route attention through :func:`_attention` under the name 'compendium' (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, eager_mask)  # additive float masks, as eager
    _registered = True


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention with the points ``attn.hook_attn_scores`` and ``attn.hook_pattern``.

    query [batch, heads, q, d]; key/value [batch, kv_heads, k, d]; attention_mask additive
    [batch, 1, q, k] or None. Returns (output [batch, q, heads, d], pattern [batch, heads, q, k]).
    The functions come in ``kwargs[_PLUG]`` ({'scores': [...], 'pattern': [...]}), put there by
    :func:`points` for this module's call; without them this is plain eager attention.
    """
    plug = kwargs.get(_PLUG) or {}
    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, n_rep), _repeat_kv(value, n_rep)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [batch, heads, q, k]
    if softcap is not None:  # Gemma-2 logit soft-capping
        scores = torch.tanh(scores / softcap) * softcap
    valid = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            valid = mask
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            valid = mask > torch.finfo(mask.dtype).min / 2
        scores = scores + mask
    if plug.get("scores"):
        for fn in plug["scores"]:
            new = fn(scores, valid)
            scores = scores if new is None else new
        if valid is not None:
            scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    for fn in plug.get("pattern", ()):
        new = fn(probs, valid)
        probs = probs if new is None else new
    probs_d = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs_d, value).transpose(1, 2).contiguous()
    return out, probs


# ----------------------------------------------------------------------------- position masks


def position_mask(attention_mask: torch.Tensor, mode: str = "all", k: int | None = None,
                  start: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Which token positions count, as a float mask [batch, pos], for left or right padding.

    mode 'all': every non-pad token; 'last_k': the last ``k`` non-pad tokens of each sequence;
    'from': non-pad tokens from index ``start[b]`` of the *unpadded* sequence on (e.g. the
    generated tokens, with start = prompt length).
    """
    if mode not in POSITIONS:
        raise ValueError(f"unknown positions mode {mode!r}: use one of {', '.join(POSITIONS)}")
    m = attention_mask.float()  # [batch, pos]
    if mode == "all":
        return m
    if mode == "last_k":
        if not isinstance(k, int) or k <= 0:
            raise ValueError(f"positions 'last_k' needs k > 0, got {k!r}")
        from_end = m.flip(-1).cumsum(-1).flip(-1)  # 1 at the last real token, 2 before it, ...
        return m * (from_end <= k).float()
    if start is None:
        raise ValueError("positions 'from' needs start (one index per sequence)")
    idx = m.cumsum(-1) - 1  # index of each real token within its unpadded sequence
    start = torch.as_tensor(start, device=m.device).view(-1, 1)
    return m * (idx >= start).float()


# ----------------------------------------------------------------------------- MLP recording


def mlp_post(layer: int) -> str:
    """The name of block ``layer``'s MLP neurons: ``blocks.{layer}.mlp.hook_post``."""
    return f"blocks.{layer}.mlp.hook_post"


class Attached:
    """A recorder that is a context manager: its :meth:`_points` are attached while it is open."""

    def _points(self) -> dict:
        raise NotImplementedError

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(points(self.lm, self._points()))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False


class MLPRecorder(Attached):
    """Streaming per-neuron statistics at ``blocks.{L}.mlp.hook_post``.

    Set ``rec.mask`` ([batch, pos] float, see :func:`position_mask`) before each forward; with
    no mask every position counts. With ``pooled=True`` it also keeps one masked mean per
    sequence: [n_sequences, n_layers, d_mlp].

        with MLPRecorder(lm) as rec:
            rec.mask = position_mask(batch["attention_mask"])
            lm.model(**batch)
        rec.mean()  # [n_layers, d_mlp]
    """

    def __init__(self, lm: Loaded, layers: Iterable[int] | None = None, pooled: bool = False):
        info = lm.info
        self.lm = lm
        self.layers = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else list(range(info.n_layers))
        self.pooled_on = pooled
        self.mask: torch.Tensor | None = None
        self.sum = torch.zeros(len(self.layers), info.d_mlp, dtype=torch.float64)  # [layers, d_mlp]
        self.count = torch.zeros(len(self.layers), dtype=torch.float64)
        self._pooled: list[list[torch.Tensor]] = [[] for _ in self.layers]

    def _record(self, slot: int):
        def record(x):
            x = x.detach()  # [batch, pos, d_mlp]
            m = self.mask
            if m is None:
                m = torch.ones(x.shape[:2], device=x.device)
            m = m.to(x.device, torch.float32)[:, -x.shape[1]:]  # also fits KV-cached steps
            xs = x.float() * m.unsqueeze(-1)
            self.sum[slot] += xs.sum((0, 1)).double().cpu()
            self.count[slot] += float(m.sum())
            if self.pooled_on:
                self._pooled[slot].append((xs.sum(1) / m.sum(1, keepdim=True).clamp_min(1)).cpu())
        return record

    def _points(self) -> dict:
        return {mlp_post(L): self._record(slot) for slot, L in enumerate(self.layers)}

    def mean(self) -> torch.Tensor:
        """[n_layers, d_mlp] mean activation over all counted positions."""
        return (self.sum / self.count.clamp_min(1).unsqueeze(-1)).float()

    def pooled(self) -> torch.Tensor:
        """[n_sequences, n_layers, d_mlp] per-sequence mean activation (needs pooled=True)."""
        if not self.pooled_on:
            raise ValueError("this recorder was made with pooled=False")
        return torch.stack([torch.cat(p) for p in self._pooled], dim=1)


@dataclass
class NeuronStats:
    mean: torch.Tensor  # [n_layers, d_mlp]
    count: torch.Tensor  # [n_layers] positions counted
    layers: list[int]
    pooled: torch.Tensor | None = None  # [n_texts, n_layers, d_mlp]


def batches(items: Sequence, batch_size: int):
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    for i in range(0, len(items), batch_size):
        yield items[i:i + batch_size]


@torch.inference_mode()
def mlp_activation_stats(lm: Loaded, texts: Sequence[str], positions: str = "all", k: int | None = None,
                         starts: Sequence[int] | None = None, layers: Iterable[int] | None = None,
                         pooled: bool = False, batch_size: int = 16, max_length: int | None = None,
                         progress: bool = True, desc: str = "MLP activations") -> NeuronStats:
    """Per-neuron mean activation over ``texts`` at the chosen positions (see :func:`position_mask`).

    ``starts`` (with positions='from') gives, per text, the token index where counting begins,
    e.g. the prompt length to count generated tokens only.
    """
    if positions == "from" and (starts is None or len(starts) != len(texts)):
        raise ValueError("positions='from' needs one start index per text")
    model = lm.model
    with MLPRecorder(lm, layers, pooled) as rec:
        n = (len(texts) + batch_size - 1) // batch_size if batch_size > 0 else 0
        chunks = repro.bar(batches(list(texts), batch_size), total=n, desc=desc, progress=progress)
        for i, chunk in enumerate(chunks):
            enc = encode(lm, chunk, max_length)
            st = None if starts is None else starts[i * batch_size:i * batch_size + len(chunk)]
            rec.mask = position_mask(enc["attention_mask"], positions, k, st)
            _forward_no_logits(model, enc)
    return NeuronStats(rec.mean(), rec.count.float(), rec.layers, rec.pooled() if pooled else None)


def encode(lm: Loaded, texts: Sequence[str], max_length: int | None = None) -> dict:
    """Tokenise a batch (left padding for decoders) with position ids that skip the padding, so a
    text gets the same activations whatever it is batched with (GPT-2 has absolute positions)."""
    enc = lm.tokenizer(list(texts), return_tensors="pt", padding=True, truncation=max_length is not None,
                       max_length=max_length).to(lm.model.device)
    if lm.info.is_causal:
        enc["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return dict(enc)


def _forward_no_logits(model, enc):
    """Forward pass for its side effects (hooks); LM heads compute the last position only."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**enc, logits_to_keep=1, use_cache=False)
    return model(**enc)


# ----------------------------------------------------------------------------- value vectors


def value_vectors(lm: Loaded, layer: int | None = None) -> torch.Tensor:
    """W_out rows: [d_mlp, d_model] for one layer, or [n_layers, d_mlp, d_model] for all.

    Row i is what neuron i adds to the residual stream per unit of activation."""
    def one(L):
        w = lm.mlp_out_module(L).weight.detach()
        return w if lm.info.family == "gpt2" else w.T  # GPT-2 Conv1D stores [in, out]
    if layer is not None:
        return one(layer)
    return torch.stack([one(L) for L in range(lm.info.n_layers)])


def cosine_with(vectors: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Cosine of each vector (last dim) with ``direction`` [d_model]."""
    d = direction.to(vectors.device, vectors.dtype)
    return torch.nn.functional.cosine_similarity(vectors, d.expand_as(vectors), dim=-1)


def unembedding(lm: Loaded) -> torch.Tensor:
    """[vocab, d_model] unembedding matrix (the LM head; for encoders, the input embedding)."""
    out = lm.model.get_output_embeddings() if hasattr(lm.model, "get_output_embeddings") else None
    if out is None:
        out = lm.model.get_input_embeddings()
    return out.weight.detach()


def logit_lens(lm: Loaded, vector: torch.Tensor, k: int = 10) -> list[str]:
    """The ``k`` tokens a residual-stream vector promotes most (direct logit attribution, no final norm)."""
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    logits = unembedding(lm).float() @ vector.float().to(lm.model.device)
    ids = logits.topk(k).indices.tolist()
    return [lm.tokenizer.decode([i]) for i in ids]


def token_direction(lm: Loaded, words: Sequence[str], minus: Sequence[str] = (), center: bool = True) -> torch.Tensor:
    """Mean unembedding of ``words`` (sub-tokens averaged per word) minus that of ``minus``.

    With no ``minus`` and ``center``, the vocabulary's mean unembedding is subtracted instead: raw
    unembeddings share a large common component that would dominate every cosine."""
    W = unembedding(lm).float()

    def mean_of(ws):
        vecs = []
        for w in ws:
            ids = lm.tokenizer(" " + w if lm.info.is_causal else w, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"word {w!r} has no tokens")
            vecs.append(W[ids].mean(0))
        return torch.stack(vecs).mean(0)
    d = mean_of(words)
    if minus:
        return d - mean_of(minus)
    return d - W.mean(0) if center else d


# ----------------------------------------------------------------------------- interventions


@dataclass(frozen=True)
class Edit:
    """An edit of neuron ``neuron`` of block ``layer``: the address (:attr:`point`, ``neuron``)."""
    layer: int
    neuron: int
    mode: str = "zero"  # set | scale | add | zero
    value: float = 0.0

    @property
    def point(self) -> str:
        return mlp_post(self.layer)


def _as_edits(table) -> list[Edit]:
    if hasattr(table, "to_dict"):  # pandas DataFrame with columns layer, neuron, mode, value
        table = table.to_dict("records")
    out = []
    for row in table:
        if isinstance(row, Edit):
            out.append(row)
        elif isinstance(row, dict):
            out.append(Edit(int(row["layer"]), int(row["neuron"]), row.get("mode", "zero"), float(row.get("value", 0.0))))
        else:
            out.append(Edit(int(row[0]), int(row[1]), *(row[2:3] or ("zero",)), *(map(float, row[3:4]))))
    return out


def _grouped_edits(lm: Loaded, table) -> tuple[list[Edit], dict[int, dict[str, tuple[list[int], list[float]]]]]:
    """The table's edits, checked, and grouped {layer: {mode: (neurons, values)}}."""
    info = lm.info
    edits = _as_edits(table)
    grouped: dict[int, dict[str, tuple[list[int], list[float]]]] = {}
    for e in edits:
        if e.mode not in MODES:
            raise ValueError(f"unknown intervention mode {e.mode!r}: use one of {', '.join(MODES)}")
        L = info.check_layer(e.layer)
        info.check_neuron(e.neuron)
        idx, vals = grouped.setdefault(L, {}).setdefault(e.mode, ([], []))
        idx.append(e.neuron)
        vals.append(e.value)
    return edits, grouped


def _check_positions(positions):
    if positions not in (None, "all", "last") and not (isinstance(positions, (list, tuple)) and all(isinstance(p, int) for p in positions)):
        raise ValueError(f"positions must be None, 'all', 'last' or a list of ints, got {positions!r}")


def _selection(positions, n_pos: int):
    """The positions of a forward call of ``n_pos`` positions that an intervention writes (None: none of them)."""
    if positions in (None, "all"):
        return slice(None)
    if positions == "last":
        return slice(n_pos - 1, n_pos)
    sel = [p for p in positions if -n_pos <= p < n_pos]
    return sel or None


def _prepared(by_mode) -> dict:
    return {m: (torch.tensor(i), torch.tensor(v)) for m, (i, v) in by_mode.items()}


def _edit(x: torch.Tensor, sel, prepared: dict) -> None:
    """Applies one layer's edits (:func:`_prepared`) to x [batch, pos, d_mlp] at positions ``sel``, in place."""
    for mode, (idx, vals) in prepared.items():
        idx = idx.to(x.device)
        vals = vals.to(x.device, x.dtype)
        cur = x[:, sel][..., idx]
        new = {"set": vals.expand_as(cur), "scale": cur * vals, "add": cur + vals, "zero": torch.zeros_like(cur)}[mode]
        part = x[:, sel]
        part[..., idx] = new
        x[:, sel] = part


@contextlib.contextmanager
def intervene(lm: Loaded, table, positions: str | Sequence[int] | None = None):
    """Edit neurons (at ``blocks.{L}.mlp.hook_post``) while the block is active: forward passes and
    KV-cached generation alike.

    ``table``: rows of (layer, neuron, mode, value) as tuples, dicts, :class:`Edit` or a DataFrame.
    Modes: 'set' (activation := value), 'scale' (*= value), 'add' (+= value), 'zero'.
    ``positions``: None/'all' (every position), 'last' (last position of each forward), or a list
    of position indices into each forward's sequence. Hooks are removed on exit, even on error.
    """
    edits, grouped = _grouped_edits(lm, table)
    _check_positions(positions)

    def edit(by_mode):
        prepared = _prepared(by_mode)

        def f(x):
            x = x.clone()  # [batch, pos, d_mlp]
            sel = _selection(positions, x.shape[1])
            if sel is None:
                return None
            _edit(x, sel, prepared)
            return x
        return f

    with points(lm, {mlp_post(L): edit(by_mode) for L, by_mode in sorted(grouped.items())}):
        yield edits


def _copies(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    """x [batch, ...] viewed as [batch // k, k, ...]: the k copies of each sequence side by side."""
    if x.shape[0] % k:
        raise ValueError(f"a batch of {x.shape[0]} rows does not hold {k} copies of each sequence "
                         f"(generate with copies={what})")
    return x.view(x.shape[0] // k, k, *x.shape[1:])


@contextlib.contextmanager
def intervene_each(lm: Loaded, tables: Sequence, positions: str | Sequence[int] | None = None):
    """:func:`intervene` with one table per copy of each prompt: several conditions in one batch.

    The batch must hold k = len(tables) copies of each sequence side by side (row r is copy r % k), as
    ``metrics.generate(..., copies=k)`` forms it; row r is edited by ``tables[r % k]`` exactly as
    :func:`intervene` edits it (an empty table leaves its rows as they are). Same modes and positions.
    """
    if not tables:
        raise ValueError("intervene_each needs at least one table")
    k = len(tables)
    _check_positions(positions)
    per_layer: dict[int, list[dict]] = {}
    for c, table in enumerate(tables):
        for L, by_mode in _grouped_edits(lm, table)[1].items():
            per_layer.setdefault(L, [{} for _ in range(k)])[c] = _prepared(by_mode)

    def edit(per_copy):
        def f(x):
            x = x.clone()  # [batch, pos, d_mlp]
            xv = _copies(x, k, "len(tables)")
            sel = _selection(positions, x.shape[1])
            if sel is None:
                return None
            for c, prepared in enumerate(per_copy):
                if prepared:
                    _edit(xv[:, c], sel, prepared)  # a view: writes into x
            return x
        return f

    with points(lm, {mlp_post(L): edit(per_copy) for L, per_copy in sorted(per_layer.items())}):
        yield


def hooked(lm: Loaded) -> bool:
    """Whether a forward hook is registered on the model or one of its modules (an intervention is active)."""
    if not getattr(lm, "is_loaded", True):  # a models.LazyLoaded whose weights are not read yet: nothing hooks them
        return False
    return any(m._forward_pre_hooks or m._forward_hooks for m in lm.model.modules())


def cache_argument(model) -> str:
    """The name under which ``model.forward`` takes its KV cache: 'cache' (transformers 5) or 'past_key_values'."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def copy_activations(source: Loaded, target: Loaded, neurons, positions: str = "last"):
    """Same-text patching: inside the block every forward pass of ``target`` first runs ``source`` on the
    same inputs and sets ``neurons`` [(layer, neuron), ...] of ``target`` to the source's activations
    (at ``blocks.{L}.mlp.hook_post``, as :func:`intervene` writes) at ``positions`` of that forward:
    'last' (the last position of each forward call, the authors' patch positions) or 'all'.

    Where a mean patch (:func:`intervene`, mode 'set') writes one value for every token, this writes what
    the source computes on the target's own text, token by token. In KV-cached generation the source keeps
    a KV cache of its own (started afresh with each generation), so both models advance in lockstep on
    the target's tokens. The two models must share their architecture's sizes (e.g. a model and its
    fine-tuned copy). Each forward costs one forward of each model; hooks are removed on exit.
    Yields what :func:`copy_activations_each` yields."""
    with copy_activations_each(source, target, [neurons], positions) as each_batch:
        yield each_batch


@contextlib.contextmanager
def copy_activations_each(source: Loaded, target: Loaded, neuron_sets: Sequence, positions: str = "last",
                          source_prefix=None):
    """:func:`copy_activations` with one neuron set per copy of each sequence: several conditions in one
    batch. The batch must hold k = len(neuron_sets) copies of each sequence side by side (row r is copy
    r % k), as ``metrics.generate(..., copies=k)`` forms it; in row r the neurons ``neuron_sets[r % k]``
    take the source's activations on that row (an empty set leaves the row as it is). The source runs once
    on the whole batch.

    ``source_prefix`` (``metrics.prompt_prefix`` of the source model, the same prompts and batch size): when
    the target generates from its own prompt prefix (``metrics.generate(..., prefix=...)``; only with
    'last', which leaves those positions as the target computes them), the source starts each batch from
    its prefix of that batch instead of reading the whole prompt again. For that the block yields
    ``each_batch``, to be passed on as ``metrics.generate(..., each_batch=each_batch)``: generate opens
    ``each_batch(prefix, j, copies)`` around batch j, which tells the source which of its prefixes to start
    from."""
    if source is target or source.model is target.model:
        raise ValueError("copy_activations needs two different models (source and target are the same)")
    si, ti = source.info, target.info
    if (si.n_layers, si.d_mlp) != (ti.n_layers, ti.d_mlp):
        raise ValueError(f"source and target differ in size: {si.n_layers} x {si.d_mlp} against {ti.n_layers} x {ti.d_mlp} "
                         "(layers x MLP neurons)")
    if positions not in ("all", "last"):
        raise ValueError(f"positions must be 'all' or 'last', got {positions!r}")
    if source_prefix is not None and positions != "last":
        raise ValueError("a source prefix needs positions='last' (with 'all' the prompt's positions are copied too)")
    if not neuron_sets:
        raise ValueError("copy_activations_each needs at least one neuron set")
    k = len(neuron_sets)
    by_layer: dict[int, list[set[int]]] = {}  # layer -> one set of neurons per copy
    for c, neurons in enumerate(neuron_sets):
        for L, i in neurons:
            by_layer.setdefault(ti.check_layer(int(L)), [set() for _ in range(k)])[c].add(ti.check_neuron(int(i)))
    idx = {L: [torch.tensor(sorted(v), dtype=torch.long) for v in per_copy] for L, per_copy in sorted(by_layer.items())}
    key, target_key = cache_argument(source.model), cache_argument(target.model)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(source.model.forward).parameters else {}
    seen: dict[int, torch.Tensor] = {}  # the source's activations in this forward, [batch, pos, d_mlp] per layer
    # the source's KV cache while the target generates; the batch being generated from a prompt prefix
    state = {"cache": None, "batch": None}

    @contextlib.contextmanager
    def each_batch(prefix, j: int, copies: int):
        """Open while ``metrics.generate`` generates batch ``j`` (from ``prefix``, or None; ``copies`` per prompt)."""
        state["batch"] = (prefix, j, copies) if prefix is not None and prefix.caches[j] is not None else None
        try:
            yield
        finally:
            state["batch"] = None

    def record(L):
        def f(x):
            seen[L] = x.detach()
        return f

    def run_source(args, kwargs):
        past = kwargs.get(target_key)
        current = state["batch"]  # (prefix, batch index, copies) while generating from a prompt prefix
        if past is None:  # a plain forward (e.g. perplexity): no cache for the source either
            state["cache"] = None
        elif past.get_seq_length() == 0:  # a new generation starts: a fresh cache for the source
            from transformers import DynamicCache
            state["cache"] = DynamicCache(config=source.model.config)
        elif (current is not None and source_prefix is not None
              and past.get_seq_length() == current[0].caches[current[1]].get_seq_length()):
            # the first step of a generation from the target's prompt prefix (its cache holds the prefix alone):
            # the source starts from its own prefix of that batch
            prefix, j, copies = current
            source_prefix.check(source, prefix.prompt_ids, prefix.batch_size)
            state["cache"] = copy.deepcopy(source_prefix.caches[j])
            if copies > 1:
                state["cache"].batch_repeat_interleave(copies)
            if state["cache"].get_seq_length() != past.get_seq_length():
                raise RuntimeError("copy_activations: the source's prompt prefix does not match the target's")
        elif state["cache"] is None or state["cache"].get_seq_length() != past.get_seq_length():
            raise RuntimeError("copy_activations: the target's KV cache is not the one the source followed (a generation "
                               "started from a prefilled cache, e.g. metrics.generate's prefix, without each_batch=): "
                               "the source has no cache to match")
        kw = {k: v for k, v in kwargs.items()
              if k not in ("cache", "past_key_values", "labels", "use_cache", "logits_to_keep", "return_dict")}
        with torch.no_grad():
            source.model(*args, **kw, **{key: state["cache"]}, use_cache=state["cache"] is not None, **keep)

    def write(L):
        def f(x):
            x = x.clone()  # [batch, pos, d_mlp]
            xv = _copies(x, k, "len(neuron_sets)")
            src = seen.pop(L).to(x.device, x.dtype)
            sel = slice(None) if positions == "all" else slice(x.shape[1] - 1, x.shape[1])
            sv = src.view(src.shape[0] // k, k, *src.shape[1:])
            for c, i in enumerate(idx[L]):
                if len(i):
                    i = i.to(x.device)
                    part = xv[:, c, sel]
                    part[..., i] = sv[:, c, sel][..., i]
                    xv[:, c, sel] = part  # a view of x
            return x
        return f

    with points(source, {mlp_post(L): record(L) for L in idx}), \
            points(target, [(INPUT, run_source)] + [(mlp_post(L), write(L)) for L in idx]):
        yield each_batch


# ----------------------------------------------------------------------------- residual stream

# Points of the residual stream besides the block outputs: the embeddings (the input of block 0) and
# the model's last hidden state (after the final norm: GPT-2 ln_f, Llama / Gemma-2 / Mistral norm; for
# BERT, which has none, the same as the output of the last block).
RESIDUAL_POINTS = ("embed", "final")


def residual_point(lm: Loaded, layer: int | str) -> int | str:
    """The point of the residual stream that ``layer`` names, in the lib-wide convention: an int L is
    the output of block L (0..n_layers-1, negative from the end: -1 = the last block), as in
    :func:`residual_add`, :func:`intervene` and :func:`attention`; or 'embed' / 'final'
    (:data:`RESIDUAL_POINTS`). Returns the block index in 0..n_layers-1, or the name."""
    if isinstance(layer, str) and layer in RESIDUAL_POINTS:
        return layer
    n = lm.info.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer < n:
        raise ValueError(f"layer {layer!r} out of range for {lm.info.name}: use a block 0..{n - 1} "
                         f"(or -{n}..-1 from the end), 'embed' or 'final'")
    return layer % n


def block_module(lm: Loaded, layer: int):
    """The whole transformer block ``layer`` (its output is the residual stream after the block)."""
    return resolve(lm, f"blocks.{layer}.hook_resid_post")[0]


@torch.inference_mode()
def pooled_residuals(lm: Loaded, texts: Sequence[str], layers: Sequence[int | str] = ("final",),
                     batch_size: int = 16, max_length: int | None = 128, progress: bool = True,
                     desc: str = "residual stream") -> dict[int | str, torch.Tensor]:
    """{layer: [n_texts, d_model]} residual stream mean-pooled over non-pad tokens, every layer from
    the same forward pass. Texts are batched by length (less padding) and returned in input order.

    ``layers`` as in :func:`residual_point`: L = the output of block L (-1 = the last block, before
    any final norm), 'embed' = the embeddings, 'final' = the last hidden state after the final norm
    (what the DPO paper's probe reads). The keys are the layers as given. (HF ``hidden_states[i]`` is
    'embed' for i = 0, block i-1 for 0 < i < n_layers, and 'final' for i = n_layers.)"""
    points_ = {layer: residual_point(lm, layer) for layer in layers}
    texts = list(texts)
    lengths = [len(ids) for ids in lm.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    out = {layer: torch.empty(len(texts), lm.info.d_model) for layer in points_}
    base = getattr(lm.model, "base_model", lm.model)
    batch: dict = {}  # the current batch's mask [batch, pos, 1] and pooled states per point

    def pool(point):
        def f(h):
            m = batch["mask"]
            batch[point] = ((h.float() * m).sum(1) / m.sum(1).clamp_min(1)).cpu()  # [batch, d_model]
        return f

    wanted = set(points_.values())
    fns = {f"blocks.{L}.hook_resid_post": pool(L) for L in sorted(p for p in wanted if isinstance(p, int))}
    if "embed" in wanted:
        fns["blocks.0.hook_resid_pre"] = pool("embed")
    with points(lm, fns):
        n = (len(order) + batch_size - 1) // batch_size
        for chunk in repro.bar(batches(order, batch_size), total=n, desc=desc, progress=progress):
            enc = encode(lm, [texts[i] for i in chunk], max_length)
            batch.clear()
            batch["mask"] = enc["attention_mask"].unsqueeze(-1).float()
            res = base(**enc, **({"use_cache": False} if lm.info.is_causal else {}))
            if "final" in wanted:
                pool("final")(res[0])  # last_hidden_state
            idx = torch.tensor(chunk)
            for layer, point in points_.items():
                out[layer][idx] = batch[point]
    return out


@torch.inference_mode()
def residual_norm(lm: Loaded, texts: Sequence[str], layer: int, max_length: int = 32) -> float:
    """Median L2 norm of the residual stream after block ``layer`` over the texts' tokens, each text's
    first token left out (decoders park very large activations there). Padding is never counted."""
    L = residual_point(lm, layer)
    norms = []
    batch = {}

    def norm(h):
        h = h.float()
        mask = batch["mask"]
        m = mask & (mask.cumsum(-1) > 1)  # real tokens after each text's first (left or right padding)
        norms.append(h.norm(dim=-1)[m].cpu())

    with points(lm, {f"blocks.{L}.hook_resid_post": norm}):
        base = getattr(lm.model, "base_model", lm.model)
        for chunk in batches(list(texts), 16):
            enc = encode(lm, chunk, max_length)
            batch["mask"] = enc["attention_mask"].bool()
            base(**enc, **({"use_cache": False} if lm.info.is_causal else {}))
    return float(torch.cat(norms).median())


def residual_means(lm: Loaded, texts: Sequence[str], layer: int | str = "final", batch_size: int = 16,
                   max_length: int | None = 128, progress: bool = True) -> torch.Tensor:
    """[n_texts, d_model] residual stream at one ``layer`` (see :func:`residual_point`), mean-pooled:
    :func:`pooled_residuals`."""
    return pooled_residuals(lm, texts, (layer,), batch_size, max_length, progress)[layer]


@contextlib.contextmanager
def residual_add(lm: Loaded, vector: torch.Tensor, layers: Iterable[int] | None = None):
    """Activation addition: add ``vector`` [d_model] to the residual stream after each chosen block
    (default: all; ``blocks.{L}.hook_resid_post``), at every position, in forward passes and KV-cached
    generation alike. ``vector`` [k, d_model]: one vector per copy of each sequence, for a batch of k copies
    side by side (row r gets vector r % k; ``metrics.generate(..., copies=k)``). Hooks are removed on exit,
    even on error."""
    info = lm.info
    if vector.shape[-1:] != (info.d_model,) or vector.dim() not in (1, 2):
        raise ValueError(f"vector must have shape [{info.d_model}] (d_model) or [k, {info.d_model}], got {list(vector.shape)}")
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)
    k = vector.shape[0] if vector.dim() == 2 else 0

    def add(h):  # [batch, pos, d_model]
        v = vector.to(h.device, h.dtype)
        if k:  # one vector per copy of each sequence (row r: copy r % k)
            return (_copies(h, k, "k") + v[None, :, None, :]).view(h.shape)
        return h + v

    with points(lm, {f"blocks.{L}.hook_resid_post": add for L in chosen}):
        yield


# ----------------------------------------------------------------------------- attention


@contextlib.contextmanager
def attention(lm: Loaded, refine: Callable | None = None, capture: Callable | None = None,
              layers: Iterable[int] | None = None):
    """Route the chosen layers' attention (default: all) through one eager function with plug points:
    ``blocks.{L}.attn.hook_attn_scores`` and ``blocks.{L}.attn.hook_pattern`` of :func:`points`.

    ``refine(scores, valid, layer) -> scores``: new logits from the masked logits [batch, heads, q, k]
    (``valid``: bool [batch, 1, q, k] or None; ``layer``: the block index, an int); masked keys stay
    masked. ``capture(probs, valid, layer)``: sees every pattern. Yields {layer: its two point names}.
    A block opened inside another takes over the layers it chooses until it exits. On exit the
    functions are gone and the model's attention implementation is restored, even on error.
    """
    info = lm.info
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)
    def refined(L):
        return lambda s, v: refine(s, v, L)

    def captured(L):
        def f(p, v):
            if capture is not None:
                capture(p, v, L)
        return f

    fns, names = [], {}
    for L in chosen:
        names[L] = (f"blocks.{L}.attn.hook_attn_scores", f"blocks.{L}.attn.hook_pattern")
        if refine is not None:
            fns.append((names[L][0], refined(L)))
        fns.append((names[L][1], captured(L)))  # also without capture: the layer runs through the function
    with points(lm, fns):
        yield names


class AttentionRecorder:
    """Keeps attention patterns [batch, heads, q, k] per layer (on CPU) and their validity masks.

        rec = AttentionRecorder()
        with hooks.attention(lm, capture=rec):
            lm.model(**enc)
        rec.patterns[L]
    """

    def __init__(self):
        self.patterns: dict[int, torch.Tensor] = {}
        self.valid: dict[int, torch.Tensor | None] = {}

    def __call__(self, probs, valid, layer: int):
        L = int(layer)
        self.patterns[L] = probs.detach().float().cpu()
        self.valid[L] = None if valid is None else valid.detach().cpu()
