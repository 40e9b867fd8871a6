"""Paper C's answers: the protocols, the answer rule, and one batched greedy pass that can record every unit's response."""
from __future__ import annotations

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from lib import hooks
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.relations.facts import gold_first_token
from lib.papers.relations.units import UnitRecorder, Units, zero_units

# ----------------------------------------------------------------------------- cached runs


def _model_key(lm: Loaded, model_name: str) -> dict:
    """What names the model in a record's key: its name and dtype (not its device: a record measured on a GPU
    is read by a CPU run; the record's provenance names the device)."""
    p = next(lm.model.parameters())
    return {"model": model_name, "dtype": str(p.dtype)}


# ============================================================================= the paper's protocol
#
# One pipeline, two labelled protocols: "paper" (the default: what relation-neurons.md records of the
# paper) and "ours" (the compendium's earlier choices, kept as a variant). Facts come from LRE, from
# KLAR, or from a user's JSONL file; `setup` screens, selects, identifies and caches, and returns a
# Study that the notebooks 11-14 share.


@dataclass(frozen=True)
class Protocol:
    name: str
    shots: int  # answered facts of the same relation before each prompt
    n_tokens: int  # greedy tokens generated per prompt
    sites: tuple[str, ...]  # lib.SITES: where a neuron lives
    k_fraction: float  # share of all units selected per relation
    rule: str  # how a continuation is scored against the object: see matches()
    description: str


PAPER_NEURONS, PAPER_K = 835_584, 3_000  # Llama-2-7B: 32 x (11,008 + 11,008 + 4,096) units; top 3,000
PROTOCOLS = {
    "paper": Protocol("paper", 0, 2, ("up", "gate", "down"), PAPER_K / PAPER_NEURONS, "prefix",
                      "the paper's: zero-shot prompts, 2 greedy tokens, correct when they and the object agree on "
                      "their common prefix, neurons = the output units of up, gate and down in every layer, "
                      "k = 3,000 / 835,584 (0.36%) of them"),
    "ours": Protocol("ours", 3, 4, ("act",), 200 / 46_080, "starts",
                     "the compendium's earlier choices (a variant): 3 answered facts before each prompt, 4 greedy "
                     "tokens, correct when the continuation starts with the object, neurons = act(gate)*up, "
                     "k = 200 / 46,080 (0.43%) of them"),
}
RULES = ("prefix", "starts")


def matches(continuation: str, gold: str, rule: str = "prefix") -> bool:
    """Is a continuation correct for ``gold`` (both stripped, case-insensitive)?

    'starts': it starts with the whole object. 'prefix' (the paper's, for 2 tokens): the shorter of
    the two is a prefix of the longer, so ' Tok' counts for 'Tokyo' and ' Paris,' for 'Paris'. With
    'prefix' a continuation of one character (a digit of a year) can match; that is the paper's rule."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: use one of {', '.join(RULES)}")
    c, g = continuation.strip().lower(), gold.strip().lower()
    if not c or not g:
        return False
    return c.startswith(g) if rule == "starts" else (c.startswith(g) or g.startswith(c))


@dataclass
class Answers:
    continuation: list[str]
    correct: np.ndarray  # [n] bool
    rank: np.ndarray  # [n] rank of the gold's first token at the first step (0 = greedy choice)
    logprob: np.ndarray  # [n] its log-probability there
    pooled: torch.Tensor | None = None  # [n, units.size] mean response over the prompt's tokens (record=True)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"continuation": self.continuation, "correct": self.correct, "rank": self.rank,
                             "logprob": self.logprob})


def _cache_of(out):
    """The KV cache of a forward's output (``cache`` in transformers 5, ``past_key_values`` before)."""
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


@torch.inference_mode()
def answer(lm: Loaded, prompts: Sequence[str], golds: Sequence[str], n_tokens: int = 2, rule: str = "prefix",
           units: "Units | None" = None, off=None, record: bool = False, batch_size: int = 64,
           max_prompt_tokens: int = 128, progress: bool = False, desc: str = "answers") -> Answers:
    """Greedy answers in batched forward passes: one prefill (last-position logits only) and
    ``n_tokens - 1`` KV-cached steps. ``off``: flat unit indices of ``units`` set to 0 at every
    position. ``record``: also return each prompt's mean response of every unit over its tokens,
    read in the same prefill (so identification needs no second pass)."""
    import contextlib
    import inspect

    if len(prompts) != len(golds):
        raise ValueError(f"{len(prompts)} prompts but {len(golds)} gold objects")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: use one of {', '.join(RULES)}")
    if (record or off is not None) and units is None:
        raise ValueError("record and off need units (lib.Units.of(lm, sites))")
    if not lm.info.is_causal:
        raise ValueError(f"{lm.name} is an encoder; answering needs a decoder")
    tok, model = lm.tokenizer, lm.model
    ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    longest = max((len(i) for i in ids), default=0)
    if longest > max_prompt_tokens:
        raise ValueError(f"a prompt has {longest} tokens, more than max_prompt_tokens={max_prompt_tokens}")
    if any(len(i) == 0 for i in ids):
        raise ValueError("an empty prompt has no tokens to continue")
    targets = [gold_first_token(lm, g) for g in golds]
    n = len(ids)
    order = sorted(range(n), key=lambda i: (len(ids[i]), i))
    new = [[] for _ in range(n)]
    rank, lp = np.zeros(n, dtype=int), np.zeros(n)
    sig = inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if "logits_to_keep" in sig else {}
    cache_arg = hooks.cache_argument(model)  # transformers 5 renamed the KV cache argument
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = {tok.eos_token_id} - {None}  # the tokenizer's and the model's end-of-text ids, as generate() stops at
    gc_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(gc_eos if isinstance(gc_eos, (list, tuple)) else [gc_eos]) - {None}
    dev = model.device
    off_ctx = zero_units(lm, units, off) if off is not None and len(off) else contextlib.nullcontext()
    rec = UnitRecorder(lm, units) if record else None
    with off_ctx, (rec if rec is not None else contextlib.nullcontext()):
        chunks = list(hooks.batches(order, batch_size))
        for chunk in repro.bar(chunks, total=len(chunks), desc=desc, progress=progress):
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk], device=dev)
            attn = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], device=dev)
            pos = (attn.cumsum(-1) - 1).clamp_min(0)
            if rec is not None:
                rec.active, rec.mask = True, attn
                rec.begin()
            out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=n_tokens > 1, **keep)
            if rec is not None:
                rec.end()
                rec.active = False
            logits = out.logits[:, -1].float()
            tgt = torch.tensor([targets[i] for i in chunk], device=logits.device)
            t_logit = logits.gather(1, tgt[:, None])
            rank[chunk] = (logits > t_logit).sum(1).cpu().numpy()
            lp[chunk] = (t_logit[:, 0] - torch.logsumexp(logits, -1)).cpu().numpy()
            nxt = logits.argmax(-1)
            steps = [nxt]
            past = _cache_of(out)
            for _ in range(n_tokens - 1):
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
                out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                            use_cache=True, **{cache_arg: past})
                past = _cache_of(out)
                nxt = out.logits[:, -1].argmax(-1)
                steps.append(nxt)
            toks = torch.stack(steps, 1).tolist()
            for row, i in enumerate(chunk):
                seq = toks[row]
                new[i] = seq[:next((j for j, t in enumerate(seq) if t in eos), len(seq))]
    cont = [tok.decode(t, skip_special_tokens=True) for t in new]
    pooled = None
    if rec is not None:
        rows = rec.result()  # in the order the prompts were processed
        inv = np.empty(n, dtype=int)
        inv[np.asarray(order, dtype=int)] = np.arange(n)
        pooled = rows[torch.from_numpy(inv)]
    return Answers(cont, np.array([matches(c, g, rule) for c, g in zip(cont, golds)], dtype=bool), rank, lp, pooled)


def measured_answers(lm: Loaded, model_name: str, prompts: Sequence[str], golds: Sequence[str], n_tokens: int = 2,
                     rule: str = "prefix", units: "Units | None" = None, off=None, batch_size: int = 64,
                     max_prompt_tokens: int = 128, progress: bool = False) -> Answers:
    """:func:`answer` (without ``record``) as a measurement record (step 'relation-answers': each prompt's
    continuation, right or wrong, the gold's rank and log-probability), keyed by the model, the prompts and
    golds, the units off and the protocol's decoding; computed only when the store lacks it."""
    off_list = [] if off is None else sorted(set(np.asarray(off, dtype=np.int64).reshape(-1).tolist()))
    params = {**_model_key(lm, model_name), "prompts": cache.content_hash([list(prompts), list(golds)]),
              "off": cache.content_hash(off_list), "sites": list(units.sites) if off_list and units is not None else [],
              "n_tokens": n_tokens, "rule": rule, "max_prompt_tokens": max_prompt_tokens}

    def build():
        a = answer(lm, prompts, golds, n_tokens, rule, units, off_list or None, batch_size=batch_size,
                   max_prompt_tokens=max_prompt_tokens, progress=progress)
        return {"continuation": a.continuation, "correct": a.correct, "rank": a.rank, "logprob": a.logprob}
    rec = store.measure("relation-answers", model_name, params, build, device=str(lm.model.device))
    return Answers(list(rec["continuation"]), np.asarray(rec["correct"], dtype=bool), np.asarray(rec["rank"]),
                   np.asarray(rec["logprob"], dtype=float))
