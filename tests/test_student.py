"""make student (lib.runner.student_copies): solutions removed, outputs cleared, checks kept; a student
copy runs up to its first exercise, and its first check fails until the student answers."""
import json

import nbformat
from nbclient import NotebookClient

from lib import paths, runner

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
    first_check = next(c for c in nb.cells[first:] if "check" in tags(c))
    nb.cells = nb.cells[:first + 1] + [first_check]
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(paths.NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0] in nb.cells[-1].outputs, [e.get("ename") for e in errors]
    assert errors[0].ename == "NameError"  # the check reads the student's answer, which is not there yet
