"""The numbered notebooks' index (config/notebooks.yaml): which notebook needs which, and how long each test job
takes; and what a notebook declares about itself (its parameters cell, read without running it).

Both workflows read the order from here, the Snakefile (`make reproduce`) and tests/Snakefile (`make test`), and
so does the site; no other module lists it.
"""
from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import yaml

from lib.infra import paths

INDEX = paths.ROOT / "config" / "notebooks.yaml"
NUMBERED = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")
DEFAULT_TEST_S = 100.0  # a test job the index does not time


@functools.lru_cache(maxsize=1)
def _index() -> dict:
    doc = yaml.safe_load(INDEX.read_text(encoding="utf-8")) or {}
    notebooks = {str(k): dict(v or {}) for k, v in (doc.get("notebooks") or {}).items()}
    bad = sorted(k for k in notebooks if not re.fullmatch(r"\d\d", k))
    if bad:
        raise ValueError(f"{INDEX.name}: notebook keys are two-digit numbers, got {bad}")
    for k, v in notebooks.items():
        for field in ("needs", "test_after"):
            missing = sorted(set(v.get(field, [])) - set(notebooks))
            if missing:
                raise ValueError(f"{INDEX.name}: notebook {k} {field} {missing}, which the index does not list")
    return {"notebooks": notebooks, "tests": dict(doc.get("tests") or {})}


def needs() -> dict[str, list[str]]:
    """number -> the numbers whose executed copy (and cached artifacts) it reuses, for the same model."""
    return {k: list(v["needs"]) for k, v in _index()["notebooks"].items() if v.get("needs")}


def test_after() -> dict[str, list[str]]:
    """number -> extra order for `make test` only (artifacts shared across models)."""
    return {k: list(v["test_after"]) for k, v in _index()["notebooks"].items() if v.get("test_after")}


def waits(names, tests: bool = False) -> dict[str, list[str]]:
    """{name: the names among ``names`` it waits for}: the index's ``needs`` (and, with ``tests``, ``test_after``,
    an order for `make test` only), restricted to ``names``. A notebook outside ``names`` is replaced by what it
    would itself wait for, so the order survives a selection (02 and 03 absent: 04 waits for 01). Names the index
    does not list (the pytest job 'tests') wait for nothing."""
    have = set(names)
    edges = needs()
    if tests:
        for k, v in test_after().items():
            edges[k] = edges.get(k, []) + v

    def deps(n, seen=()):
        out = set()
        for d in edges.get(n, []):
            if d in seen:
                raise ValueError(f"{INDEX.name}: notebooks wait for each other in a cycle: {' -> '.join((*seen, n, d))}")
            out |= {d} if d in have else deps(d, (*seen, n))
        return out

    return {n: sorted(deps(n)) for n in names}


def chain_seconds(graph: dict[str, list[str]], weights: dict[str, float] | None = None) -> dict[str, float]:
    """Each job's test seconds plus those of the heaviest chain of jobs that wait for it (its critical path in
    ``graph``, as :func:`waits` returns it): the priority with which `make test` starts the long chains first."""
    weights = test_seconds() if weights is None else weights
    after = {n: [m for m, ds in graph.items() if n in ds] for n in graph}
    memo: dict[str, float] = {}

    def rank(n, stack=()):
        if n in stack:
            raise ValueError(f"the jobs wait for each other in a cycle: {' -> '.join((*stack, n))}")
        if n not in memo:
            memo[n] = float(weights.get(n, DEFAULT_TEST_S)) + max((rank(m, (*stack, n)) for m in after[n]), default=0.0)
        return memo[n]

    return {n: rank(n) for n in graph}


def test_seconds() -> dict[str, int | float]:
    """job ("00".."14", "tests") -> its measured test time in seconds."""
    out = {k: v["test_s"] for k, v in _index()["notebooks"].items() if "test_s" in v}
    if "test_s" in _index()["tests"]:
        out["tests"] = _index()["tests"]["test_s"]
    return out


def neutral(number: str) -> list[str]:
    """The parameters of notebook ``number`` that choose how it runs, not what it computes (beyond every
    notebook's model_name, device and device_map)."""
    return list(_index()["notebooks"].get(str(number)[:2], {}).get("neutral", []))


def numbered_notebooks() -> list[Path]:
    return sorted(p for p in paths.NOTEBOOKS.glob("*.ipynb") if NUMBERED.match(p.name))


def params_file(model_name: str) -> Path | None:
    """params/<model>.yaml, where it exists."""
    p = paths.PARAMS / f"{paths.slug(model_name)}.yaml"
    return p if p.exists() else None


def params_settings(model_name: str) -> dict:
    """The parameters in params/<model>.yaml ({} when there is none)."""
    pf = params_file(model_name)
    return (yaml.safe_load(pf.read_text()) or {}) if pf else {}


def parameter_defaults(notebook: Path) -> dict:
    """The literal defaults of the notebook's ``parameters`` cell, read with ``ast`` (no papermill import: the
    Snakefile calls this for every notebook when it builds the DAG)."""
    doc = json.loads(Path(notebook).read_text(encoding="utf-8"))
    for cell in doc.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            out = {}
            for node in ast.parse(src).body:
                target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                    getattr(node, "target", None) if isinstance(node, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and node.value is not None:
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass  # not a literal: papermill would not override it either
            return out
    return {}


def default_model(notebook: Path) -> str:
    """The notebook's own default ``model_name`` (its parameters cell), read without running it."""
    name = parameter_defaults(notebook).get("model_name")
    if not name:
        raise ValueError(f"{Path(notebook).name} has no model_name parameter")
    return str(name)
