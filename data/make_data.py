"""Rebuild data/ from the public files in ../shared/datasets (each with a SOURCE.md there).

Run once by a maintainer: `python data/make_data.py [SHARED_DATASETS_DIR]`. Copies what the
notebooks use, subsets the large files with a fixed seed (see data/README.md), and is idempotent.
"""
from __future__ import annotations

import csv
import json
import random
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = Path(sys.argv[1] if len(sys.argv) > 1 else HERE.parent.parent / "shared" / "datasets")
SEED = 0
GLUE_TRAIN_ROWS = 1000  # per task, sampled with SEED
KLAR_LANGS = ["eng_Latn", "fra_Latn", "spa_Latn", "cat_Latn", "tur_Latn", "rus_Cyrl", "zho_Hans", "jpn_Jpan"]


def copy(rel: str, dest: str) -> None:
    out = HERE / dest
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SRC / rel, out)


def davidson() -> None:
    """Balanced subset: every 'neither' tweet and as many toxic (hate or offensive) ones, sampled."""
    with open(SRC / "davidson-hate-offensive/labeled_data.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    neither = [r for r in rows if r["class"] == "2"]
    toxic = [r for r in rows if r["class"] in ("0", "1")]
    toxic = random.Random(SEED).sample(toxic, len(neither))
    out = HERE / "davidson/tweets_balanced.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["row", "class", "toxic", "tweet"])
        for r in sorted(neither + toxic, key=lambda r: int(r[""])):
            w.writerow([r[""], r["class"], int(r["class"] != "2"), r["tweet"]])
    copy("davidson-hate-offensive/LICENSE", "davidson/LICENSE")


def glue() -> None:
    for task in ["SST-2", "CoLA", "RTE", "MRPC"]:
        copy(f"glue/{task}/dev.tsv", f"glue/{task}/dev.tsv")
        lines = (SRC / f"glue/{task}/train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        header, body = ([], lines) if task == "CoLA" else (lines[:1], lines[1:])
        keep = sorted(random.Random(SEED).sample(range(len(body)), min(GLUE_TRAIN_ROWS, len(body))))
        (HERE / f"glue/{task}/train_sample.tsv").write_text("".join(header + [body[i] for i in keep]), encoding="utf-8")


def klar() -> None:
    """Selected languages' line-aligned facts, plus one relation label per line (from lang_rel_frequencies.json)."""
    freq = json.loads((SRC / "multilingual-factual/klar-variant/lang_rel_frequencies.json").read_text())
    labels = [rel for rel, facts in freq["en"].items() for _ in facts]  # same order as the .txt lines
    for lang in KLAR_LANGS:
        copy(f"multilingual-factual/klar-variant/{lang}.txt", f"klar/{lang}.txt")
    n = len((HERE / "klar/eng_Latn.txt").read_text(encoding="utf-8").splitlines())
    assert len(labels) == n, (len(labels), n)
    (HERE / "klar/relations.txt").write_text("\n".join(labels) + "\n", encoding="utf-8")


def main() -> None:
    if not SRC.is_dir():
        sys.exit(f"no datasets folder at {SRC}")
    for f in ["challenge_prompts.jsonl", "wiki_samples.jsonl"]:
        copy(f"lee2024-dpo-toxic-eval/{f}", f"lee2024/{f}")
    copy("jigsaw-toxic-sample/train.csv", "jigsaw/train.csv")
    davidson()
    glue()
    for p in sorted((SRC / "lre-relations/factual").glob("*.json")):
        copy(f"lre-relations/factual/{p.name}", f"lre/{p.name}")
    copy("lre-relations/LICENSE", "lre/LICENSE")
    klar()
    print("data/ rebuilt from", SRC)


if __name__ == "__main__":
    main()
