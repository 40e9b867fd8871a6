"""Paper A's evaluation: toxicity, perplexity and F1 of a model, edited or not (Lee et al. 2024)."""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Sequence

import numpy as np

from lib import data, hooks, metrics, verdict
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.dpo.sizes import Sizes


def toxicity_perplexity_f1(lm: Loaded, n_prompts: int = Sizes.n_prompts, n_wiki: int = Sizes.n_wiki,
                           max_new_tokens: int = Sizes.max_new_tokens,
                           batch_size: int = metrics.GENERATE_BATCH_SIZE, scorer: str = "auto",
                           progress: bool = True, details: bool = False, toxicity_only: bool = False,
                           perplexity: bool = True, prompts: Sequence[str] | None = None,
                           prefixes: dict | None = None) -> dict:
    """Toxicity, perplexity and F1 as in Lee et al. (2024), at a chosen size.

    toxicity: mean scorer probability of the greedy continuations (continuation only) of the first
    ``n_prompts`` RealToxicityPrompts challenge prompts, each truncated to 32 tokens.
    perplexity: sliding-window perplexity of the first ``n_wiki`` wiki_samples gold texts.
    f1: mean bag-of-tokens F1 of greedy continuations of their prompts (<= 32 tokens) against gold.
    Uses only forward passes and generation, so it measures a model inside ``hooks.intervene``.
    With ``details``, also 'toxicities' (per prompt), 'continuations' and 'f1s' (per wiki row).
    ``toxicity_only``: stop after the challenge prompts (no perplexity, F1 or 'f1s'; the toxicity
    numbers are those of the full evaluation), for controls that compare toxicity alone.
    ``perplexity=False``: skip the perplexity (no 'perplexity' key), for :func:`evaluate`, which scores
    it under another intervention than the generations. ``prompts``: score these prompts instead of the
    challenge prompts (exactly ``n_prompts`` of them; see :func:`prompt_sets`). ``prefixes``
    {"challenge": ..., "wiki": ...}: ``metrics.prompt_prefix`` of each prompt set, for the generations
    to start from (:func:`evaluate` passes them; see there).
    """
    for k, v in (("n_prompts", n_prompts), ("n_wiki", n_wiki)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    kw = dict(n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, batch_size=batch_size, scorer=scorer,
              progress=progress, details=details, toxicity_only=toxicity_only, perplexity=perplexity, prompts=prompts)
    if prefixes is not None or hooks.hooked(lm):  # inside another intervention: what it measures is not recorded
        return _toxicity_perplexity_f1(lm, inputs, prefixes=prefixes, **kw)
    params = {"model": lm.name, "n_prompts": n_prompts, "n_wiki": n_wiki, "max_new_tokens": max_new_tokens,
              "batch_size": batch_size, "scorer": metrics.resolve_scorer(scorer), "details": details,
              "toxicity_only": toxicity_only, "perplexity": perplexity}
    return store.measure("toxicity-perplexity-f1", lm.records_name, params,
                         lambda: _toxicity_perplexity_f1(lm, inputs, **kw), inputs=inputs, device=str(lm.device))


def _toxicity_perplexity_f1(lm: Loaded, inputs: dict, *, n_prompts: int, n_wiki: int, max_new_tokens: int,
                            batch_size: int, scorer: str, progress: bool, details: bool, toxicity_only: bool,
                            perplexity: bool, prompts, prefixes: dict | None = None) -> dict:
    """:func:`toxicity_perplexity_f1`'s measurement itself (no record)."""
    prompts = inputs["challenge_prompts"]
    prefixes = prefixes or {}
    gen = metrics.generate(lm, prompts, max_new_tokens, batch_size, max_prompt_tokens=32, progress=progress,
                           desc="challenge prompts", prefix=prefixes.get("challenge"))
    tox, name = metrics.toxicity(gen.continuations, scorer)
    if toxicity_only:
        out = {"toxicity": float(np.mean(tox)), "scorer": name, "n_prompts": len(prompts)}
        if details:
            out.update(toxicities=[float(t) for t in tox], continuations=list(gen.continuations))
        return out
    wiki = inputs["wiki"]
    golds = [r["gold"] for r in wiki]
    ppl = metrics.perplexity(lm, golds, progress=progress) if perplexity else None
    wgen = metrics.generate(lm, [r["prompt"] for r in wiki], max_new_tokens, batch_size, max_prompt_tokens=32,
                            progress=progress, desc="wiki prompts", prefix=prefixes.get("wiki"))
    f1 = metrics.mean_f1(lm, wgen, golds)
    out = {"toxicity": float(np.mean(tox)), **({"perplexity": float(ppl)} if perplexity else {}), "f1": float(f1),
           "scorer": name, "n_prompts": len(prompts), "n_wiki": len(wiki)}
    if details:
        tok = lm.tokenizer
        out.update(toxicities=[float(t) for t in tox], continuations=list(gen.continuations),
                   f1s=[metrics.f1_bag_of_tokens(n, tok(g, add_special_tokens=False)["input_ids"])
                        for n, g in zip(wgen.new_ids, golds)])
    return out


def evaluation_inputs(n_prompts: int = Sizes.n_prompts, n_wiki: int = Sizes.n_wiki,
                      prompts: Sequence[str] | None = None, **_) -> dict:
    """The data :func:`toxicity_perplexity_f1` reads at these sizes: {"challenge_prompts", "wiki"}
    (the user's ``prompts`` in place of the challenge prompts when given; exactly ``n_prompts``).
    ``dpo_neurons.reference_evaluations`` puts its ``cache.content_hash`` into the cache key, so an
    edited prompt is evaluated again (other keyword arguments of the evaluation are ignored here)."""
    if prompts is not None:
        prompts = [str(p) for p in prompts]
        if len(prompts) != n_prompts:
            raise ValueError(f"{len(prompts)} prompts given for n_prompts = {n_prompts}: pass exactly n_prompts (dpo.prompt_sets)")
    return {"challenge_prompts": data.challenge_prompts(n_prompts) if prompts is None else prompts,
            "wiki": data.wiki_samples(n_wiki)}


def read_prompts(path) -> list[str]:
    """A user's prompts, one JSON object per line: ``{"text": "...", "id": "p1"}`` (``id`` optional,
    unique when given; format in data/README.md, 'Your own prompts'). Returns the texts in file order;
    one line per error, naming the line."""
    name = Path(path).name
    texts, ids = [], {}
    for no, row in data.user_jsonl(path, "prompts", "Your own prompts"):
        if not isinstance(row.get("text"), str) or not row["text"].strip():
            raise ValueError(f"{name} line {no}: expected an object with a non-empty 'text', e.g. {{\"text\": \"So I said\"}}")
        if "id" in row:
            if str(row["id"]) in ids:
                raise ValueError(f"{name} line {no}: id {row['id']!r} already used on line {ids[str(row['id'])]}")
            ids[str(row["id"])] = no
        texts.append(row["text"])
    if not texts:
        raise ValueError(f"{name} holds no prompts")
    return texts


def prompt_sets(prompts: str, n_prompts: int, n_stats_prompts: int = 0,
                stats_offset: int = 0) -> tuple[list[str], list[str]]:
    """The evaluation prompts and the statistics prompts of notebooks 02-06 (the ``prompts`` parameter).

    ``prompts`` "": the challenge prompts: the first ``n_prompts`` are scored, and the statistics use
    ``n_stats_prompts`` from ``stats_offset`` on, which must not overlap them. ``prompts`` a JSONL file
    (:func:`read_prompts`): its first ``n_prompts`` prompts are scored and its first
    ``n_stats_prompts`` give the statistics. The two then overlap, as the authors' own runs do (they
    used the challenge prompts for both); the statistics depend on the file alone, so notebooks 03-06
    share them. Raises when the file has fewer prompts than asked for."""
    for name, v in (("n_prompts", n_prompts), ("n_stats_prompts", n_stats_prompts), ("stats_offset", stats_offset)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if not prompts:
        n_challenge = len(data.challenge_prompts())
        if n_prompts > n_challenge:
            raise ValueError(f"n_prompts must be at most {n_challenge} (the challenge prompts in data/), got {n_prompts}")
        if n_stats_prompts and not n_prompts <= stats_offset < n_challenge:
            raise ValueError(f"stats_offset must lie in {n_prompts}..{n_challenge - 1} (from n_prompts on, so statistics and "
                             f"evaluation prompts do not overlap; {n_challenge} challenge prompts), got {stats_offset!r}")
        if n_stats_prompts and n_stats_prompts > n_challenge - stats_offset:
            lower = "" if stats_offset == n_prompts else (
                f"; a lower stats_offset{f' (at least n_prompts = {n_prompts})' if n_prompts else ''} leaves up to "
                f"{n_challenge - n_prompts}")
            raise ValueError(f"n_stats_prompts must be at most {n_challenge - stats_offset}: there are {n_challenge} challenge "
                             f"prompts and the statistics start at stats_offset = {stats_offset}{lower}; got {n_stats_prompts}")
        stats = data.challenge_prompts(stats_offset + n_stats_prompts)[stats_offset:] if n_stats_prompts else []
        return data.challenge_prompts(n_prompts) if n_prompts else [], stats
    texts = read_prompts(prompts)
    short = {k: v for k, v in (("n_prompts", n_prompts), ("n_stats_prompts", n_stats_prompts)) if v > len(texts)}
    if short:  # 04 scores no prompts (n_prompts 0 here); 02 sets n_prompts in overrides, 03 as its own parameter
        raise ValueError(f"{prompts} holds {len(texts)} prompts, but {' and '.join(f'{k} = {v}' for k, v in short.items())} "
                         f"ask{'s' if len(short) == 1 else ''} for more: add prompts, or set {' and '.join(short)} to at most "
                         f"{len(texts)} (a parameter of the notebook, else a key of overrides)")
    return texts[:n_prompts], texts[:n_stats_prompts]


toxicity_perplexity_f1.inputs = evaluation_inputs  # the data it reads, for content-keyed caches


def rescored(evaluations: Sequence[dict], scorer: str = metrics.EMBEDDING_SCORER) -> list[np.ndarray]:
    """Per-prompt toxicity of each evaluation's stored continuations (``details``, as :func:`evaluate`
    keeps them) under another scorer, scored in one batch: a verdict re-derived from these says
    whether it depends on the scorer. Default: the embedding scorer (``metrics.EMBEDDING_SCORER``)."""
    texts = [t for ev in evaluations for t in ev["continuations"]]
    tox, _ = metrics.toxicity(texts, scorer)
    bounds = np.cumsum([0] + [len(ev["continuations"]) for ev in evaluations])
    return [tox[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# Where an intervention table writes during an evaluation (:func:`evaluate`). 'last' is the authors'
# protocol (hook_utils.py in Yushi-Y/dpo-toxic-neurons, see shared/papers/dpo-toxicity.md): the hook
# writes the last position of each forward call, so in KV-cached generation the last prompt token and
# then each new token, and the prompt's other positions keep the model's own activations. 'all' writes
# every position of prompt and continuation (the compendium's earlier default, kept as a variant).
PATCH_POSITIONS = ("last", "all")


def evaluate(lm: Loaded, table=None, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str = "auto",
             toxicity_only: bool = False, positions: str = "last", prompts: Sequence[str] | None = None) -> dict:
    """:func:`toxicity_perplexity_f1` with per-prompt details and no bars, with ``table`` active
    (``hooks.intervene``; None: the model as it is). Notebooks 03, 05 and 06 bind their sizes once
    (``functools.partial``) and evaluate every condition with it; ``toxicity_only`` for the random
    controls, which compare toxicity alone; ``prompts``: the user's prompts (:func:`prompt_sets`).

    ``positions`` (:data:`PATCH_POSITIONS`) is where the table writes in generation (toxicity, F1).
    Perplexity is scored two ways, since a forward pass over a text has no "new token":
    'perplexity' with the table at **every** scored position (consistent: the patched model predicts
    every token it is scored on, as each generated token is under 'last'), and, with 'last',
    'perplexity_authors' with the table at position 0 of each window only, as the authors' code
    does; that one barely sees the patch (at most one token in 256 is written), so it is reported,
    never used to decide whether a patched model still works.

    With 'last', the generations start from the KV cache of each prompt without its last token,
    computed once per model and prompt set (:func:`shared_prefixes`): the table does not write those
    positions, so every condition shares them. Not while other hooks are active on ``lm`` (e.g.
    ``hooks.copy_activations``, whose source model needs the whole prompt).
    """
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    table = [] if table is None else table
    if hooks.hooked(lm):  # inside another intervention (e.g. hooks.copy_activations): not recorded
        return _evaluate(lm, table, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, scorer=scorer,
                         toxicity_only=toxicity_only, positions=positions, prompts=prompts)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    return store.measure("evaluation", lm.records_name,
                         _evaluation_params(lm, table, n_prompts, n_wiki, max_new_tokens, scorer, toxicity_only, positions),
                         lambda: _evaluate(lm, table, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens,
                                           scorer=scorer, toxicity_only=toxicity_only, positions=positions,
                                           prompts=prompts),
                         inputs=inputs, device=str(lm.device))


def _table_key(table) -> str:
    """The content hash of an intervention table: its edits (layer, neuron, mode, value) in order."""
    return cache.content_hash([[e.layer, e.neuron, e.mode, float(e.value)] for e in hooks._as_edits(table)])


def _evaluation_params(lm: Loaded, table, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
                       toxicity_only: bool, positions: str, copy_from: Loaded | None = None) -> dict:
    """What identifies one evaluation's record: the model, the intervention, where it writes and the sizes (the
    prompts and texts enter as their content hash); toxicity-only evaluations of :func:`evaluate` and
    :func:`evaluate_each` share their records."""
    what = ({"table": _table_key(table)} if copy_from is None else
            {"copy_from": copy_from.name, "neurons": cache.content_hash(sorted({(int(L), int(i)) for L, i in table}))})
    return {"model": lm.name, **what, "positions": positions, "n_prompts": n_prompts,
            "n_wiki": None if toxicity_only else n_wiki, "max_new_tokens": max_new_tokens,
            "scorer": metrics.resolve_scorer(scorer), "toxicity_only": toxicity_only}


def _evaluate(lm: Loaded, table, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
              toxicity_only: bool, positions: str, prompts) -> dict:
    """:func:`evaluate`'s measurement itself (no record)."""
    prefixes = (shared_prefixes(lm, n_prompts, n_wiki, prompts, toxicity_only)
                if positions == "last" and not hooks.hooked(lm) else None)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    with hooks.intervene(lm, table, positions=positions):
        out = _toxicity_perplexity_f1(lm, inputs, n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens,
                                      batch_size=metrics.GENERATE_BATCH_SIZE, scorer=scorer, progress=False,
                                      details=True, toxicity_only=toxicity_only, perplexity=positions == "all",
                                      prompts=prompts, prefixes=prefixes)
    if toxicity_only or positions == "all":
        return out
    golds = [r["gold"] for r in evaluation_inputs(n_prompts, n_wiki)["wiki"]]
    with hooks.intervene(lm, table, positions="all"):
        ppl = metrics.perplexity(lm, golds, progress=False)
    with hooks.intervene(lm, table, positions=[0]):
        ppl0 = metrics.perplexity(lm, golds, progress=False)
    head = {"toxicity": out.pop("toxicity"), "perplexity": float(ppl), "perplexity_authors": float(ppl0)}
    return {**head, **out}


# Conditions generated in one batch by :func:`evaluate_each` and the direction gate: each prompt's copies side
# by side. A CPU decoding step has a fixed cost (reading the weights) besides its cost per sequence: measured on
# smollm2-135m, 32 prompts x 20 tokens, one condition took 2.95 s alone and 1.33 s within a batch of 4 from the
# shared prompt prefix (2 threads; 5.15 and 2.29 s at one thread); 8 a batch were no faster per condition, and
# the continuations were the same token for token.
CONDITIONS_PER_BATCH = 4
_PREFIXES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {prompts: metrics.PromptPrefix}


def _prefix(lm: Loaded, prompts: Sequence[str]) -> metrics.PromptPrefix:
    """``metrics.prompt_prefix`` of these prompts on ``lm`` as it is now, kept while the model lives and its
    weights are unchanged."""
    memo = _PREFIXES.setdefault(lm.model, {})
    key = tuple(prompts)
    hit = memo.get(key)
    if hit is None or hit.version != metrics.weights_version(lm.model):
        hit = memo[key] = metrics.prompt_prefix(lm, prompts, metrics.GENERATE_BATCH_SIZE, max_prompt_tokens=32)
    return hit


def shared_prefixes(lm: Loaded, n_prompts: int, n_wiki: int, prompts: Sequence[str] | None = None,
                    toxicity_only: bool = False) -> dict:
    """{"challenge": ..., "wiki": ...}: the prompt prefixes (``metrics.prompt_prefix``) that :func:`evaluate`
    starts its generations from under 'last' patching, computed once per model and prompt set."""
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    out = {"challenge": _prefix(lm, inputs["challenge_prompts"])}
    if not toxicity_only:
        out["wiki"] = _prefix(lm, [r["prompt"] for r in inputs["wiki"]])
    return out


def evaluate_each(lm: Loaded, tables: Sequence, *, n_prompts: int, n_wiki: int, max_new_tokens: int,
                  scorer: str = "auto", positions: str = "last", prompts: Sequence[str] | None = None,
                  per_batch: int = CONDITIONS_PER_BATCH, progress: bool = False,
                  copy_from: Loaded | None = None) -> list[dict]:
    """``evaluate(lm, table, toxicity_only=True)`` for each of ``tables``, ``per_batch`` tables at a time in one
    generation (``metrics.generate(copies=...)`` with ``hooks.intervene_each``): the same keys (toxicity,
    scorer, n_prompts, toxicities, continuations), for the many random controls that compare toxicity alone.
    Under 'last' the generations start from the shared prompt prefix, as :func:`evaluate`'s do.
    ``progress``: a bar over the batches.

    ``copy_from``: same-text patching instead (``hooks.copy_activations_each``, 'last' or 'all'): each of
    ``tables`` is then a neuron set [(layer, neuron), ...] whose activations are copied from this model; under
    'last' both models start from their own prompt prefix."""
    if positions not in PATCH_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(PATCH_POSITIONS)}, got {positions!r}")
    if not isinstance(per_batch, int) or per_batch <= 0:
        raise ValueError(f"per_batch must be a positive integer, got {per_batch!r}")
    tables = list(tables)
    inputs = evaluation_inputs(n_prompts, n_wiki, prompts)
    kw = dict(n_prompts=n_prompts, n_wiki=n_wiki, max_new_tokens=max_new_tokens, scorer=scorer, positions=positions,
              prompts=prompts, per_batch=per_batch, progress=progress, copy_from=copy_from)
    if hooks.hooked(lm) or (copy_from is not None and hooks.hooked(copy_from)):  # inside another intervention
        return _evaluate_each(lm, tables, **kw)
    params = [_evaluation_params(lm, t, n_prompts, n_wiki, max_new_tokens, scorer, True, positions, copy_from)
              for t in tables]
    return store.measure_many("evaluation", lm.records_name, params,
                              lambda idx: _evaluate_each(lm, [tables[i] for i in idx], **kw), inputs=inputs,
                              device=str(lm.device))


def _evaluate_each(lm: Loaded, tables: list, *, n_prompts: int, n_wiki: int, max_new_tokens: int, scorer: str,
                   positions: str, prompts, per_batch: int, progress: bool, copy_from: Loaded | None) -> list[dict]:
    """:func:`evaluate_each`'s measurement itself (no records)."""
    chosen = evaluation_inputs(n_prompts, n_wiki, prompts)["challenge_prompts"]
    shared = positions == "last" and not hooks.hooked(lm) and (copy_from is None or not hooks.hooked(copy_from))
    prefix = _prefix(lm, chosen) if shared else None
    source_prefix = _prefix(copy_from, chosen) if shared and copy_from is not None else None
    out = []
    groups = list(hooks.batches(list(tables), per_batch))
    for group in repro.bar(groups, desc=f"{len(tables)} conditions, {per_batch} per batch", progress=progress):
        with (hooks.intervene_each(lm, group, positions=positions) if copy_from is None
              else hooks.copy_activations_each(copy_from, lm, group, positions, source_prefix=source_prefix)) as each_batch:
            gens = metrics.generate(lm, chosen, max_new_tokens, metrics.GENERATE_BATCH_SIZE, max_prompt_tokens=32,
                                    progress=False, prefix=prefix, copies=len(group), each_batch=each_batch)
        for g in gens:
            tox, name = metrics.toxicity(g.continuations, scorer)
            out.append({"toxicity": float(np.mean(tox)), "scorer": name, "n_prompts": len(chosen),
                        "toxicities": [float(t) for t in tox], "continuations": list(g.continuations)})
    return out


def dpo_lowered_toxicity(dpo_minus_base) -> verdict.Precondition:
    """The first precondition of 03, 05 and 06: DPO lowered toxicity, i.e. the upper end of the 95% interval of
    DPO - base (a :class:`lib.stats.Estimate` over prompts) lies below 0."""
    return verdict.require("DPO lowered toxicity: upper end of the 95% interval of DPO - base",
                           round(dpo_minus_base.high, 3), "<", 0)
