"""One hook API for GPT-2, Llama, Gemma-2, Mistral and BERT (plain PyTorch hooks on HF modules).

Neuron activations are read at the *input of the MLP output projection* (``W_out``): after the
nonlinearity, and for gated MLPs ``act(gate) * up``. That is TransformerLens'
``blocks.{L}.mlp.hook_post``; zeroing a neuron there removes exactly its value vector
``W_out[i]`` from the residual stream.

* :class:`MLPRecorder` / :func:`mlp_activation_stats`: per-neuron sum, count and mean over chosen
  positions, reduced as the forward streams (never [batch, pos, d_mlp] for all layers at once),
  optionally mean-pooled per sequence.
* :func:`value_vectors`, :func:`cosine_with`, :func:`logit_lens`: what each neuron writes.
* :func:`intervene`: set / scale / add / zero neurons during forward passes and generation.
* :func:`pooled_residuals`, :func:`residual_means`: mean-pooled residual stream at any layers (for probes).
* :func:`attention`: capture attention patterns and plug in an attention refinement, through one
  function registered with transformers' ``AttentionInterface``.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

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

        with MLPRecorder(loaded) as rec:
            rec.mask = position_mask(batch["attention_mask"])
            loaded.model(**batch)
        rec.mean()  # [n_layers, d_mlp]
    """

    def __init__(self, loaded: Loaded, layers: Iterable[int] | None = None, pooled: bool = False):
        info = loaded.info
        self.loaded = loaded
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
            self._handles.append(self.loaded.mlp_out_module(L).register_forward_pre_hook(self._hook(slot)))
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
def mlp_activation_stats(loaded: Loaded, texts: Sequence[str], positions: str = "all", k: int | None = None,
                         starts: Sequence[int] | None = None, layers: Iterable[int] | None = None,
                         pooled: bool = False, batch_size: int = 16, max_length: int | None = None,
                         progress: bool = True, desc: str = "MLP activations") -> NeuronStats:
    """Per-neuron mean activation over ``texts`` at the chosen positions (see :func:`position_mask`).

    ``starts`` (with positions='from') gives, per text, the token index where counting begins,
    e.g. the prompt length to count generated tokens only.
    """
    if positions == "from" and (starts is None or len(starts) != len(texts)):
        raise ValueError("positions='from' needs one start index per text")
    model = loaded.model
    with MLPRecorder(loaded, layers, pooled) as rec:
        n = (len(texts) + batch_size - 1) // batch_size if batch_size > 0 else 0
        for i, chunk in enumerate(tqdm(batches(list(texts), batch_size), total=n, desc=desc, disable=not progress)):
            enc = encode(loaded, chunk, max_length)
            st = None if starts is None else starts[i * batch_size:i * batch_size + len(chunk)]
            rec.mask = position_mask(enc["attention_mask"], positions, k, st)
            _forward_no_logits(model, enc)
    return NeuronStats(rec.mean(), rec.count.float(), rec.layers, rec.pooled() if pooled else None)


def encode(loaded: Loaded, texts: Sequence[str], max_length: int | None = None) -> dict:
    """Tokenise a batch (left padding for decoders) with position ids that skip the padding, so a
    text gets the same activations whatever it is batched with (GPT-2 has absolute positions)."""
    enc = loaded.tokenizer(list(texts), return_tensors="pt", padding=True, truncation=max_length is not None,
                           max_length=max_length).to(loaded.model.device)
    if loaded.info.is_causal:
        enc["position_ids"] = (enc["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return dict(enc)


def _forward_no_logits(model, enc):
    """Forward pass for its side effects (hooks); LM heads compute the last position only."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**enc, logits_to_keep=1, use_cache=False)
    return model(**enc)


# ----------------------------------------------------------------------------- value vectors


def value_vectors(loaded: Loaded, layer: int | None = None) -> torch.Tensor:
    """W_out rows: [d_mlp, d_model] for one layer, or [n_layers, d_mlp, d_model] for all.

    Row i is what neuron i adds to the residual stream per unit of activation."""
    def one(L):
        w = loaded.mlp_out_module(L).weight.detach()
        return w if loaded.info.family == "gpt2" else w.T  # GPT-2 Conv1D stores [in, out]
    if layer is not None:
        return one(layer)
    return torch.stack([one(L) for L in range(loaded.info.n_layers)])


def cosine_with(vectors: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Cosine of each vector (last dim) with ``direction`` [d_model]."""
    d = direction.to(vectors.device, vectors.dtype)
    return torch.nn.functional.cosine_similarity(vectors, d.expand_as(vectors), dim=-1)


def unembedding(loaded: Loaded) -> torch.Tensor:
    """[vocab, d_model] unembedding matrix (the LM head; for encoders, the input embedding)."""
    out = loaded.model.get_output_embeddings() if hasattr(loaded.model, "get_output_embeddings") else None
    if out is None:
        out = loaded.model.get_input_embeddings()
    return out.weight.detach()


def logit_lens(loaded: Loaded, vector: torch.Tensor, k: int = 10) -> list[str]:
    """The ``k`` tokens a residual-stream vector promotes most (direct logit attribution, no final norm)."""
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    logits = unembedding(loaded).float() @ vector.float().to(loaded.model.device)
    ids = logits.topk(k).indices.tolist()
    return [loaded.tokenizer.decode([i]) for i in ids]


def token_direction(loaded: Loaded, words: Sequence[str], minus: Sequence[str] = (), center: bool = True) -> torch.Tensor:
    """Mean unembedding of ``words`` (sub-tokens averaged per word) minus that of ``minus``.

    With no ``minus`` and ``center``, the vocabulary's mean unembedding is subtracted instead: raw
    unembeddings share a large common component that would dominate every cosine."""
    W = unembedding(loaded).float()

    def mean_of(ws):
        vecs = []
        for w in ws:
            ids = loaded.tokenizer(" " + w if loaded.info.is_causal else w, add_special_tokens=False)["input_ids"]
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


@contextlib.contextmanager
def intervene(loaded: Loaded, table, positions: str | Sequence[int] | None = None):
    """Edit neurons while the block is active: forward passes and KV-cached generation alike.

    ``table``: rows of (layer, neuron, mode, value) as tuples, dicts, :class:`Edit` or a DataFrame.
    Modes: 'set' (activation := value), 'scale' (*= value), 'add' (+= value), 'zero'.
    ``positions``: None/'all' (every position), 'last' (last position of each forward), or a list
    of position indices into each forward's sequence. Hooks are removed on exit, even on error.
    """
    info = loaded.info
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
    if positions not in (None, "all", "last") and not (isinstance(positions, (list, tuple)) and all(isinstance(p, int) for p in positions)):
        raise ValueError(f"positions must be None, 'all', 'last' or a list of ints, got {positions!r}")

    def make_hook(by_mode):
        prepared = {m: (torch.tensor(i), torch.tensor(v)) for m, (i, v) in by_mode.items()}

        def pre_hook(module, args):
            x = args[0].clone()  # [batch, pos, d_mlp]
            if positions in (None, "all"):
                sel = slice(None)
            elif positions == "last":
                sel = slice(x.shape[1] - 1, x.shape[1])
            else:
                sel = [p for p in positions if -x.shape[1] <= p < x.shape[1]]
                if not sel:
                    return None
            for mode, (idx, vals) in prepared.items():
                idx = idx.to(x.device)
                vals = vals.to(x.device, x.dtype)
                cur = x[:, sel][..., idx]
                new = {"set": vals.expand_as(cur), "scale": cur * vals, "add": cur + vals,
                       "zero": torch.zeros_like(cur)}[mode]
                part = x[:, sel]
                part[..., idx] = new
                x[:, sel] = part
            return (x,) + tuple(args[1:])
        return pre_hook

    handles = []
    try:
        for L, by_mode in sorted(grouped.items()):
            handles.append(loaded.mlp_out_module(L).register_forward_pre_hook(make_hook(by_mode)))
        yield edits
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- residual stream


@torch.inference_mode()
def pooled_residuals(loaded: Loaded, texts: Sequence[str], layers: Sequence[int] = (-1,), batch_size: int = 16,
                     max_length: int | None = 128, progress: bool = True,
                     desc: str = "residual stream") -> dict[int, torch.Tensor]:
    """{layer: [n_texts, d_model]} residual stream mean-pooled over non-pad tokens, every layer from
    the same forward pass. Texts are batched by length (less padding) and returned in input order.

    A layer indexes HF ``hidden_states``: 0 = embeddings, L = output of block L-1, and -1 = the
    last layer after the final norm (what the DPO paper's probe reads)."""
    n_states = loaded.info.n_layers + 1
    for layer in layers:
        if not isinstance(layer, int) or not -n_states <= layer < n_states:
            raise ValueError(f"layer {layer!r} out of range: hidden_states has {n_states} entries "
                             f"(0..{n_states - 1}, or -1)")
    texts = list(texts)
    lengths = [len(ids) for ids in loaded.tokenizer(texts, add_special_tokens=True)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lengths[i], i))
    out = {L: torch.empty(len(texts), loaded.info.d_model) for L in layers}
    base = getattr(loaded.model, "base_model", loaded.model)
    n = (len(order) + batch_size - 1) // batch_size
    for chunk in tqdm(batches(order, batch_size), total=n, desc=desc, disable=not progress):
        enc = encode(loaded, [texts[i] for i in chunk], max_length)
        hs = base(**enc, output_hidden_states=True).hidden_states
        m = enc["attention_mask"].unsqueeze(-1).float()
        for L in layers:
            out[L][torch.tensor(chunk)] = ((hs[L].float() * m).sum(1) / m.sum(1).clamp_min(1)).cpu()
    return out


def residual_means(loaded: Loaded, texts: Sequence[str], layer: int = -1, batch_size: int = 16,
                   max_length: int | None = 128, progress: bool = True) -> torch.Tensor:
    """[n_texts, d_model] residual stream at one ``layer``, mean-pooled: :func:`pooled_residuals`."""
    return pooled_residuals(loaded, texts, (layer,), batch_size, max_length, progress)[layer]


def block_module(loaded: Loaded, layer: int):
    """The whole transformer block ``layer`` (its output is the residual stream after the block)."""
    prefix = loaded.info.mlp_out.split("{L}")[0] + "{L}"  # 'layers.{L}', 'h.{L}', 'encoder.layer.{L}'
    return loaded.model.base_model.get_submodule(prefix.format(L=loaded.info.check_layer(layer)))


@contextlib.contextmanager
def residual_add(loaded: Loaded, vector: torch.Tensor, layers: Iterable[int] | None = None):
    """Activation addition: add ``vector`` [d_model] to the residual stream after each chosen block
    (default: all), at every position, in forward passes and KV-cached generation alike.
    Hooks are removed on exit, even on error."""
    info = loaded.info
    if vector.shape != (info.d_model,):
        raise ValueError(f"vector must have shape [{info.d_model}] (d_model), got {list(vector.shape)}")
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output  # [batch, pos, d_model]
        h = h + vector.to(h.device, h.dtype)
        return (h,) + tuple(output[1:]) if isinstance(output, tuple) else h

    handles = []
    try:
        for L in chosen:
            handles.append(block_module(loaded, L).register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- attention


ATTN_NAME = "compendium"
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
    """Eager attention with two plug points: a refinement of the logits and a capture of the pattern.

    query [batch, heads, q, d]; key/value [batch, kv_heads, k, d]; attention_mask additive
    [batch, 1, q, k] or None. Returns (output [batch, q, heads, d], pattern [batch, heads, q, k]).
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
    refine = getattr(module, "_compendium_refine", None)
    if refine is not None:
        scores = refine(scores, valid, module)
        if valid is not None:
            scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    capture = getattr(module, "_compendium_capture", None)
    if capture is not None:
        capture(probs, valid, module)
    probs_d = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs_d, value).transpose(1, 2).contiguous()
    return out, probs


@contextlib.contextmanager
def attention(loaded: Loaded, refine: Callable | None = None, capture: Callable | None = None,
              layers: Iterable[int] | None = None):
    """Route the chosen layers' attention through one eager function with plug points.

    ``refine(scores, valid, module) -> scores``: new logits from the masked logits
    [batch, heads, q, k] (``valid``: bool [batch, 1, q, k] or None); masked keys stay masked.
    ``capture(probs, valid, module)``: sees every pattern; ``module._compendium_layer`` is its layer.
    The model's attention implementation is restored on exit, even on error.
    """
    _register()
    info = loaded.info
    chosen = sorted({info.check_layer(int(L)) for L in layers}) if layers is not None else range(info.n_layers)
    model = loaded.model
    previous = model.config._attn_implementation
    mods = []
    try:
        model.set_attn_implementation(ATTN_NAME)
        for L in chosen:
            m = loaded.attention_module(L)
            m._compendium_layer = L
            m._compendium_refine = refine
            m._compendium_capture = capture
            mods.append(m)
        yield
    finally:
        for m in mods:
            m._compendium_refine = None
            m._compendium_capture = None
        model.set_attn_implementation(previous)


class AttentionRecorder:
    """Keeps attention patterns [batch, heads, q, k] per layer (on CPU) and their validity masks.

        rec = AttentionRecorder()
        with hooks.attention(loaded, capture=rec):
            loaded.model(**enc)
        rec.patterns[L]
    """

    def __init__(self):
        self.patterns: dict[int, torch.Tensor] = {}
        self.valid: dict[int, torch.Tensor | None] = {}

    def __call__(self, probs, valid, module):
        L = module._compendium_layer
        self.patterns[L] = probs.detach().float().cpu()
        self.valid[L] = None if valid is None else valid.detach().cpu()
