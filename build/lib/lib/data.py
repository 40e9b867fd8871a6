"""Loaders for the files in data/ (provenance and licences in data/README.md).

Each returns plain Python or pandas objects and raises FileNotFoundError naming the file and how
to rebuild it when something is missing.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd

from lib.infra.paths import DATA

GLUE_TASKS = ("SST-2", "CoLA", "RTE", "MRPC")
GLUE_SPLITS = ("train", "dev")


def _file(rel: str) -> Path:
    p = DATA / rel
    if not p.exists():
        raise FileNotFoundError(f"data file {p} is missing: restore it from git, or rebuild data/ with "
                                "`python data/make_data.py ../shared/datasets`")
    return p


def _take(items: list, n: int | None, seed: int | None = None) -> list:
    if n is None:
        return items
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive integer or None, got {n!r}")
    if seed is None:
        return items[:n]
    return random.Random(seed).sample(items, min(n, len(items)))


def _jsonl(rel: str) -> list[dict]:
    with open(_file(rel), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def user_jsonl(path, what: str, section: str) -> list[tuple[int, dict]]:
    """A user's JSONL file as (line number, object) pairs, blank lines skipped: the reader under
    ``relations.read_facts`` and ``dpo.read_prompts``, which check the fields. ``what`` names the file
    in errors ("facts", "prompts"), ``section`` the data/README.md section that documents its format.
    A line that is not UTF-8 text, not JSON or not an object is one error naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file {str(p)!r} not found (format: data/README.md, '{section}')")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        lines = (raw[:e.start].decode("utf-8") + "x").splitlines()  # the text before the bad byte, numbered as below
        col = len(lines[-1][:-1].encode("utf-8")) + 1
        raise ValueError(f"{p.name} line {len(lines)}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {col} of the "
                         "line); save the file as UTF-8") from None
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p.name} line {no}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{p.name} line {no}: expected a JSON object")
        rows.append((no, row))
    return rows


def challenge_prompts(n: int | None = None) -> list[str]:
    """The 1,199 RealToxicityPrompts 'challenging' prompts (Lee et al. 2024 order); the first n."""
    return _take([r["prompt"] for r in _jsonl("lee2024/challenge_prompts.jsonl")], n)


def wiki_samples(n: int | None = None, offset: int = 0) -> list[dict]:
    """Wikipedia {prompt, gold} pairs (Lee et al. 2024), rows offset..offset+n."""
    rows = _jsonl("lee2024/wiki_samples.jsonl")[offset:]
    return _take(rows, n)


def davidson_tweets() -> pd.DataFrame:
    """Balanced Davidson et al. (2017) tweets: columns row, class, toxic (1 = hate or offensive), tweet."""
    return pd.read_csv(_file("davidson/tweets_balanced.csv"))


def jigsaw_sample() -> pd.DataFrame:
    """267 Jigsaw Toxic Comment rows (original Kaggle columns; 'toxic' is 0/1)."""
    return pd.read_csv(_file("jigsaw/train.csv"))


def glue(task: str, split: str = "dev", n: int | None = None, seed: int = 0) -> pd.DataFrame:
    """A GLUE task as a DataFrame with columns text_a, text_b (None for single sentences), label (int).

    split 'train' is the 1,000-row sample in data/; 'dev' is the full GLUE dev set."""
    if task not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}: use one of {', '.join(GLUE_TASKS)}")
    if split not in GLUE_SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(GLUE_SPLITS)}")
    path = _file(f"glue/{task}/{'train_sample' if split == 'train' else 'dev'}.tsv")
    if task == "CoLA":
        raw = pd.read_csv(path, sep="\t", header=None, quoting=3, names=["src", "label", "mark", "sentence"])
        df = pd.DataFrame({"text_a": raw["sentence"], "text_b": None, "label": raw["label"].astype(int)})
    elif task == "SST-2":
        raw = pd.read_csv(path, sep="\t", quoting=3)
        df = pd.DataFrame({"text_a": raw["sentence"].str.strip(), "text_b": None, "label": raw["label"].astype(int)})
    elif task == "RTE":
        raw = pd.read_csv(path, sep="\t", quoting=3)
        df = pd.DataFrame({"text_a": raw["sentence1"], "text_b": raw["sentence2"],
                           "label": (raw["label"] == "entailment").astype(int)})
    else:
        raw = pd.read_csv(path, sep="\t", quoting=3, encoding="utf-8-sig")
        df = pd.DataFrame({"text_a": raw["#1 String"], "text_b": raw["#2 String"], "label": raw["Quality"].astype(int)})
    df = df.dropna(subset=["text_a"]).reset_index(drop=True)
    if n is not None:
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"n must be a positive integer or None, got {n!r}")
        df = df.sample(n=min(n, len(df)), random_state=seed).reset_index(drop=True)
    return df


def lre_relation_names() -> list[str]:
    return sorted(p.stem for p in (DATA / "lre").glob("*.json"))


def lre_relation(name: str) -> dict:
    """One LRE relation: name, prompt_templates, prompt_templates_zs, properties, samples [{subject, object}]."""
    names = lre_relation_names()
    if name not in names:
        raise ValueError(f"unknown LRE relation {name!r}: use one of {', '.join(names)}")
    return json.loads(_file(f"lre/{name}.json").read_text(encoding="utf-8"))


def klar_languages() -> list[str]:
    return sorted(p.stem for p in (DATA / "klar").glob("*_*.txt"))


def klar(lang: str = "eng_Latn") -> pd.DataFrame:
    """KLAR facts in one language: columns index, relation, question, answer (line-aligned across languages)."""
    langs = klar_languages()
    if lang not in langs:
        raise ValueError(f"unknown KLAR language {lang!r}: use one of {', '.join(langs)}")
    lines = _file(f"klar/{lang}.txt").read_text(encoding="utf-8").splitlines()
    rels = _file("klar/relations.txt").read_text(encoding="utf-8").splitlines()
    rows = []
    for i, (line, rel) in enumerate(zip(lines, rels)):
        # "<question> <answer marker>: <answer>": split at the last colon (fullwidth in CJK)
        cut = max(line.rfind(":"), line.rfind("："))
        rows.append({"index": i, "relation": rel, "question": line[:cut + 1].strip() if cut >= 0 else line,
                     "answer": line[cut + 1:].strip() if cut >= 0 else ""})
    return pd.DataFrame(rows)
