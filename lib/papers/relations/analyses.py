"""Paper C's analyses of relation units: first-order attribution (activation x gradient), AvgPrec by token part, KLAR test sets."""
from __future__ import annotations

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from lib import hooks
from lib.infra import cache, repro, store
from lib.papers.relations.facts import Relation, TestSet, gold_first_token, klar_facts
from lib.papers.relations.study import Study, _facts_from, _score
from lib.papers.relations.units import UnitRecorder

def attribution(study: Study, name: str, batch_size: int = 16, progress: bool = False) -> torch.Tensor:
    """[units.size] first-order estimate of how much zeroing each unit *alone* lowers the gold object's
    first-token log-probability, averaged over r's positive identification prompts: the sum over the
    prompt's positions of a * d logp / d a (zeroing a changes logp by about -a * d logp / d a).
    Computed on identification prompts only, so the single neurons it picks are tested on facts it
    never saw. A measurement record (step 'relation-attribution', keyed by the study and ``name``)."""
    if name not in study.ident_rows:
        raise ValueError(f"{name!r} is not a selected relation: use one of {', '.join(study.names)}")
    return store.measure("relation-attribution", study.model_name,
                         {"study": study.fingerprint, "relation": name},
                         lambda: _attribution(study, name, batch_size, progress), device=str(study.lm.model.device))


def _attribution(study: Study, name: str, batch_size: int, progress: bool) -> torch.Tensor:
    """:func:`attribution`'s measurement itself (no record)."""
    lm, units = study.lm, study.units
    rows = study.ident_rows[name][0]
    prompts = [study.row_prompt[i] for i in rows]
    targets = [gold_first_token(lm, study.row_gold[i]) for i in rows]
    total = torch.zeros(units.size, dtype=torch.float64)
    blocks = units.blocks()
    model = lm.model
    for chunk in repro.bar(list(hooks.batches(list(range(len(prompts))), batch_size)), desc="attribution", progress=progress):
        acts: list[torch.Tensor | None] = [None] * len(blocks)

        def keep(slot):
            def f(x):
                x.retain_grad()
                acts[slot] = x
            return f
        try:
            with hooks.points(lm, [(units.point(site, L), keep(slot)) for slot, (site, L, _, _) in enumerate(blocks)]):
                enc = hooks.encode(lm, [prompts[i] for i in chunk])
                with torch.enable_grad():
                    logits = model(**enc).logits[:, -1].float()
                    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor([targets[i] for i in chunk])[:, None])
                    lp.sum().backward()
            m = enc["attention_mask"].unsqueeze(-1).float()
            total += torch.cat([(a.detach() * a.grad * m).sum((0, 1)).double() for a in acts])
        finally:
            model.zero_grad(set_to_none=True)
    return (total / max(1, len(prompts))).float()


# ============================================================================ template check
# Added for notebook 11: AvgPrec with each identification prompt pooled over a part of its tokens.

TOKEN_PARTS = ("subject", "template", "all")


def _subject_span(prompt: str, templates: Sequence[str], shots: int) -> tuple[int, int, int] | None:
    """(query start, subject start, subject end) of ``prompt`` in characters, from the relation's
    templates (the longest matching template wins); None when none matches. With ``shots`` > 0 the
    query is the last line-set after the answered examples (they end in '.\\n')."""
    best = None
    for t in templates:
        pre, suf = t.split("{}")
        if not prompt.endswith(suf):
            continue
        body = prompt[:len(prompt) - len(suf)]
        if shots == 0:
            if not body.startswith(pre):
                continue
            q = 0
        else:
            q = body.rfind(pre) if pre else body.rfind("\n") + 1
            if q < 0:
                continue
        a, b = q + len(pre), len(body)
        if b <= a:
            continue
        if best is None or len(pre) + len(suf) > best[0]:
            best = (len(pre) + len(suf), q, a, b)
    return None if best is None else best[1:]


@torch.inference_mode()
def ap_by_tokens(study: "Study", name: str, parts: Sequence[str] = ("subject", "template"), facts=None,
                 batch_size: int | None = None, use_cache: bool = True, progress: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """AvgPrec of every unit for relation ``name`` with each identification prompt's response averaged
    over only some of its tokens: {part: (AvgPrec [units.size], tie-break [units.size])}, scored by
    :func:`_score` on exactly the positive and negative rows of ``study.ident_rows[name]``.

    parts: 'subject' (the tokens that overlap the subject's characters), 'template' (the other tokens
    of the query: the relation's words), 'all' (every token, as :func:`setup` pools: reproduces
    ``study.ap`` up to float16 rounding). A unit in r's top-k whose AvgPrec falls when only the subject
    counts responds to the template's words, not to the subject.
    facts: the ``facts`` given to :func:`setup` (None: LRE): the templates of every row's relation come
    from it, and the subject is the part of the prompt a template's '{}' covers (the longest matching
    template; with answered examples before the query, the last one). One forward pass per batch of
    prompts (last-position logits only), every part recorded at once; cached by the study and ``name``.
    Needs a fast tokenizer (offset mapping). A measurement record (step 'relation-token-ap'); ``use_cache``
    False: computed here and not kept."""
    parts = tuple(dict.fromkeys(parts))
    bad = [p for p in parts if p not in TOKEN_PARTS]
    if not parts or bad:
        raise ValueError(f"parts must be names from {', '.join(TOKEN_PARTS)}, got {list(parts) or parts!r}")
    if name not in study.ident_rows:
        raise ValueError(f"{name!r} is not a selected relation: use one of {', '.join(study.names)}")
    lm, units = study.lm, study.units
    tok = lm.tokenizer
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{study.model_name}'s tokenizer is not a fast tokenizer: no offset mapping to find the subject")
    pos, neg = study.ident_rows[name]
    rows = np.concatenate([pos, neg])
    prompts = [study.row_prompt[i] for i in rows]
    rel_of = [str(study.row_relation[i]) for i in rows]
    params = {"study": study.fingerprint, "relation": name, "parts": list(parts), "pipeline": 1,
              "prompts": cache.content_hash(prompts)}

    def build():
        pool = _facts_from(facts, sorted(set(rel_of)))
        masks = {p: [] for p in parts}
        ids = []
        for prompt, rel in zip(prompts, rel_of):
            span = _subject_span(prompt, pool[rel]["templates"], study.protocol.shots)
            if span is None:
                raise ValueError(f"no template of {rel!r} matches the identification prompt {prompt!r}: "
                                 "pass the facts given to setup (facts=...)")
            q, a, b = span
            enc = tok(prompt, add_special_tokens=True, return_offsets_mapping=True)
            ids.append(enc["input_ids"])
            off = enc["offset_mapping"]
            subj = [int(e > s and e > a and s < b) for s, e in off]
            query = [int(e > s and e > q) for s, e in off]
            m = {"subject": subj, "template": [int(qq and not ss) for qq, ss in zip(query, subj)],
                 "all": [1] * len(off)}
            for p in parts:
                masks[p].append(m[p])
        n = len(ids)
        order = sorted(range(n), key=lambda i: (len(ids[i]), i))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        recs = {p: UnitRecorder(lm, units) for p in parts}
        import contextlib
        import inspect
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(lm.model.forward).parameters else {}
        dev = lm.model.device
        chunks = list(hooks.batches(order, batch_size or study.sizes.batch_size))
        with contextlib.ExitStack() as stack:
            for r in recs.values():
                stack.enter_context(r)
            for chunk in repro.bar(chunks, total=len(chunks), desc=f"pooling by tokens: {name}", progress=progress):
                width = max(len(ids[i]) for i in chunk)
                input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk], device=dev)
                attn = torch.tensor([[0] * (width - len(ids[i])) + [1] * len(ids[i]) for i in chunk], device=dev)
                for p, r in recs.items():
                    r.mask = torch.tensor([[0] * (width - len(ids[i])) + masks[p][i] for i in chunk], device=dev)
                    r.begin()
                lm.model(input_ids=input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0),
                         use_cache=False, **keep)
                for r in recs.values():
                    r.end()
        inv = np.empty(n, dtype=int)
        inv[np.asarray(order, dtype=int)] = np.arange(n)
        out = {}
        for p, r in recs.items():
            pooled = r.result()[torch.from_numpy(inv)]  # [n rows, units.size], in the order of `rows`
            out[p] = _score(pooled, np.arange(len(pos)), np.arange(len(pos), n))
        return out
    return build() if not use_cache else store.measure("relation-token-ap", study.model_name, params, build,
                                                       device=str(lm.model.device))
# ============================================================================ end of the template check


# ============================================================================= KLAR: the same test facts in another language (notebook 13)


def klar_aligned_tests(study: Study, lang: str) -> TestSet:
    """The test prompts of a KLAR ``study`` (built with ``facts=klar_facts(...)``) asked in ``lang``:
    for each selected relation the same test facts, matched by KLAR line id, in the same order as
    ``study.tests`` (so outcomes pair item by item), with the study's test template and its
    demonstrations (also matched by id). Raises where ``lang`` lacks a fact's line."""
    pool = klar_facts(lang, study.names) if study.names else {}
    out = {}
    for name, r in study.relations.items():
        by_id = {f["id"]: f for f in pool[name]["samples"]}
        missing = [f["id"] for f in r.demos + r.test if f.get("id") not in by_id]
        if missing:
            raise ValueError(f"{lang} has no KLAR line for {len(missing)} of {name}'s facts (ids {missing[:5]})")
        out[name] = Relation(name, list(r.templates), [by_id[f["id"]] for f in r.demos], [],
                             [by_id[f["id"]] for f in r.test], r.test_template)
    return TestSet.of(out) if out else TestSet([], [], np.array([], dtype=str))
