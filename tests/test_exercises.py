"""The notebooks' exercises (lib/exercises/): each asks for a function with a docstring, its check compares a
student's function with the reference solution on small inputs, accepts the notebook's worked solution and
rejects a wrong function (planted: the reference's result, perturbed). No model is loaded: the solution cells
only define functions, so they run here without the notebook's data."""
import ast
import contextlib
import dataclasses
import importlib
import io
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from lib import exercises
from lib.infra import paths, runner

NOTEBOOKS = sorted(paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CHECK_CALL = re.compile(r"^from lib\.exercises\.ex(\d\d) import (check_\w+)\n\n(check_\w+)\((\w+)\)$")


def tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def without_comments(src: str) -> str:
    return "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("#")).strip()


def exercises_of(nb) -> list[dict]:
    """Each exercise's cells: its markdown, the student's cell, the solution, the check and the cell that uses
    the function, in this order (reading notes tagged ``solution`` may follow)."""
    cells = json.loads(nb.read_text())["cells"]
    found = []
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown" and "### Exercise" in source(c):
            stub, sol, check, use = cells[i + 1:i + 5]
            found.append({"md": source(c), "stub": stub, "solution": sol, "check": check, "use": use, "index": i})
    return found


def functions(src: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}


def body_without_docstring(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def check_name(ex: dict) -> tuple[str, str]:
    """(module, function name) of the exercise's check cell."""
    m = CHECK_CALL.match(without_comments(source(ex["check"])))
    assert m, f"the check cell is not one check call:\n{source(ex['check'])}"
    nn, check, called, name = m.groups()
    assert check == called == f"check_{name}", source(ex["check"])
    return f"lib.exercises.ex{nn}", name


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_every_exercise_asks_for_a_function_with_a_docstring(nb):
    exs = exercises_of(nb)
    assert exs, f"{nb.name} has no exercises"
    for k, ex in enumerate(exs, 1):
        where = f"{nb.name}, exercise {k}"
        module, name = check_name(ex)
        assert module == f"lib.exercises.ex{nb.name[:2]}", where
        assert f"`{name}`" in ex["md"], f"{where}: the exercise does not name `{name}`"
        # the student's cell: the signature and the docstring, a body to write
        assert not tags(ex["stub"]) and ex["stub"]["cell_type"] == "code", where
        stub = functions(source(ex["stub"]))
        assert list(stub) == [name], f"{where}: the student's cell defines {list(stub)}"
        assert ast.get_docstring(stub[name]), f"{where}: no docstring"
        (raise_,) = body_without_docstring(stub[name])
        assert isinstance(raise_, ast.Raise) and "NotImplementedError" in ast.unparse(raise_), where
        # the solution: imports and function definitions only, the asked one with the same signature and docstring
        assert runner.SOLUTION_TAG in tags(ex["solution"]), where
        tree = ast.parse(source(ex["solution"]))
        assert all(isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef)) for n in tree.body), \
            f"{where}: the solution cell does more than define functions"
        sol = functions(source(ex["solution"]))[name]
        assert ast.get_docstring(sol) == ast.get_docstring(stub[name]), f"{where}: the docstrings differ"
        assert ast.unparse(sol.args) == ast.unparse(stub[name].args) and ast.unparse(sol.returns or ast.Constant(None)) \
            == ast.unparse(stub[name].returns or ast.Constant(None)), f"{where}: the signatures differ"
        assert "check" in tags(ex["check"]), where
        # the cell after the check runs the function on the notebook's data
        used = {n.func.id for n in ast.walk(ast.parse(source(ex["use"]))) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert name in used and not {runner.SOLUTION_TAG, "check"} & set(tags(ex["use"])), f"{where}: the next cell does not call {name}"


@pytest.fixture(scope="module")
def namespaces():
    """Per notebook, the names the import statements of its set-up cells define (the solutions' annotations and
    bodies read them); nothing else of those cells runs."""
    out = {}
    for nb in NOTEBOOKS:
        ns = {}
        for c in json.loads(nb.read_text())["cells"][:5]:
            if c["cell_type"] == "code" and not source(c).lstrip().startswith("# On Colab"):
                imports = [n for n in ast.parse(source(c)).body if isinstance(n, (ast.Import, ast.ImportFrom))]
                exec(compile(ast.Module(imports, []), nb.name, "exec"), ns)
        out[nb.name] = ns
    return out


def perturbed(x):
    """``x`` made wrong: every number moved by one, every flag flipped (what a wrong answer returns)."""
    if isinstance(x, torch.Tensor):
        return ~x if x.dtype == torch.bool else x + 1
    if isinstance(x, np.ndarray):
        return ~x if x.dtype == bool else x + 1
    if isinstance(x, pd.DataFrame):
        num = x.select_dtypes("number").columns
        return x.assign(**{c: x[c] + 1 for c in num}) if len(num) else x.iloc[::-1]
    if isinstance(x, pd.Series):
        return x + 1
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: perturbed(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if isinstance(getattr(x, f.name), (int, float))})
    if isinstance(x, dict):
        return {k: perturbed(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(perturbed(v) for v in x) if x else [0]
    if isinstance(x, (bool, np.bool_)):
        return not x
    if isinstance(x, (int, float, np.integer, np.floating)):
        return x + 1
    if isinstance(x, str):
        return x + "?"
    return 0 if x is None else None


def run_check(check, fn) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check(fn)
    return out.getvalue()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_each_check_accepts_the_solution_and_rejects_a_wrong_function(nb, namespaces):
    for k, ex in enumerate(exercises_of(nb), 1):
        module_name, name = check_name(ex)
        module = importlib.import_module(module_name)
        check, reference = getattr(module, f"check_{name}"), getattr(module, name)
        ns = dict(namespaces[nb.name])
        exec(compile(source(ex["solution"]), f"{nb.name} solution {k}", "exec"), ns)
        assert exercises.PASSED in run_check(check, ns[name]), f"{nb.name}, exercise {k}"
        assert exercises.PASSED in run_check(check, reference)

        def wrong(*args, **kwargs):
            return perturbed(reference(*args, **kwargs))

        with pytest.raises(AssertionError):
            run_check(check, wrong)
        ns_stub = dict(namespaces[nb.name])
        exec(compile(source(ex["stub"]), f"{nb.name} exercise {k}", "exec"), ns_stub)
        with pytest.raises(NotImplementedError):
            run_check(check, ns_stub[name])


def test_every_check_has_an_exercise():
    """No check in lib/exercises without the exercise that calls it."""
    used = {check_name(ex) for nb in NOTEBOOKS for ex in exercises_of(nb)}
    for path in sorted((paths.ROOT / "lib" / "exercises").glob("ex[0-9][0-9].py")):
        module = importlib.import_module(f"lib.exercises.{path.stem}")
        checks = {n[len("check_"):] for n in dir(module) if n.startswith("check_")}
        assert {(module.__name__, c) for c in checks} <= used, sorted(checks)


def test_assert_same_compares_what_the_checks_return():
    same = exercises.assert_same
    same({"a": [1, (2.0, torch.ones(2))]}, {"a": [1, (2.0 + 1e-9, torch.ones(2))]})
    same(pd.DataFrame({"x": [1.0, np.nan]}), pd.DataFrame({"x": [1.0, np.nan]}))
    for got, want in [(torch.ones(2), torch.zeros(2)), ([1, 2], [1, 2, 3]), ({"a": 1}, {"b": 1}), (1.0, float("nan")),
                      (np.arange(3), np.arange(3) + 1), (pd.DataFrame({"x": [1]}), pd.DataFrame({"x": [2]})), (True, 1)]:
        with pytest.raises(AssertionError):
            same(got, want)
