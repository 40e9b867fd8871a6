"""Headline numbers of each notebook and the claims ledger built from them.

A notebook calls :func:`record` once per finding; the JSON lands in results/<model>/<notebook>.json
(written atomically). :func:`write_claims` gathers a model's records into results/<model>/claims.md.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

from lib import paths
from lib.cache import atomic_write_text

VERDICTS = ("holds", "partly holds", "does not hold", "inconclusive")


def _clean(x: Any) -> Any:
    """JSON-safe plain values (numpy and torch scalars become floats; NaN becomes None)."""
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        x = x.item()
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, 6)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def record(model_name: str, notebook: str, finding: str, paper: str, ours: str, verdict: str,
           numbers: dict | None = None, params: dict | None = None) -> Path:
    """Add (or replace) one finding of ``notebook`` for ``model_name``.

    finding: the claim in a few words; paper: the paper's number(s) as text; ours: our measured
    number(s) as text; verdict: one of VERDICTS, decided from the measured numbers.
    """
    if verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict!r}: use one of {', '.join(VERDICTS)}")
    path = paths.results_dir(model_name) / f"{notebook}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"notebook": notebook, "model": model_name, "findings": []}
    doc["findings"] = [f for f in doc["findings"] if f["finding"] != finding]
    doc["findings"].append(_clean({"finding": finding, "paper": paper, "ours": ours, "verdict": verdict,
                                   "numbers": numbers or {}, "params": params or {},
                                   "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}))
    atomic_write_text(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return path


def load_records(model_name: str) -> list[dict]:
    folder = paths.RESULTS / paths.slug(model_name)
    rows = []
    for p in sorted(folder.glob("*.json")):
        doc = json.loads(p.read_text())
        for f in doc.get("findings", []):
            rows.append({"notebook": doc["notebook"], **f})
    return rows


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_claims(model_name: str) -> Path:
    """results/<model>/claims.md: finding, the paper's number, our number, verdict."""
    rows = load_records(model_name)
    lines = [f"# Claims ledger: {model_name}", "",
             "Each row was measured by the notebook named; the verdict is computed there from the numbers.", "",
             "| notebook | finding | paper | ours | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {_cell(r['notebook'])} | {_cell(r['finding'])} | {_cell(r['paper'])} | {_cell(r['ours'])} | "
              f"**{_cell(r['verdict'])}** |" for r in rows]
    if not rows:
        lines.append("| (no notebook has recorded a finding yet) | | | | |")
    path = paths.results_dir(model_name) / "claims.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def models_with_records() -> list[str]:
    """Folder names under results/ that hold at least one notebook's findings."""
    if not paths.RESULTS.exists():
        return []
    return sorted(d.name for d in paths.RESULTS.iterdir() if d.is_dir() and load_records(d.name))


def merge_claims(models: list[str] | None = None) -> Path:
    """results/claims.md: one row per finding (notebook, finding, the paper's number), one column per
    model holding its verdict and measured number; models in the given order (default: every model
    with records). A model that did not run a notebook shows an empty cell."""
    models = list(dict.fromkeys(models)) if models is not None else models_with_records()
    rows: dict[tuple[str, str], dict] = {}
    for m in models:
        for r in load_records(m):
            row = rows.setdefault((r["notebook"], r["finding"]), {"papers": [], "cells": {}})
            if r["paper"] not in row["papers"]:
                row["papers"].append(r["paper"])
            row["cells"][m] = f"**{_cell(r['verdict'])}**: {_cell(r['ours'])}"
    lines = ["# Claims across models", "",
             "Rows: the findings each notebook records; columns: the models it ran on "
             "(verdict: our number). Built from results/<model>/*.json by `python -m lib.runner merge`.", "",
             "| " + " | ".join(["notebook", "finding", "paper"] + [_cell(m) for m in models]) + " |",
             "|---|---|---|" + "---|" * len(models)]
    for (nb, finding), row in sorted(rows.items(), key=lambda kv: kv[0][0]):  # stable: record order within
        cells = [_cell(nb), _cell(finding), _cell("; ".join(map(str, row["papers"])))]
        lines.append("| " + " | ".join(cells + [row["cells"].get(m, "") for m in models]) + " |")
    if not rows:
        lines.append("| (no notebook has recorded a finding yet) | | |" + " |" * len(models))
    path = paths.RESULTS / "claims.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
