"""Paper C's facts: relations, their templates, the LRE and KLAR loaders, a user's file, the splits, test sets."""
from __future__ import annotations

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from lib import data
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
