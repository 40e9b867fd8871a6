"""Headline numbers of each notebook and the claims ledgers built from them.

A notebook decides each finding with :func:`lib.verdict.decide` and calls :func:`record` once per
finding. The record lands in ``results/<model>/<notebook>.json`` (git-ignored) when the run publishes
(``make reproduce``, :func:`lib.infra.paths.publishing`) at the published parameters; any other run (other
parameters, papermill or Jupyter by hand: :mod:`lib.infra.params`) writes to ``results/<model>/runs/<key>/``,
which gets a ledger of its own and never touches the published ones.

The published ledger of a model is ``results/<model>/claims.json`` (git-tracked, the source) and its
rendering ``claims.md``. :func:`write_claims` merges fresh records into it **by notebook**: a notebook
that ran replaces its own rows; every other row stays byte for byte. :func:`findings_table` is the table of
findings x models built from every model's claims.json: ``results/claims.md`` (:func:`merge_claims`), README.md's
findings (``python -m lib readme``) and the site's start page show it.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from pathlib import Path
from typing import Any

from lib.infra import index, paths
from lib.infra.cache import atomic_write_text
from lib.infra.params import Run

# The verdict words a ledger row may hold (lib.verdict decides which one a finding gets).
VERDICTS = ("holds", "partly holds", "does not hold", "inconclusive")

LEDGER = "claims.json"
# One token per Python process (a notebook's kernel): a record drops its notebook's findings written by an
# earlier execution, so a finding that a re-run renames or no longer records leaves no stale row.
_EXECUTION = uuid.uuid4().hex
COLUMNS = ("notebook", "finding", "paper", "estimate", "control", "preconditions", "n", "verdict", "reason", "ours",
           "detectable", "plot")


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


def record_dir(run: Run) -> Path:
    """Where the records of ``run`` (:func:`lib.infra.params.check`) go: the published folder, or the run's own."""
    if paths.outputs_dir() is not None:  # a test run (COMPENDIUM_OUTPUTS): its records never feed the ledgers
        d = paths.outputs_dir() / "results" / paths.slug(run.model_name)
        d = d if run.published else d / "runs" / run.key
    else:
        d = run.results_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def record(run: Run, verdict, ours: str = "", numbers: dict | None = None, params: dict | None = None) -> Path:
    """Add (or replace) one finding of the notebook that ``run`` checked (:func:`lib.nb.start`), for its model.
    Findings that an earlier execution of the notebook recorded are dropped (a re-run records all of its findings
    afresh).

    verdict: from :func:`lib.verdict.decide` (finding, paper, estimate, control, preconditions, n and
    reason come from it); ours: the measured numbers in words, as the notebook prints them.
    """
    if not isinstance(run, Run):
        raise TypeError(f"record() takes the notebook's run (run = nb.start(...)), got {type(run).__name__}")
    if not callable(getattr(verdict, "ledger", None)):
        raise TypeError(f"record() takes a lib.verdict.Verdict from verdict.decide(), got {type(verdict).__name__}")
    if verdict.verdict not in VERDICTS:
        raise ValueError(f"unknown verdict {verdict.verdict!r}: use one of {', '.join(VERDICTS)}")
    model_name, notebook = run.model_name, run.notebook
    folder = record_dir(run)
    path = folder / f"{notebook}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"notebook": notebook, "model": model_name, "findings": []}
    row = {**verdict.ledger(), "ours": ours}
    doc["findings"] = [f for f in doc["findings"]
                       if f["finding"] != row["finding"] and f.get("execution") == _EXECUTION]
    doc["findings"].append(_clean({**row, "numbers": numbers or {}, "params": params or {},
                                   "recorded": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                                   "execution": _EXECUTION}))
    atomic_write_text(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    if folder != paths.RESULTS / paths.slug(model_name):  # a run (or test) folder keeps its own ledger up to date
        _write_ledger(folder, model_name, _fresh_rows(folder))
    return path


def _fresh_rows(folder: Path) -> list[dict]:
    """Ledger rows from the per-notebook records in ``folder`` (not the published claims.json)."""
    rows = []
    for p in sorted(folder.glob("*.json")):
        if p.name == LEDGER:
            continue
        doc = json.loads(p.read_text())
        if "notebook" not in doc:
            continue
        for f in doc.get("findings", []):
            rows.append({c: f.get(c, "") for c in COLUMNS if c != "notebook"} | {"notebook": doc["notebook"]})
    return rows


def load_records(model_name: str) -> list[dict]:
    """Fresh per-notebook records of a model (results/<model>/*.json), in notebook order."""
    return _fresh_rows(paths.RESULTS / paths.slug(model_name))


def load_ledger(model_name: str) -> list[dict]:
    """The published rows of a model (results/<model>/claims.json); [] when it has none."""
    p = paths.RESULTS / paths.slug(model_name) / LEDGER
    return json.loads(p.read_text())["rows"] if p.exists() else []


def _cell(s: Any) -> str:
    return "" if s is None else str(s).replace("|", "\\|").replace("\n", " ")


def _render(model_name: str, rows: list[dict], published: bool) -> str:
    head = ["# Claims ledger: " + model_name, "",
            "Each row was measured by the notebook named; its verdict comes from `lib.verdict.decide` "
            "(criterion stated before the result, preconditions, interval, matched control).", ""]
    if not published:
        head[-1:] = ["", "This is the ledger of one run that did not publish (non-default parameters, or a run outside "
                     "`make reproduce`); it is not the published one.", ""]
    head[-1:] = ["", "*detectable*: the smallest effect the measurement would find with 80% power at the sizes it ran "
                 "(0.71 x the width of its 95% interval, `lib.stats.mde_from_width`), in the estimate's units.", ""]
    cols = ("notebook", "finding", "paper", "estimate [95% CI]", "detectable", "control", "preconditions", "n", "verdict",
            "reason")
    lines = head + ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["notebook"], r["finding"], r["paper"], r["estimate"], r.get("detectable", ""), r["control"], r["preconditions"],
                 r["n"], f"**{r['verdict']}**", r["reason"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if not rows:
        lines.append("| (no notebook has recorded a finding yet) |" + " |" * (len(cols) - 1))
    return "\n".join(lines) + "\n"


def _write_ledger(folder: Path, model_name: str, rows: list[dict], published: bool = False) -> Path:
    rows = sorted(rows, key=lambda r: r["notebook"])  # stable: record order within a notebook
    atomic_write_text(folder / LEDGER, json.dumps({"model": model_name, "rows": rows}, indent=1, ensure_ascii=False) + "\n")
    path = folder / "claims.md"
    atomic_write_text(path, _render(model_name, rows, published))
    return path


def write_claims(model_name: str, notebooks: list[str] | None = None) -> Path:
    """Merge the model's fresh records into its published ledger, notebook by notebook, and render
    results/<model>/claims.md. Rows of notebooks that did not run stay as they were. ``notebooks`` (numbers or
    stems): merge only their records (a subset run publishes only what it names)."""
    fresh = load_records(model_name)
    if notebooks is not None:
        keep = {str(n)[:2] for n in notebooks}
        fresh = [r for r in fresh if r["notebook"][:2] in keep]
    ran = {r["notebook"] for r in fresh}
    kept = [r for r in load_ledger(model_name) if r["notebook"] not in ran]
    return _write_ledger(paths.results_dir(model_name), model_name, kept + fresh, published=True)


def models_with_records() -> list[str]:
    """Folder names under results/ that hold a published ledger with at least one row."""
    if not paths.RESULTS.exists():
        return []
    return sorted(d.name for d in paths.RESULTS.iterdir() if d.is_dir() and load_ledger(d.name))


def default_models() -> list[str]:
    """The numbered notebooks' own default models (their parameters cells, read without running them), in
    notebook order and once each: smollm2-135m, then minilm-l6."""
    found = (index.parameter_defaults(nb).get("model_name") for nb in index.numbered_notebooks())
    return list(dict.fromkeys(paths.slug(str(m)) for m in found if m))


def findings_table(models: list[str] | None = None) -> str:
    """A markdown table of the published findings: one row per (notebook, finding), then the paper's effect as
    the ledger row states it, then one column per model holding "**verdict**: estimate [95% CI]" (the row's
    estimate text). ``models``: the columns, in order; default: :func:`default_models`, then every other model
    with a published ledger (:func:`models_with_records`), each only if it has a ledger. The finding label is
    the ledger's own (a row of a notebook that measures several models names its model there), never followed
    by the model's name. README.md (``python -m lib readme``), results/claims.md (:func:`merge_claims`)
    and the site's start page (docs/site/build.py) print this table."""
    if models is None:
        have = models_with_records()
        models = [m for m in dict.fromkeys(default_models() + have) if m in have]
    rows: dict[tuple[str, str], dict] = {}
    for m in models:
        for r in load_ledger(m):
            row = rows.setdefault((r["notebook"], r["finding"]), {"papers": [], "cells": {}})
            if r["paper"] not in row["papers"]:
                row["papers"].append(r["paper"])
            row["cells"][m] = f"**{_cell(r['verdict'])}**: {_cell(r['estimate'])}"
    lines = ["| " + " | ".join(["notebook", "finding", "paper"] + [_cell(m) for m in models]) + " |",
             "|---|---|---|" + "---|" * len(models)]
    for (nb, finding), row in sorted(rows.items(), key=lambda kv: kv[0][0]):  # stable: ledger order within a notebook
        cells = [_cell(nb), _cell(finding), _cell("; ".join(map(str, row["papers"])))]
        lines.append("| " + " | ".join(cells + [row["cells"].get(m, "") for m in models]) + " |")
    if not rows:
        lines.append("| (no notebook has recorded a finding yet) | | |" + " |" * len(models))
    return "\n".join(lines) + "\n"


def merge_claims(models: list[str] | None = None) -> Path:
    """results/claims.md: :func:`findings_table` under a heading. ``models`` gives the column order (default:
    the notebooks' own default models first, as `make reproduce` orders them); a model with a published
    ledger that is not named is appended, so no model's column is ever dropped."""
    have = models_with_records()
    models = [m for m in dict.fromkeys(list(models or default_models()) + have) if m in have]
    lines = ["# Claims across models", "",
             "Rows: the findings each notebook records; columns: the models it ran on "
             "(verdict: estimate [95% CI]). Built from results/<model>/claims.json by `python -m lib merge`;"
             " the reasons, controls and preconditions are in each model's claims.md.", ""]
    path = paths.RESULTS / "claims.md"
    atomic_write_text(path, "\n".join(lines) + "\n" + findings_table(models))
    return path
