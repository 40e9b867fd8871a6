"""Paper C's study: the sizes, the selected relations, every unit's AvgPrec, the top units, matched random units, setup."""
from __future__ import annotations

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from lib import metrics, models
from lib.infra import cache, repro, store
from lib.models import Loaded
from lib.papers.relations.answers import PROTOCOLS, Protocol, _model_key, answer, measured_answers
from lib.papers.relations.facts import Relation, TestSet, lre_facts, read_facts, split_by_id
from lib.papers.relations.units import Units

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
    units: "Units"
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
        return store.measure("relation-ranking", self.model_name, params, build,
                             device=str(self.lm.model.device)).astype(np.int64)


def score_many(pooled: torch.Tensor, tasks: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(AvgPrec, tie-break) [n_tasks, units] of rows of ``pooled`` for (positive rows, negative rows)
    tasks, with one sort of the rows shared by every task (a row outside a task is left out of it).
    The tie-break is the standardised difference of mean responses, positives minus negatives, over
    the task's rows. The one scoring function of paper C: identification, permuted labels, other
    negative sets. A row listed several times in a task counts that many times (a bootstrap resample of
    the rows), exactly as if it were repeated."""
    if not len(tasks):
        raise ValueError("score_many needs at least one (positives, negatives) task")
    rows = np.unique(np.concatenate([np.r_[np.asarray(p), np.asarray(q)] for p, q in tasks]).astype(np.int64))
    at = np.full(int(rows.max()) + 1, -1)
    at[rows] = np.arange(len(rows))
    y = np.full((len(rows), len(tasks)), -1)
    w = np.zeros((len(rows), len(tasks)))  # how many times the task lists the row
    for t, (p, q) in enumerate(tasks):
        if len(np.intersect1d(p, q)):
            raise ValueError(f"task {t}: a row is both positive and negative")
        for lab, r in ((0, np.asarray(q, dtype=np.int64)), (1, np.asarray(p, dtype=np.int64))):
            y[at[r], t] = lab
            np.add.at(w[:, t], at[r], 1.0)
    x = pooled[torch.from_numpy(rows)].float()  # [n, units]
    repeated = bool((w > 1).any())
    ap = torch.from_numpy(metrics.average_precision(x, y, backend="torch", weights=w if repeated else None)).float().reshape(len(tasks), -1)
    P, M = torch.from_numpy((y == 1) * w), torch.from_numpy((y >= 0) * w)
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


def item_values(df: pd.DataFrame, relation: str, what: str) -> np.ndarray:
    """Column ``what`` of one relation's rows of a per-prompt frame (a test run's), in item order: the paired
    values of two runs on the same test prompts line up."""
    return df[df["relation"] == relation].sort_values("item")[what].to_numpy()


def random_units(units: "Units", like, seed: int, exclude=None) -> np.ndarray:
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
    units = Units.of(lm, p.sites)
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
    built = store.measure("relation-study", model_name, params, measured, device=str(lm.model.device))
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
