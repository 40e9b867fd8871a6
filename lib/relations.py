"""Relation-specific neurons ("On Relation-Specific Neurons in Large Language Models", EMNLP 2025,
which builds on Kojima et al.'s expert-neuron code, apple/ml-selfcond). Intervals and tests: :mod:`lib.stats`.

One call, :func:`setup`, returns a :class:`Study`: the model, the selected relations and their
splits, every unit's AvgPrec and the cached test runs. Under the paper's protocol (the default,
:data:`PROTOCOLS`):

* facts come from LRE (:func:`lre_facts`), KLAR (:func:`klar_facts`) or a user JSONL file
  (:func:`read_facts`); prompts are zero-shot, the answer is 2 greedy tokens, correct when the
  shorter of continuation and gold object is a prefix of the other (:func:`matches`); :func:`answer` runs one batched prefill with
  last-position logits and KV-cached steps, and can record every unit's mean response on the way;
* units are the outputs of up, gate and down in every layer (:class:`lib.hooks.Units`); a unit's
  response to a prompt is its mean over the prompt's tokens;
* a relation is selected when the model answers at least ``min_correct`` identification prompts;
  those are its positives, with ``neg_ratio`` times as many negatives from the other relations;
* a unit's score is its average precision, ties broken by the standardised difference of mean
  responses (never by position); the top k (the paper's 3,000 of 835,584, as a fraction) are the
  relation's units; switching them off sets them to 0 at every position (:func:`lib.hooks.zero_units`);
* controls are random units of the same size drawn per site and layer (:func:`random_units`).

``protocol="ours"`` keeps the earlier variant (3-shot prompts, 4 tokens, the act(gate)*up site only,
k = 200 of 46,080, "starts with" as the rule). Every function works for any decoder
:class:`~lib.models.Loaded` (GPT-2, Llama, Gemma-2, Mistral).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from lib import data, hooks, metrics
from lib.infra import cache, repro, store
from lib.models import Loaded


# ----------------------------------------------------------------------------- facts, splits, prompts


@dataclass
class Relation:
    """One relation's facts split into few-shot demonstrations, identification and test facts."""
    name: str
    templates: list[str]  # '{}' is the subject; identification prompts cycle through these
    demos: list[dict] = field(default_factory=list)  # {subject, object}: the few-shot prefix
    ident: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)
    test_template: str | None = None  # the template of the test prompts (default: the first of templates)

    def prefix(self, template: str | None = None) -> str:
        """The few-shot prefix: one line '<template with subject> <object>.' per demonstration."""
        t = template or self.templates[0]
        return "".join(f"{t.format(d['subject'])} {d['object']}.\n" for d in self.demos)

    def prompt(self, subject: str, template: str | None = None) -> str:
        t = template or self.templates[0]
        return self.prefix(t) + t.format(subject)

    def ident_prompts(self) -> list[str]:
        """One prompt per identification fact, templates used in turn."""
        return [self.prompt(f["subject"], self.templates[i % len(self.templates)]) for i, f in enumerate(self.ident)]

    def test_prompts(self) -> list[str]:
        """One prompt per test fact, with the test template (the same for every condition)."""
        return [self.prompt(f["subject"], self.test_template) for f in self.test]


# ----------------------------------------------------------------------------- accuracy


def gold_first_token(lm: Loaded, gold: str, leading_space: bool = True) -> int:
    """Id of the first token of the gold object as it would follow the prompt (' ' + gold)."""
    ids = lm.tokenizer((" " if leading_space else "") + gold.strip(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"gold object {gold!r} has no tokens")
    return int(ids[0])


@dataclass
class TestSet:
    """All test prompts of several relations, evaluated together in one batched pass."""
    prompts: list[str]
    golds: list[str]
    relation: np.ndarray  # [n] relation name of each prompt

    @classmethod
    def of(cls, relations: dict[str, Relation], part: str = "test") -> "TestSet":
        prompts, golds, rel = [], [], []
        for name, r in relations.items():
            ps = r.test_prompts() if part == "test" else [r.prompt(f["subject"]) for f in r.ident]
            facts = r.test if part == "test" else r.ident
            prompts += ps
            golds += [f["object"] for f in facts]
            rel += [name] * len(ps)
        return cls(prompts, golds, np.asarray(rel))

    def only(self, names: Iterable[str] | str) -> "TestSet":
        """The prompts of the named relation(s) only, in the same order."""
        keep = np.isin(self.relation, [names] if isinstance(names, str) else list(names))
        return TestSet([p for p, m in zip(self.prompts, keep) if m], [g for g, m in zip(self.golds, keep) if m],
                       self.relation[keep])


# ----------------------------------------------------------------------------- neuron scores


# ----------------------------------------------------------------------------- overlaps and intervals


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
    sites: tuple[str, ...]  # lib.hooks.SITES: where a neuron lives
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
           units: "hooks.Units | None" = None, off=None, record: bool = False, batch_size: int = 64,
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
        raise ValueError("record and off need units (lib.hooks.Units.of(lm, sites))")
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
    off_ctx = hooks.zero_units(lm, units, off) if off is not None and len(off) else contextlib.nullcontext()
    rec = hooks.UnitRecorder(lm, units) if record else None
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
                     rule: str = "prefix", units: "hooks.Units | None" = None, off=None, batch_size: int = 64,
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
    rec = store.measure("relation-answers", store.owner(model_name), params, build, device=str(lm.model.device))
    return Answers(list(rec["continuation"]), np.asarray(rec["correct"], dtype=bool), np.asarray(rec["rank"]),
                   np.asarray(rec["logprob"], dtype=float))


# ----------------------------------------------------------------------------- facts


def _templates_ok(name: str, templates: Sequence[str]) -> list[str]:
    out = list(dict.fromkeys(t.strip() for t in templates if isinstance(t, str) and t.strip()))
    bad = [t for t in out if t.count("{}") != 1]
    if not out or bad:
        raise ValueError(f"relation {name!r}: every template needs exactly one '{{}}' for the subject, got {bad or templates!r}")
    return out


def lre_facts(names: Iterable[str] | str = "all") -> dict[str, dict]:
    """LRE relations as {name: {templates, samples, language}}: the zero-shot templates first, then the
    other LRE templates (each used without answered examples), duplicates dropped."""

    known = data.lre_relation_names()
    want = known if names == "all" else sorted(dict.fromkeys(names))
    unknown = sorted(set(want) - set(known))
    if unknown:
        raise ValueError(f"unknown LRE relations {unknown}: use 'all' or names from {', '.join(known)}")
    out = {}
    for name in want:
        r = data.lre_relation(name)
        out[name] = {"templates": _templates_ok(name, list(r.get("prompt_templates_zs", [])) + list(r["prompt_templates"])),
                     "samples": [{"subject": s["subject"], "object": s["object"]} for s in r["samples"]],
                     "language": "en", "source": "LRE (Hernandez et al. 2024)"}
    return out


def klar_facts(lang: str = "eng_Latn", names: Iterable[str] | None = None) -> dict[str, dict]:
    """KLAR facts of one language: the subject is the whole question (which ends with the language's
    'The answer is:'), the template '{}', and ``id`` the line index, so splits by id give the same
    facts in every language (KLAR files are line-aligned)."""

    df = data.klar(lang)
    rels = sorted(set(df["relation"]))
    want = rels if names is None else sorted(dict.fromkeys(names))
    unknown = sorted(set(want) - set(rels))
    if unknown:
        raise ValueError(f"unknown KLAR relations {unknown}: use names from {', '.join(rels)}")
    return {rel: {"templates": ["{}"], "language": lang, "source": "KLAR (Wang et al. 2025)",
                  "samples": [{"subject": q, "object": a, "id": int(i)}
                              for i, q, a in df[df["relation"] == rel][["index", "question", "answer"]].itertuples(index=False)]}
            for rel in want}


FACT_FIELDS = ("subject", "relation", "object")


def read_facts(path) -> dict[str, dict]:
    """A user's facts, one JSON object per line (format in data/README.md):
    ``{"subject": "Tokyo", "relation": "city_in_country", "object": "Japan",
    "templates": ["{} is a city in the country of", "{} is located in"], "language": "en"}``
    ('template' for a single one; 'id' optional). Templates and language are per relation: the lines of
    one relation must agree on the language, and their templates are pooled in order of appearance."""
    from pathlib import Path

    p = Path(path)
    out: dict[str, dict] = {}
    for no, row in data.user_jsonl(path, "facts", "Your own facts"):
        missing = [f for f in FACT_FIELDS if not isinstance(row.get(f), str) or not row[f].strip()]
        if missing:
            raise ValueError(f"{p.name} line {no}: needs non-empty text fields {', '.join(missing)}")
        temps = row.get("templates", [row["template"]] if "template" in row else None)
        if not isinstance(temps, list) or not temps:
            raise ValueError(f"{p.name} line {no}: needs 'templates' (a list) or 'template', each with one '{{}}'")
        bad = [t for t in temps if not isinstance(t, str) or t.count("{}") != 1]
        if bad:
            raise ValueError(f"{p.name} line {no}: every template needs exactly one '{{}}' for the subject, got {bad[0]!r}")
        rel = row["relation"].strip()
        lang = str(row.get("language", "en"))
        r = out.setdefault(rel, {"templates": [], "samples": [], "language": lang, "source": p.name})
        if r["language"] != lang:
            raise ValueError(f"{p.name} line {no}: relation {rel!r} mixes languages {r['language']!r} and {lang!r} "
                             "(give each language its own relation name)")
        r["templates"] = _templates_ok(rel, r["templates"] + temps)
        fact = {"subject": row["subject"].strip(), "object": row["object"].strip()}
        if "id" in row:
            fact["id"] = row["id"]
        r["samples"].append(fact)
    if not out:
        raise ValueError(f"{p.name} holds no facts")
    return out


def split_by_id(samples: Sequence[dict], n_test: int, n_demos: int, max_ident: int, seed: int) -> tuple[list, list, list]:
    """(demos, test, ident) of one relation: distinct subjects (or ids, where facts carry one) shuffled
    with ``seed``; the test facts are cut first, so they do not depend on ``max_ident``."""
    seen, unique = set(), []
    for f in samples:
        key = f.get("id", f["subject"])
        if key not in seen:
            seen.add(key)
            unique.append(dict(f))
    unique.sort(key=lambda f: (str(f.get("id", "")), f["subject"], f["object"]))
    random.Random(seed).shuffle(unique)
    demos, rest = unique[:n_demos], unique[n_demos:]
    return demos, rest[:n_test], rest[n_test:n_test + max_ident]


# ----------------------------------------------------------------------------- the study


TEMPLATE_MODES = ("shared", "held-out")


@dataclass(frozen=True)
class Sizes:
    """How much of the data a study uses; checks itself."""
    n_test: int = 50  # test facts per relation (the paper's 50); a relation with fewer is not screened
    min_correct: int = 30  # correctly answered identification prompts a relation needs to be studied
    max_ident: int = 300  # identification facts screened per relation (bounds the time)
    neg_ratio: int = 4  # negatives per positive in a relation's AvgPrec (the paper's 4x)
    k: int | None = None  # units per relation's top set; None: the protocol's fraction of all units
    templates: str = "shared"  # "shared": identify on every template; "held-out": not on the test template
    batch_size: int = 64
    max_prompt_tokens: int = 128

    def __post_init__(self):
        for name in ("n_test", "min_correct", "max_ident", "neg_ratio", "batch_size", "max_prompt_tokens"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.templates not in TEMPLATE_MODES:
            raise ValueError(f"templates must be one of {', '.join(TEMPLATE_MODES)}, got {self.templates!r}")
        if self.k is not None and (not isinstance(self.k, (int, np.integer)) or self.k <= 0):
            raise ValueError(f"k must be a positive integer or None, got {self.k!r}")


def _facts_from(facts, candidates) -> dict[str, dict]:
    if facts is None or (isinstance(facts, str) and facts in ("", "lre")):
        return lre_facts(candidates)
    pool = facts if isinstance(facts, dict) else read_facts(facts)
    if candidates == "all":
        return dict(sorted(pool.items()))
    unknown = sorted(set(candidates) - set(pool))
    if unknown:
        raise ValueError(f"unknown relations {unknown}: the facts hold {', '.join(sorted(pool))}")
    return {n: pool[n] for n in sorted(dict.fromkeys(candidates))}


@dataclass
class Study:
    """Everything notebooks 11-14 share for one model, protocol and fact set (built by :func:`setup`)."""
    lm: Loaded
    model_name: str
    protocol: Protocol
    sizes: Sizes
    seed: int
    units: "hooks.Units"
    k: int
    screen: pd.DataFrame  # one row per candidate relation: facts, templates, screened, correct, selected, reason
    relations: dict[str, Relation]  # the selected ones, sorted by name
    tests: TestSet  # every selected relation's test prompts (held-out template)
    ap: torch.Tensor  # [n_selected, units.size] AvgPrec of each unit for each relation
    tiebreak: torch.Tensor  # [n_selected, units.size] standardised difference of mean responses (pos - neg)
    ident_rows: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (positive rows, negative rows) of `pooled`
    pooled_rows: torch.Tensor | None  # `pooled` once known (None: the study came from its record; see `pooled`)
    row_relation: np.ndarray  # relation of each pooled row
    row_correct: np.ndarray  # was it answered correctly
    row_prompt: list[str]  # the prompt of each pooled row
    row_gold: list[str]  # its gold object
    fingerprint: str

    @property
    def names(self) -> list[str]:
        return list(self.relations)

    @property
    def pooled(self) -> torch.Tensor:
        """[rows used by some relation, units.size] each identification row's mean response of every unit
        (float16): kept from the identification pass that built the study, else (the study was read from its
        record, which keeps the scores, not these responses) measured again on these rows alone and cached
        (:mod:`lib.infra.cache`). Only new scorings need it (:meth:`ap_of`, :meth:`ap_many`, a new :meth:`rank_many`)."""
        if self.pooled_rows is None:
            def build():
                return answer(self.lm, self.row_prompt, self.row_gold, 1, self.protocol.rule, self.units, record=True,
                              batch_size=self.sizes.batch_size, max_prompt_tokens=self.sizes.max_prompt_tokens,
                              progress=repro.progress_on(), desc="responses of the identification rows").pooled
            self.pooled_rows = cache.get_or_build("relation-pooled", self.model_name, {"study": self.fingerprint}, build)
        return self.pooled_rows

    def top(self, name: str, k: int | None = None) -> np.ndarray:
        """Flat unit indices of ``name``'s top-k by AvgPrec, ties broken by the standardised difference
        of mean responses (then, only where both tie exactly, by index)."""
        j = self.names.index(name)
        return top_of(self.ap[j], self.tiebreak[j], self.k if k is None else k)

    def random_like(self, like, seed: int, exclude=None) -> np.ndarray:
        return random_units(self.units, like, seed, exclude)

    def run(self, off=None, only: Iterable[str] | str | None = None, use_cache: bool = True) -> pd.DataFrame:
        """Test answers with ``off`` (flat unit indices) set to 0: one row per test prompt (of the
        relations in ``only``, default all), with relation, item (index in ``tests``), continuation,
        correct, rank, logprob. A measurement record (:func:`measured_answers`); ``use_cache`` False: computed
        here and not kept."""
        t = self.tests if only is None else self.tests.only(only)
        items = np.flatnonzero(np.isin(self.tests.relation, list(t.relation)))
        off_list = [] if off is None else sorted(set(np.asarray(off, dtype=np.int64).reshape(-1).tolist()))
        p = self.protocol
        kw = dict(units=self.units, batch_size=self.sizes.batch_size, max_prompt_tokens=self.sizes.max_prompt_tokens)
        if use_cache:
            df = measured_answers(self.lm, self.model_name, t.prompts, t.golds, p.n_tokens, p.rule, off=off_list, **kw).frame()
        else:
            df = answer(self.lm, t.prompts, t.golds, p.n_tokens, p.rule, off=off_list or None, **kw).frame()
        df.insert(0, "item", items)
        df.insert(0, "relation", t.relation)
        return df

    def ap_of(self, positives: np.ndarray, negatives: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(AvgPrec, tie-break score) [units.size] of rows of ``pooled`` as positives vs negatives:
        the one scoring function, also for permuted labels or other negative sets."""
        return _score(self.pooled, positives, negatives)

    def ap_many(self, tasks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`score_many` on ``pooled``: many (positives, negatives) tasks over one shared sort."""
        return score_many(self.pooled, tasks)

    def rank_many(self, tasks: Sequence[tuple[np.ndarray, np.ndarray]], depth: int) -> np.ndarray:
        """[n_tasks, depth] the best ``depth`` units of each (positives, negatives) task, best first, in
        :meth:`top`'s order (AvgPrec, then the tie-break; :func:`top_of`): a measurement record (step
        'relation-ranking'), so the task's top-k for any k <= depth needs no scoring. The record keeps the
        rankings, not the scores: [n_tasks x units] scores would be megabytes per task."""
        if not isinstance(depth, (int, np.integer)) or not 0 < depth <= self.units.size:
            raise ValueError(f"depth must be in 1..{self.units.size}, got {depth!r}")
        tasks = [(np.asarray(p, dtype=np.int64), np.asarray(q, dtype=np.int64)) for p, q in tasks]
        params = {"study": self.fingerprint, "depth": int(depth),
                  "tasks": cache.content_hash([[p.tolist(), q.tolist()] for p, q in tasks])}

        def build():
            ap, tie = self.ap_many(tasks)
            return np.stack([top_of(a, t, int(depth)) for a, t in zip(ap, tie)]).astype(np.int32)
        return store.measure("relation-ranking", store.owner(self.model_name), params, build,
                             device=str(self.lm.model.device)).astype(np.int64)


def score_many(pooled: torch.Tensor, tasks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(AvgPrec, tie-break) [n_tasks, units] of rows of ``pooled`` for (positive rows, negative rows)
    tasks, with one sort of the rows shared by every task (a row outside a task is left out of it).
    The tie-break is the standardised difference of mean responses, positives minus negatives, over
    the task's rows. The one scoring function of paper C: identification, permuted labels, other
    negative sets."""
    if not len(tasks):
        raise ValueError("score_many needs at least one (positives, negatives) task")
    rows = np.unique(np.concatenate([np.r_[np.asarray(p), np.asarray(q)] for p, q in tasks]).astype(np.int64))
    at = np.full(int(rows.max()) + 1, -1)
    at[rows] = np.arange(len(rows))
    y = np.full((len(rows), len(tasks)), -1)
    for t, (p, q) in enumerate(tasks):
        if len(np.intersect1d(p, q)):
            raise ValueError(f"task {t}: a row is both positive and negative")
        y[at[np.asarray(q, dtype=np.int64)], t] = 0
        y[at[np.asarray(p, dtype=np.int64)], t] = 1
    x = pooled[torch.from_numpy(rows)].float()  # [n, units]
    ap = torch.from_numpy(metrics.average_precision(x, y, backend="torch")).float().reshape(len(tasks), -1)
    P, M = torch.from_numpy((y == 1).astype(np.float64)), torch.from_numpy((y >= 0).astype(np.float64))
    x64 = x.double()
    s_pos, s_all, ss_all = P.T @ x64, M.T @ x64, M.T @ (x64 * x64)  # [tasks, units]
    n_pos, n_all = P.sum(0)[:, None], M.sum(0)[:, None]
    var = ((ss_all - s_all ** 2 / n_all) / (n_all - 1)).clamp_min(0)
    tie = (s_pos / n_pos - (s_all - s_pos) / (n_all - n_pos)) / var.sqrt().clamp_min(1e-8)
    return ap, tie.float()


def _score(pooled: torch.Tensor, pos: np.ndarray, neg: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    ap, tie = score_many(pooled, [(pos, neg)])
    return ap[0], tie[0]


def top_of(ap: torch.Tensor, tie: torch.Tensor, k: int) -> np.ndarray:
    """Flat indices of the k best units by AvgPrec ``ap`` [units], ties broken by ``tie`` (then, only
    where both tie exactly, by index): the order of :meth:`Study.top`."""
    if not isinstance(k, (int, np.integer)) or not 0 < k <= ap.numel():
        raise ValueError(f"k must be in 1..{ap.numel()}, got {k!r}")
    return np.lexsort((np.arange(ap.numel()), -tie.double().numpy(), -ap.double().numpy()))[:k]


def random_units(units: "hooks.Units", like, seed: int, exclude=None) -> np.ndarray:
    """As many random units as ``like``, the same number in each (site, layer) block, none of
    ``exclude`` (default ``like``): the layer-matched control of 11, 12 and 14. Sorted."""
    like = np.asarray(like, dtype=np.int64).reshape(-1)
    banned = set((like if exclude is None else np.asarray(exclude, dtype=np.int64).reshape(-1)).tolist())
    rng = np.random.default_rng(seed)
    blocks = units.blocks()
    out = []
    for b, c in zip(*np.unique(units.stratum(like), return_counts=True)):
        site, L, off, w = blocks[int(b)]
        pool = np.setdiff1d(np.arange(off, off + w), list(banned))
        if len(pool) < c:
            raise ValueError(f"{site} layer {L} has {len(pool)} units outside the excluded set, {c} asked for")
        out.append(rng.choice(pool, size=int(c), replace=False))
    return np.sort(np.concatenate(out)) if out else like[:0]


def setup(model_name: str = "smollm2-135m", device: str = "auto", seed: int = 0, protocol: str = "paper",
          facts=None, relations: str | Sequence[str] = "all", lm: Loaded | None = None, progress: bool = True,
          **sizes) -> Study:
    """Paper C's one setup call: load the model, screen every candidate relation, select the ones the
    model knows, score every unit by AvgPrec, and return a :class:`Study` (cached by model, protocol,
    facts and sizes, so 11-14 share it).

    Per relation (distinct subjects, or ids, shuffled with ``seed``): ``n_test`` test facts and up to
    ``max_ident`` identification facts, disjoint. The identification facts are asked with every
    template in turn (one pass that also records every unit's mean response). The **test template**
    is the one the model answers best on them (so the test has accuracy to lose); the **positives**
    are the correctly answered identification prompts on the *other* templates (where a relation
    has one template, it is shared, and the screen table says so). A relation is selected when it
    has at least ``min_correct`` positives; ``neg_ratio`` times as many negatives are drawn from the
    other screened relations' identification prompts (answered right or wrong: a small model knows
    too few relations to fill 4x with right answers only).
    ``facts``: None (LRE), a dict from :func:`lre_facts` / :func:`klar_facts`, or a JSONL path
    (:func:`read_facts`). ``sizes``: fields of :class:`Sizes`."""
    from lib import models

    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: use one of {', '.join(PROTOCOLS)}")
    unknown = sorted(set(sizes) - set(Sizes.__dataclass_fields__))
    if unknown:
        import difflib

        names = list(Sizes.__dataclass_fields__)
        guess = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        raise ValueError("unknown setting(s) " + ", ".join(f"{k!r}" + (f" (did you mean {g[0]!r}?)" if g else "")
                                                           for k, g in guess.items())
                         + f": use fields of relations.Sizes ({', '.join(names)})")
    sz = Sizes(**sizes)
    p = PROTOCOLS[protocol]
    if isinstance(relations, str) and relations != "all":
        relations = [s.strip() for s in relations.split(",") if s.strip()]
    pool = _facts_from(facts, relations)
    if len(pool) < 2:
        raise ValueError(f"the facts or candidate_relations names {len(pool)} relation(s); AvgPrec needs at least two "
                         "(the others are the negatives)")
    lm = lm or models.load(model_name, device=device)
    if not lm.info.is_causal:
        raise ValueError(f"relation recall needs a decoder; {model_name} is an encoder")
    units = hooks.Units.of(lm, p.sites)
    k = sz.k if sz.k is not None else max(1, int(round(p.k_fraction * units.size)))
    if k > units.size:
        raise ValueError(f"k={k} exceeds the model's {units.size} units")

    screen, rels, ident = [], {}, []  # ident: (relation, fact, template, prompt)
    for name, r in pool.items():
        temps = r["templates"]
        demos, test, idf = split_by_id(r["samples"], sz.n_test, p.shots, sz.max_ident, seed)
        row = {"relation": name, "facts": len({f.get("id", f["subject"]) for f in r["samples"]}), "templates": len(temps),
               "test template": "", "test template held out": sz.templates == "held-out" and len(temps) > 1, "test facts": len(test),
               "identification facts screened": len(idf), "correct": 0, "positives": 0, "positives if held out": 0,
               "identification accuracy": float("nan"), "selected": False, "reason": ""}
        if len(test) < sz.n_test or len(idf) < sz.min_correct:
            row.update({"identification facts screened": 0,
                        "reason": f"too few facts ({row['facts']} < {sz.n_test} test + {sz.min_correct} identification)"})
            screen.append(row)
            continue
        rels[name] = Relation(name, list(temps), demos, idf, test)
        for j, f in enumerate(idf):
            t = temps[j % len(temps)]
            ident.append((name, f, t, rels[name].prompt(f["subject"], t)))
        screen.append(row)
    if not rels:
        raise ValueError(f"no relation has {sz.n_test} test facts plus {sz.min_correct} identification facts")

    params = {**_model_key(lm, model_name), "pipeline": 3, "protocol": p.name, "sizes": sorted(vars(sz).items()), "seed": seed,
              "facts": cache.content_hash([[n, r["templates"], r["samples"]] for n, r in pool.items()])}
    rel_of = np.array([x[0] for x in ident])
    temp_of = np.array([x[2] for x in ident], dtype=object)

    def test_template(correct: np.ndarray, name: str) -> str:
        """The template the model answers best on r's identification facts (first on ties), so the test
        has accuracy to lose; chosen on identification facts, never on test facts."""
        temps = rels[name].templates
        acc = [correct[(rel_of == name) & (temp_of == t)].mean() for t in temps]
        return temps[int(np.argmax(acc))]

    def positives(correct: np.ndarray, name: str, mode: str = sz.templates) -> np.ndarray:
        """Correctly answered identification prompts of r (with mode 'held-out': not on the test template)."""
        held = mode == "held-out" and len(rels[name].templates) > 1
        return np.flatnonzero((rel_of == name) & correct & ((temp_of != test_template(correct, name)) if held else True))

    def build():
        a = answer(lm, [x[3] for x in ident], [x[1]["object"] for x in ident], p.n_tokens, p.rule, units, record=True,
                   batch_size=sz.batch_size, max_prompt_tokens=sz.max_prompt_tokens, progress=progress,
                   desc="identification prompts")
        chosen = sorted(n for n in rels if len(positives(a.correct, n)) >= sz.min_correct)
        rng = np.random.default_rng(seed)
        rows = {}
        for n in chosen:
            pos = positives(a.correct, n)
            others = np.flatnonzero(rel_of != n)
            neg = np.sort(rng.choice(others, size=min(len(others), sz.neg_ratio * len(pos)), replace=False))
            rows[n] = (pos, neg)
        used = np.unique(np.concatenate([np.concatenate(v) for v in rows.values()])) if rows else np.zeros(0, int)
        remap = np.full(len(ident), -1)
        remap[used] = np.arange(len(used))
        pooled = a.pooled[torch.from_numpy(used)]
        rows = {n: (remap[pos], remap[neg]) for n, (pos, neg) in rows.items()}
        scores = [_score(pooled, *rows[n]) for n in chosen]
        z = torch.zeros(0, units.size)
        return {"correct": a.correct, "logprob": a.logprob, "chosen": chosen, "rows": rows, "pooled": pooled,
                "row_relation": rel_of[used], "row_correct": a.correct[used],
                "used": used,
                "ap": torch.stack([s[0] for s in scores]) if scores else z,
                "tiebreak": torch.stack([s[1] for s in scores]) if scores else z}
    kept = {}  # the responses of the identification rows, when this run measures them (the record leaves them out)

    def measured():
        out = build()
        kept["pooled"] = out.pop("pooled")
        return {**out, "k": k}
    built = store.measure("relation-study", store.owner(model_name), params, measured, device=str(lm.model.device))
    if "pooled" in kept:
        cache.atomic_save(kept["pooled"], cache.path("relation-pooled", model_name, {"study": cache.key(params)}, ".pt"))
    for row in screen:
        n = row["relation"]
        if n in rels:
            c, t = built["correct"], test_template(built["correct"], n)
            npos = len(positives(c, n))
            row.update({"correct": int(c[rel_of == n].sum()), "positives": npos,
                        "positives if held out": len(positives(c, n, "held-out")),
                        "identification accuracy": float(c[rel_of == n].mean()), "test template": t,
                        "selected": n in built["chosen"],
                        "reason": "" if n in built["chosen"] else f"{npos} positives < {sz.min_correct}"})
            rels[n].test_template = t
            if sz.templates == "held-out" and len(rels[n].templates) > 1:
                rels[n].templates = [x for x in rels[n].templates if x != t]  # identification templates only
    chosen = {n: rels[n] for n in built["chosen"]}
    tests = TestSet.of(chosen) if chosen else TestSet([], [], np.array([], dtype=str))
    return Study(lm, model_name, p, sz, seed, units, k, pd.DataFrame(screen).set_index("relation"), chosen, tests,
                 built["ap"], built["tiebreak"], built["rows"], kept.get("pooled"), built["row_relation"], built["row_correct"],
                 [ident[i][3] for i in built["used"]], [ident[i][1]["object"] for i in built["used"]],
                 cache.key(params))


def attribution(study: Study, name: str, batch_size: int = 16, progress: bool = False) -> torch.Tensor:
    """[units.size] first-order estimate of how much zeroing each unit *alone* lowers the gold object's
    first-token log-probability, averaged over r's positive identification prompts: the sum over the
    prompt's positions of a * d logp / d a (zeroing a changes logp by about -a * d logp / d a).
    Computed on identification prompts only, so the single neurons it picks are tested on facts it
    never saw. A measurement record (step 'relation-attribution', keyed by the study and ``name``)."""
    if name not in study.ident_rows:
        raise ValueError(f"{name!r} is not a selected relation: use one of {', '.join(study.names)}")
    return store.measure("relation-attribution", store.owner(study.model_name),
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
        recs = {p: hooks.UnitRecorder(lm, units) for p in parts}
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
    return build() if not use_cache else store.measure("relation-token-ap", store.owner(study.model_name), params, build,
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


# ----------------------------------------------------------------------------- records (lib.infra.store)
# What paper C measures, kept as committed records, and what the audit allows when it measures one again on
# another machine. A recomputed accuracy or mean log-probability may move by at most AUDIT_FRACTION of the
# committed value's 95% half-width: greedy answers on another CPU flip where two tokens nearly tie, which moves
# a mean by a few facts' worth, less than its own interval.
AUDIT_FRACTION = 1.0
# A top set measured again must share at least this share of its units with the committed one: AvgPrec over a
# few hundred prompts takes few distinct values, so units near the k-th tie on AvgPrec and are ordered by the
# tie-break, a float quantity that float noise in the responses reorders.
TOP_SHARED = 0.9
# Scores measured again (attributions, AvgPrec by tokens) must correlate with the committed ones at least this much.
MIN_R = 0.99


def _binomial_check(name: str, committed, fresh) -> "store.Check":
    c, f = np.asarray(committed, dtype=float), np.asarray(fresh, dtype=float)
    p, n = float(c.mean()) if c.size else float("nan"), c.size
    hw = 1.96 * np.sqrt(max(p * (1 - p), 1e-4) / max(n, 1))
    return store.within(name, p, float(f.mean()) if f.size else float("nan"), AUDIT_FRACTION * hw,
                        f"{AUDIT_FRACTION:g} x the binomial 95% half-width {hw:.3g} over {n} prompts")


def _shared_share(a, b) -> float:
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    return len(np.intersect1d(a, b)) / max(1, len(a))


def _compare_answers(c: dict, f: dict) -> list:
    """Answers: accuracy within its binomial half-width, mean gold log-probability within its half-width;
    the share of identical continuations, reported (the cross-CPU sensitivity of greedy decoding)."""
    out = [_binomial_check("accuracy", c["correct"], f["correct"])]
    if len(c["logprob"]) > 1:
        hw = store.half_width(c["logprob"])
        out.append(store.within("mean gold log-probability", float(np.mean(c["logprob"])), float(np.mean(f["logprob"])),
                                AUDIT_FRACTION * hw, f"{AUDIT_FRACTION:g} x the half-width {hw:.3g} of its 95% interval "
                                f"over {len(c['logprob'])} prompts"))
    same = float(np.mean([x == y for x, y in zip(c["continuation"], f["continuation"])])) if len(c["continuation"]) else 1.0
    out.append(store.info("identical continuations (share)", 1.0, same, "greedy decoding on this CPU against the committed one"))
    return out


def _compare_study(c: dict, f: dict) -> list:
    """A study: the same relations selected; identification accuracy within its binomial half-width; each
    relation's top-k sharing at least TOP_SHARED of its units with the committed one."""
    same = list(c["chosen"]) == list(f["chosen"])
    out = [store.Check("same relations selected", 1.0, float(same), "must be the same", same),
           _binomial_check("identification accuracy", c["correct"], f["correct"])]
    if same:
        for j, name in enumerate(c["chosen"]):
            share = _shared_share(top_of(c["ap"][j], c["tiebreak"][j], c["k"]), top_of(f["ap"][j], f["tiebreak"][j], f["k"]))
            out.append(store.at_least(f"top-{c['k']} of {name} shared (share)", share, TOP_SHARED,
                                      "near-ties at the k-th unit may swap"))
    return out


def _compare_ranking(c, f) -> list:
    """Rankings: the top-depth sets share at least TOP_SHARED of their units, on average over the tasks."""
    share = float(np.mean([_shared_share(a, b) for a, b in zip(c, f)]))
    return [store.at_least(f"top-{np.shape(c)[1]} shared, mean over {len(c)} tasks (share)", share, TOP_SHARED,
                           "near-ties at the last unit may swap")]


def _r_check(name: str, a, b) -> "store.Check":
    x, y = np.asarray(a, dtype=float).reshape(-1), np.asarray(b, dtype=float).reshape(-1)
    r = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float(np.array_equal(x, y))
    return store.at_least(f"correlation of {name}", r, MIN_R, "per-unit scores recomputed on this machine")


store.step("relation-answers", 1, "paper C: greedy answers to fact prompts, with or without units off: each prompt's "
           "continuation, right or wrong, the gold's rank and log-probability", _compare_answers)
store.step("relation-study", 1, "paper C's identification pass: answers to every identification prompt, the "
           "relations selected, their positive and negative rows, every unit's AvgPrec and tie-break", _compare_study)
store.step("relation-ranking", 1, "paper C: the best units of (positives, negatives) scoring tasks, in order",
           _compare_ranking)
store.step("relation-attribution", 1, "paper C: first-order attribution of each unit on a relation's positives",
           lambda c, f: [_r_check("attributions", c, f)])
store.step("relation-token-ap", 1, "paper C: every unit's AvgPrec with the responses pooled over part of the tokens",
           lambda c, f: [_r_check(f"AvgPrec ({part})", c[part][0], f[part][0]) for part in c])
