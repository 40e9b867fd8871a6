"""One hook API for GPT-2, Llama, Gemma-2, Mistral and BERT (plain PyTorch hooks on HF modules).

Neuron activations are read at the *input of the MLP output projection* (``W_out``): after the
nonlinearity, and for gated MLPs ``act(gate) * up``. That is TransformerLens'
``blocks.{L}.mlp.hook_post``; zeroing a neuron there removes exactly its value vector
``W_out[i]`` from the residual stream.

* :class:`MLPRecorder` / :func:`mlp_activation_stats`: per-neuron sum, count and mean over chosen
  positions, reduced as the forward streams (never [batch, pos, d_mlp] for all layers at once),
  optionally mean-pooled per sequence.
* :func:`value_vectors`, :func:`cosine_with`, :func:`logit_lens`: what each neuron writes.
* :func:`intervene`: set / scale / add / zero neurons during forward passes and generation;
  :func:`intervene_each`: one table per copy of each prompt, several conditions in one batch.
* :func:`pooled_residuals`, :func:`residual_means`: mean-pooled residual stream at any layers (for probes).
* :func:`residual_add`: add a vector to the residual stream after chosen blocks (activation addition).
* :func:`attention`: capture attention patterns and plug in an attention refinement, through one
  function registered with transformers' ``AttentionInterface``; the plugs live in an explicit
  registry for the duration of the block, nothing is stored on the Hugging Face modules.

Layers, everywhere: an int L is block L, 0..n_layers-1, negative counting from the end (-1 = the
last block), as :meth:`lib.models.ModelInfo.check_layer` accepts. The residual stream "at layer L"
is the output of block L (what :func:`residual_add` edits); the residual stream also has the points
'embed' (the embeddings, before block 0) and 'final' (after the final norm): :func:`residual_point`.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from lib.infra import repro
from lib.models import Loaded

MODES = ("set", "scale", "add", "zero")
POSITIONS = ("all", "last_k", "from")


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


class MLPRecorder:
    """Streaming per-neuron statistics at the MLP output projection's input.

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
        self._handles: list = []

    def _hook(self, slot: int):
        def pre_hook(module, args):
            x = args[0].detach()  # [batch, pos, d_mlp]
            m = self.mask
            if m is None:
                m = torch.ones(x.shape[:2], device=x.device)
            m = m.to(x.device, torch.float32)[:, -x.shape[1]:]  # also fits KV-cached steps
            xs = x.float() * m.unsqueeze(-1)
            self.sum[slot] += xs.sum((0, 1)).double().cpu()
            self.count[slot] += float(m.sum())
            if self.pooled_on:
                self._pooled[slot].append((xs.sum(1) / m.sum(1, keepdim=True).clamp_min(1)).cpu())
        return pre_hook

    def __enter__(self):
        for slot, L in enumerate(self.layers):
            self._handles.append(self.lm.mlp_out_module(L).register_forward_pre_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

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
    layer: int
    neuron: int
    mode: str = "zero"  # set | scale | add | zero
    value: float = 0.0


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
def _mlp_out_pre_hooks(lm: Loaded, hook_by_layer: dict):
    """Registers each layer's forward pre-hook on its MLP output projection; all removed on exit, even on error."""
    handles = []
    try:
        for L, hook in sorted(hook_by_layer.items()):
            handles.append(lm.mlp_out_module(L).register_forward_pre_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def intervene(lm: Loaded, table, positions: str | Sequence[int] | None = None):
    """Edit neurons while the block is active: forward passes and KV-cached generation alike.

    ``table``: rows of (layer, neuron, mode, value) as tuples, dicts, :class:`Edit` or a DataFrame.
    Modes: 'set' (activation := value), 'scale' (*= value), 'add' (+= value), 'zero'.
    ``positions``: None/'all' (every position), 'last' (last position of each forward), or a list
    of position indices into each forward's sequence. Hooks are removed on exit, even on error.
    """
    edits, grouped = _grouped_edits(lm, table)
    _check_positions(positions)

    def make_hook(by_mode):
        prepared = _prepared(by_mode)

        def pre_hook(module, args):
            x = args[0].clone()  # [batch, pos, d_mlp]
            sel = _selection(positions, x.shape[1])
            if sel is None:
                return None
            _edit(x, sel, prepared)
            return (x,) + tuple(args[1:])
        return pre_hook

    with _mlp_out_pre_hooks(lm, {L: make_hook(by_mode) for L, by_mode in grouped.items()}):
        yield edits


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

    def make_hook(per_copy):
        def pre_hook(module, args):
            x = args[0].clone()  # [batch, pos, d_mlp]
            if x.shape[0] % k:
                raise ValueError(f"a batch of {x.shape[0]} rows does not hold {k} copies of each sequence "
                                 "(generate with copies=len(tables))")
            sel = _selection(positions, x.shape[1])
            if sel is None:
                return None
            xv = x.view(x.shape[0] // k, k, *x.shape[1:])
            for c, prepared in enumerate(per_copy):
                if prepared:
                    _edit(xv[:, c], sel, prepared)  # a view: writes into x
            return (x,) + tuple(args[1:])
        return pre_hook

    with _mlp_out_pre_hooks(lm, {L: make_hook(per_copy) for L, per_copy in per_layer.items()}):
        yield


# ----------------------------------------------------------------------------- random control sets


def random_neurons(like: np.ndarray, n_layers: int, d_mlp: int, seed: int = 0, match_layers: bool = True,
                   exclude: np.ndarray | None = None) -> np.ndarray:
    """A random control set with as many neurons as ``like`` [k, 2].

    match_layers=True draws, in each layer, as many neurons as ``like`` has there (same layer
    distribution); False draws uniformly over all neurons. Neurons in ``exclude`` (default: ``like``)
    are never drawn."""
    like = np.asarray(like, dtype=int).reshape(-1, 2)
    excl = like if exclude is None else np.asarray(exclude, dtype=int).reshape(-1, 2)
    banned = set((excl[:, 0] * d_mlp + excl[:, 1]).tolist())
    rng = np.random.default_rng(seed)
    if match_layers:
        out = []
        for L, c in zip(*np.unique(like[:, 0], return_counts=True)):
            pool = np.setdiff1d(np.arange(d_mlp), [f % d_mlp for f in banned if f // d_mlp == L])
            if len(pool) < c:
                raise ValueError(f"layer {L} has {len(pool)} neurons outside the excluded set, {c} asked for")
            out += [(int(L), int(i)) for i in rng.choice(pool, size=c, replace=False)]
        out = np.asarray(out, dtype=int).reshape(-1, 2)
    else:
        pool = np.setdiff1d(np.arange(n_layers * d_mlp), list(banned))
        flat = rng.choice(pool, size=len(like), replace=False)
        out = np.stack([flat // d_mlp, flat % d_mlp], 1)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def hooked(lm: Loaded) -> bool:
    """Whether a forward hook is registered on the model or one of its modules (an intervention is active)."""
    if not getattr(lm, "is_loaded", True):  # a models.LazyLoaded whose weights are not read yet: nothing hooks them
        return False
    return any(m._forward_pre_hooks or m._forward_hooks for m in lm.model.modules())


# Set by ``metrics.generate`` while it generates one batch from a prompt prefix (``metrics.prompt_prefix``):
# (the prefix, the batch's index, the copies per prompt). copy_activations_each reads it to start the source
# model from the source's own prefix of the same batch.
GENERATION_BATCH: contextvars.ContextVar = contextvars.ContextVar("generation_batch", default=None)


def cache_argument(model) -> str:
    """The name under which ``model.forward`` takes its KV cache: 'cache' (transformers 5) or 'past_key_values'."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def copy_activations(source: Loaded, target: Loaded, neurons, positions: str = "last"):
    """Same-text patching: inside the block every forward pass of ``target`` first runs ``source`` on the
    same inputs and sets ``neurons`` [(layer, neuron), ...] of ``target`` to the source's activations
    (the input of the MLP output projection, as :func:`intervene` writes) at ``positions`` of that
    forward: 'last' (the last position of each forward call, the authors' patch positions) or 'all'.

    Where a mean patch (:func:`intervene`, mode 'set') writes one value for every token, this writes what
    the source computes on the target's own text, token by token. In KV-cached generation the source keeps
    a KV cache of its own (started afresh with each generation), so both models advance in lockstep on
    the target's tokens. The two models must share their architecture's sizes (e.g. a model and its
    fine-tuned copy). Each forward costs one forward of each model; hooks are removed on exit."""
    with copy_activations_each(source, target, [neurons], positions):
        yield


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
    its prefix of that batch instead of reading the whole prompt again."""
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
    state = {"cache": None}  # the source's KV cache while the target generates

    def record(L):
        def hook(module, args):
            seen[L] = args[0].detach()
        return hook

    def run_source(module, args, kwargs):
        past = kwargs.get(target_key)
        current = GENERATION_BATCH.get()  # (prefix, batch index, copies) while generating from a prompt prefix
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
                               "started from a prefilled cache, e.g. metrics.generate's prefix): the source has no cache to match")
        kw = {k: v for k, v in kwargs.items()
              if k not in ("cache", "past_key_values", "labels", "use_cache", "logits_to_keep", "return_dict")}
        with torch.no_grad():
            source.model(*args, **kw, **{key: state["cache"]}, use_cache=state["cache"] is not None, **keep)

    def write(L):
        def hook(module, args):
            x = args[0].clone()  # [batch, pos, d_mlp]
            if x.shape[0] % k:
                raise ValueError(f"a batch of {x.shape[0]} rows does not hold {k} copies of each sequence "
                                 "(generate with copies=len(neuron_sets))")
            src = seen.pop(L).to(x.device, x.dtype)
            sel = slice(None) if positions == "all" else slice(x.shape[1] - 1, x.shape[1])
            xv, sv = x.view(x.shape[0] // k, k, *x.shape[1:]), src.view(src.shape[0] // k, k, *src.shape[1:])
            for c, i in enumerate(idx[L]):
                if len(i):
                    i = i.to(x.device)
                    part = xv[:, c, sel]
                    part[..., i] = sv[:, c, sel][..., i]
                    xv[:, c, sel] = part  # a view of x
            return (x,) + tuple(args[1:])
        return hook

    handles = []
    try:
        handles += [source.mlp_out_module(L).register_forward_pre_hook(record(L)) for L in idx]
        handles.append(target.model.register_forward_pre_hook(run_source, with_kwargs=True))
        handles += [target.mlp_out_module(L).register_forward_pre_hook(write(L)) for L in idx]
        yield
    finally:
        for h in handles:
            h.remove()


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


def _first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output  # [batch, pos, d_model]


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
    points = {layer: residual_point(lm, layer) for layer in layers}
    texts = list(texts)
    lengths = [len(ids) for ids in lm.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    out = {layer: torch.empty(len(texts), lm.info.d_model) for layer in points}
    base = getattr(lm.model, "base_model", lm.model)
    batch: dict = {}  # the current batch's mask [batch, pos, 1] and pooled states per point

    def pool(point, h):
        m = batch["mask"]
        batch[point] = ((h.float() * m).sum(1) / m.sum(1).clamp_min(1)).cpu()  # [batch, d_model]

    def after_block(L):
        return lambda module, args, output: pool(L, _first_tensor(output))

    def before_first_block(module, args, kwargs):
        pool("embed", args[0] if args else kwargs["hidden_states"])

    wanted = set(points.values())
    handles = []
    try:
        for L in sorted(p for p in wanted if isinstance(p, int)):
            handles.append(block_module(lm, L).register_forward_hook(after_block(L)))
        if "embed" in wanted:
            handles.append(block_module(lm, 0).register_forward_pre_hook(before_first_block, with_kwargs=True))
        n = (len(order) + batch_size - 1) // batch_size
        for chunk in repro.bar(batches(order, batch_size), total=n, desc=desc, progress=progress):
            enc = encode(lm, [texts[i] for i in chunk], max_length)
            batch.clear()
            batch["mask"] = enc["attention_mask"].unsqueeze(-1).float()
            res = base(**enc, **({"use_cache": False} if lm.info.is_causal else {}))
            if "final" in wanted:
                pool("final", res[0])  # last_hidden_state
            idx = torch.tensor(chunk)
            for layer, point in points.items():
                out[layer][idx] = batch[point]
    finally:
        for h in handles:
            h.remove()
    return out


@torch.inference_mode()
def residual_norm(lm: Loaded, texts: Sequence[str], layer: int, max_length: int = 32) -> float:
    """Median L2 norm of the residual stream after block ``layer`` over the texts' tokens, each text's
    first token left out (decoders park very large activations there). Padding is never counted."""
    L = residual_point(lm, layer)
    norms = []

    def hook(module, args, output):
        h = _first_tensor(output).float()
        m = mask & (mask.cumsum(-1) > 1)  # real tokens after each text's first (left or right padding)
        norms.append(h.norm(dim=-1)[m].cpu())

    handle = block_module(lm, L).register_forward_hook(hook)
    try:
        base = getattr(lm.model, "base_model", lm.model)
        for chunk in batches(list(texts), 16):
            enc = encode(lm, chunk, max_length)
            mask = enc["attention_mask"].bool()
            base(**enc, **({"use_cache": False} if lm.info.is_causal else {}))
    finally:
        handle.remove()
    return float(torch.cat(norms).median())


def residual_means(lm: Loaded, texts: Sequence[str], layer: int | str = "final", batch_size: int = 16,
                   max_length: int | None = 128, progress: bool = True) -> torch.Tensor:
    """[n_texts, d_model] residual stream at one ``layer`` (see :func:`residual_point`), mean-pooled:
    :func:`pooled_residuals`."""
    return pooled_residuals(lm, texts, (layer,), batch_size, max_length, progress)[layer]


def block_module(lm: Loaded, layer: int):
    """The whole transformer block ``layer`` (its output is the residual stream after the block)."""
    prefix = lm.info.mlp_out.split("{L}")[0] + "{L}"  # 'layers.{L}', 'h.{L}', 'encoder.layer.{L}'
    return lm.model.base_model.get_submodule(prefix.format(L=lm.info.check_layer(layer)))


@contextlib.contextmanager
def residual_add(lm: Loaded, vector: torch.Tensor, layers: Iterable[int] | None = None):
    """Activation addition: add ``vector`` [d_model] to the residual stream after each chosen block
    (default: all), at every position, in forward passes and KV-cached generation alike.
    ``vector`` [k, d_model]: one vector per copy of each sequence, for a batch of k copies side by side
    (row r gets vector r % k; ``metrics.generate(..., copies=k)``). Hooks are removed on exit, even on error."""
    info = lm.info
    if vector.shape[-1:] != (info.d_model,) or vector.dim() not in (1, 2):
        raise ValueError(f"vector must have shape [{info.d_model}] (d_model) or [k, {info.d_model}], got {list(vector.shape)}")
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)
    k = vector.shape[0] if vector.dim() == 2 else 0

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output  # [batch, pos, d_model]
        v = vector.to(h.device, h.dtype)
        if k:  # one vector per copy of each sequence (row r: copy r % k)
            if h.shape[0] % k:
                raise ValueError(f"a batch of {h.shape[0]} rows does not hold {k} copies of each sequence "
                                 "(generate with copies=k)")
            h = (h.view(h.shape[0] // k, k, *h.shape[1:]) + v[None, :, None, :]).view(h.shape)
        else:
            h = h + v
        return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h

    handles = []
    try:
        for L in chosen:
            handles.append(block_module(lm, L).register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- attention


ATTN_NAME = "compendium"
_registered = False


@dataclass(frozen=True)
class AttentionPlug:
    """What :func:`_attention` does at one attention module while a :func:`attention` block is open."""
    layer: int
    refine: Callable | None = None
    capture: Callable | None = None


# The plug points of the open :func:`attention` blocks, keyed by attention module (each block adds
# its modules on entry and restores what was there on exit). Nothing is stored on the modules.
_PLUGS: dict[torch.nn.Module, AttentionPlug] = {}


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
    """Eager attention with two plug points: a refinement of the logits and a capture of the pattern.

    query [batch, heads, q, d]; key/value [batch, kv_heads, k, d]; attention_mask additive
    [batch, 1, q, k] or None. Returns (output [batch, q, heads, d], pattern [batch, heads, q, k]).
    The plugs for ``module`` come from :data:`_PLUGS`; a module without one runs plain eager attention.
    """
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
    plug = _PLUGS.get(module)
    layer = None if plug is None else plug.layer
    if plug is not None and plug.refine is not None:
        scores = plug.refine(scores, valid, layer)
        if valid is not None:
            scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if plug is not None and plug.capture is not None:
        plug.capture(probs, valid, layer)
    probs_d = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs_d, value).transpose(1, 2).contiguous()
    return out, probs


@contextlib.contextmanager
def attention(lm: Loaded, refine: Callable | None = None, capture: Callable | None = None,
              layers: Iterable[int] | None = None):
    """Route the chosen layers' attention (default: all) through one eager function with plug points.

    ``refine(scores, valid, layer) -> scores``: new logits from the masked logits [batch, heads, q, k]
    (``valid``: bool [batch, 1, q, k] or None; ``layer``: the block index, an int); masked keys stay
    masked. ``capture(probs, valid, layer)``: sees every pattern. Yields {layer: :class:`AttentionPlug`}.
    A block opened inside another takes over the layers it chooses until it exits. On exit the
    plugs and the model's attention implementation are restored, even on error.
    """
    _register()
    info = lm.info
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)
    model = lm.model
    previous = model.config._attn_implementation
    saved: dict[torch.nn.Module, AttentionPlug | None] = {}
    plugs = {L: AttentionPlug(L, refine, capture) for L in chosen}
    try:
        model.set_attn_implementation(ATTN_NAME)
        for L, plug in plugs.items():
            m = lm.attention_module(L)
            saved[m] = _PLUGS.get(m)
            _PLUGS[m] = plug
        yield plugs
    finally:
        for m, before in saved.items():
            if before is None:
                _PLUGS.pop(m, None)
            else:
                _PLUGS[m] = before
        model.set_attn_implementation(previous)


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


# ----------------------------------------------------------------------------- MLP sites (paper C)

# Where a "neuron" can live in an MLP block. 'act' is the input of the output projection (what
# MLPRecorder and intervene read: act(gate) * up for gated MLPs); 'up', 'gate' and 'down' are the
# *output units* of those linear maps (paper C's neurons: "every output unit of up_proj, gate_proj
# and down_proj"). GPT-2 has no gate; its 'up' is c_fc's output (before the GELU), 'down' c_proj's.
SITES = ("act", "up", "gate", "down")
_SITE_MODULES = {"gpt2": {"up": "h.{L}.mlp.c_fc", "down": "h.{L}.mlp.c_proj"},
                 "llama": {"up": "layers.{L}.mlp.up_proj", "gate": "layers.{L}.mlp.gate_proj", "down": "layers.{L}.mlp.down_proj"}}
_SITE_MODULES["gemma2"] = _SITE_MODULES["mistral"] = _SITE_MODULES["llama"]


@dataclass(frozen=True)
class Units:
    """A flat index over the neurons of several MLP sites in every layer: site-major, then layer,
    then unit (the order of :meth:`blocks`). ``Units.of(lm, ("up", "gate", "down"))``."""
    sites: tuple[str, ...]
    n_layers: int
    widths: tuple[int, ...]  # one per site

    @classmethod
    def of(cls, lm: Loaded, sites: Sequence[str]) -> "Units":
        sites = tuple(sites)
        if not sites or len(set(sites)) != len(sites):
            raise ValueError(f"sites must be distinct names from {SITES}, got {sites!r}")
        info = lm.info
        widths = []
        for s in sites:
            if s not in SITES:
                raise ValueError(f"unknown MLP site {s!r}: use one of {', '.join(SITES)}")
            if s != "act" and s not in _SITE_MODULES.get(info.family, {}):
                raise ValueError(f"{info.family} models have no {s!r} projection (sites there: "
                                 f"act, {', '.join(_SITE_MODULES.get(info.family, {}))})")
            widths.append(info.d_model if s == "down" else info.d_mlp)
        return cls(sites, info.n_layers, tuple(widths))

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

    def stratum(self, flat) -> np.ndarray:
        """(site, layer) block number of each flat index: what a layer-matched control matches."""
        site, layer, _ = self.split(flat)
        return site * self.n_layers + layer

    def labels(self, flat) -> list[str]:
        site, layer, unit = self.split(flat)
        return [f"{self.sites[s]}:L{L}N{i}" for s, L, i in zip(site, layer, unit)]


def _site_hook_target(lm: Loaded, site: str, layer: int):
    """(module, 'input' | 'output') whose tensor holds the site's units."""
    if site == "act":
        return lm.mlp_out_module(layer), "input"
    return lm.model.base_model.get_submodule(_SITE_MODULES[lm.info.family][site].format(L=layer)), "output"


class UnitRecorder:
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
        self._handles: list = []

    def _make(self, slot: int, kind: str):
        def record(x):
            if not self.active:
                return
            m = self.mask if self.mask is not None else torch.ones(x.shape[:2], device=x.device)
            m = m.to(x.device, torch.float32)[:, -x.shape[1]:]
            mean = (x.float() * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
            self._cur[slot] = mean.to(self.dtype).cpu()

        if kind == "input":
            return lambda module, args: record(args[0].detach())
        return lambda module, args, output: record(_first_tensor(output).detach())

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

    def __enter__(self):
        for slot, (site, L, _, _) in enumerate(self.units.blocks()):
            module, kind = _site_hook_target(self.lm, site, L)
            h = self._make(slot, kind)
            self._handles.append(module.register_forward_pre_hook(h) if kind == "input" else module.register_forward_hook(h))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def result(self) -> torch.Tensor:
        return torch.cat(self._rows) if self._rows else torch.zeros(0, self.units.size, dtype=self.dtype)


@contextlib.contextmanager
def zero_units(lm: Loaded, units: Units, flat):
    """Set the given units (flat indices of ``units``) to 0 at every position of every forward
    pass while the block is active, prompt and KV-cached generation alike."""
    flat = np.unique(np.asarray(flat, dtype=np.int64).reshape(-1))
    site, layer, unit = units.split(flat)
    by_block: dict[tuple[int, int], list[int]] = {}
    for s, L, i in zip(site.tolist(), layer.tolist(), unit.tolist()):
        by_block.setdefault((s, L), []).append(i)
    handles = []

    def zero(idx):
        def f(x):
            x = x.clone()
            x[..., idx.to(x.device)] = 0
            return x
        return f

    try:
        for (s, L), idx in sorted(by_block.items()):
            module, kind = _site_hook_target(lm, units.sites[s], L)
            f = zero(torch.tensor(idx))
            if kind == "input":
                handles.append(module.register_forward_pre_hook(lambda m, args, f=f: (f(args[0]),) + tuple(args[1:])))
            else:
                handles.append(module.register_forward_hook(
                    lambda m, args, out, f=f: f(out) if isinstance(out, torch.Tensor) else (f(out[0]),) + tuple(out[1:])))
        yield flat
    finally:
        for h in handles:
            h.remove()
