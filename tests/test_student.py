"""make student (lib.infra.runner.student_copies): solutions removed, outputs cleared, checks kept; no cell of a
student copy holds a solution's code; a student copy runs up to its first exercise, and its first check fails
until the student answers (the checks themselves: test_exercises.py)."""
import json

import pytest

import nbformat
from nbclient import NotebookClient

from lib.infra import paths, runner

TOUR = paths.NOTEBOOKS / "00_tour.ipynb"


def tags(cell) -> list:
    return cell.get("metadata", {}).get("tags", [])


def test_student_copies_drop_solutions_and_outputs_and_keep_checks(tmp_path):
    (copy,) = runner.student_copies([TOUR], tmp_path)
    full, student = json.loads(TOUR.read_text()), json.loads(copy.read_text())
    solutions = [c for c in full["cells"] if runner.SOLUTION_TAG in tags(c)]
    checks = [c for c in full["cells"] if "check" in tags(c)]
    assert solutions and checks
    assert len(student["cells"]) == len(full["cells"]) - len(solutions)
    assert not any(runner.SOLUTION_TAG in tags(c) for c in student["cells"])
    assert [c["source"] for c in student["cells"] if "check" in tags(c)] == [c["source"] for c in checks]
    assert all(not c["outputs"] and c["execution_count"] is None for c in student["cells"] if c["cell_type"] == "code")


def test_a_student_copy_runs_to_its_first_exercise_and_its_check_waits_for_an_answer(tmp_path):
    (copy,) = runner.student_copies([TOUR], tmp_path)
    nb = nbformat.read(copy, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "### Exercise" in c.source)
    first_check = next(i for i, c in enumerate(nb.cells) if i > first and "check" in tags(c))
    nb.cells = nb.cells[:first_check + 1]
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(paths.NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0] in nb.cells[-1].outputs, [e.get("ename") for e in errors]
    assert errors[0].ename == "NotImplementedError"  # the check calls the student's function, not written yet


def _code(cell) -> str:
    src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    return "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))


def _stored_and_loaded(code: str) -> tuple[set, set]:
    import ast

    tree = ast.parse(code)
    stored, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, (ast.Store, ast.Del)) else loaded).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                stored |= {x.arg for x in a.args + a.kwonlyargs + a.posonlyargs} | {x.arg for x in (a.vararg, a.kwarg) if x}
        elif isinstance(node, ast.Lambda):
            stored |= {x.arg for x in node.args.args}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            stored.add(node.name)
    return stored, loaded


NOTEBOOKS = sorted(paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_cells_after_an_exercise_read_only_what_it_asks_for(nb):
    """Every cell outside the solutions, checks included, reads only names the notebook defines outside its
    solutions, names an exercise asks the student to define (in backticks), or names it defines itself: a
    correct answer never fails a check, or a later cell, with a NameError for a helper variable that only the
    worked solution happened to use."""
    import builtins
    import re

    cells = json.loads(nb.read_text())["cells"]
    defined, asked, problems = set(dir(builtins)) | {"display", "get_ipython"}, set(), []
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown":
            text = "".join(c["source"])
            if "### Exercise" in text:
                defined |= asked  # the previous exercise's answers exist from here on
                asked = set()
            asked |= {m.group(1) for m in re.finditer(r"`([A-Za-z_][A-Za-z0-9_]*)", text)}
            continue
        if c["cell_type"] != "code" or runner.SOLUTION_TAG in tags(c):
            continue
        stored, loaded = _stored_and_loaded(_code(c))
        free = sorted(loaded - stored - defined - asked)
        if free:
            problems.append(f"cell {i}{' (check)' if 'check' in tags(c) else ''}: {', '.join(free)}")
        defined |= stored
    assert not problems, f"{nb.name}: cells read names no exercise asks for: {'; '.join(problems)}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_a_student_copy_with_its_solutions_pasted_in_is_the_tested_notebook(nb, tmp_path):
    """Pasting each solution back where it was removed gives the notebook that nbval executes, cell for cell:
    so every student copy passes its checks with the solutions pasted in exactly when make test passes."""
    (copy,) = runner.student_copies([nb], tmp_path)
    full, student = json.loads(nb.read_text())["cells"], json.loads(copy.read_text())["cells"]
    pasted = iter(student)
    rebuilt = [c if runner.SOLUTION_TAG in tags(c) else next(pasted) for c in full]
    assert next(pasted, None) is None
    key = lambda c: (c["cell_type"], "".join(c["source"]), tags(c))  # noqa: E731
    assert [key(c) for c in rebuilt] == [key(c) for c in full]
    assert any(runner.SOLUTION_TAG in tags(c) for c in full) == any("check" in tags(c) for c in full)


def _statements(code: str) -> set[str]:
    import ast

    return {ast.unparse(n) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.stmt)}


def _leaks(full: list, student: list) -> list[str]:
    """Where a cell of a student copy holds a statement of a worked solution's function bodies (beyond the
    shortest, such as ``return x``), or a check cell is more than one import and one call of a check."""
    import ast
    import re

    answers = set()
    for c in full:
        if c["cell_type"] == "code" and runner.SOLUTION_TAG in tags(c):
            for fn in ast.parse(_code(c)).body:
                if isinstance(fn, ast.FunctionDef):
                    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
                    answers |= {s for stmt in body for s in _statements(ast.unparse(stmt)) if len(s) >= 20}
    assert answers, "no worked solution"
    found = []
    for i, c in enumerate(student):
        if c["cell_type"] != "code":
            continue
        leaked = answers & _statements(_code(c))
        if leaked:
            found.append(f"cell {i}: {sorted(leaked)[:2]}")
        if "check" in tags(c):
            src = "\n".join(line for line in _code(c).splitlines() if not line.lstrip().startswith("#")).strip()
            if not re.fullmatch(r"from lib\.exercises\.ex\d\d import (check_\w+)\n\n\1\(\w+\)", src):
                found.append(f"cell {i}: a check cell that is not one check call")
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_cell_of_a_student_copy_holds_a_solution(nb, tmp_path):
    """Every statement of a worked solution's function bodies (beyond the shortest) is missing from every cell of
    the student copy, check cells included; a check cell of the copy is one import and one call of a check from
    lib/exercises, which holds the reference solution out of the student's view."""
    (copy,) = runner.student_copies([nb], tmp_path)
    full, student = json.loads(nb.read_text())["cells"], json.loads(copy.read_text())["cells"]
    assert not _leaks(full, student), f"{nb.name}: {_leaks(full, student)}"


def test_the_leak_test_finds_an_answer_pasted_into_a_check(tmp_path):
    """Planted: the tour's first worked solution pasted into its check cell, and an assert added to another."""
    (copy,) = runner.student_copies([TOUR], tmp_path)
    full, student = json.loads(TOUR.read_text())["cells"], json.loads(copy.read_text())["cells"]
    assert not _leaks(full, student)
    solution = next(c for c in full if runner.SOLUTION_TAG in tags(c) and c["cell_type"] == "code")
    checks = [c for c in student if "check" in tags(c)]
    checks[0]["source"] = _code(solution) + "\n" + _code(checks[0])
    checks[1]["source"] = _code(checks[1]) + "\nassert True"
    found = _leaks(full, student)
    assert len(found) == 3 and "not one check call" in found[-1], found
