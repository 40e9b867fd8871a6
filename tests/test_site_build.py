"""docs/site/build.py without Jupyter Book or a browser: the notebook copies, the contents, the forest plot."""
import importlib.util
import json

import nbformat
import pytest

from lib.infra import index, paths


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("site_build", paths.ROOT / "docs" / "site" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(notebook, verdict="holds", value=0.3, threshold=0.1, direction="greater", edge=0.05):
    return {"notebook": notebook, "model": "tiny", "finding": f"finding of {notebook}", "verdict": verdict,
            "estimate": f"{value} [0.2, 0.4]", "plot": {"value": value, "low": 0.2, "high": 0.4, "threshold": threshold,
                                                     "direction": direction, "paper_effect": None, "control_edge": edge}}


def test_notebook_copy_drops_stderr_and_folds_validation_inputs(build, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 99 · A title"),
                nbformat.v4.new_code_cell("run = params.check(globals(), 'x')"),
                nbformat.v4.new_code_cell("# checks\nassert 1 == 1\nassert 2 > 1"),
                nbformat.v4.new_code_cell("x = 1\nassert x == 1"),
                nbformat.v4.new_code_cell("print('hi')")]
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stderr", text="bar 50%"),
                           nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    src, dst = tmp_path / "a.ipynb", tmp_path / "b.ipynb"
    nbformat.write(nb, src)
    assert build.prepare_notebook(src, dst) == {"stderr dropped": 1, "inputs folded": 2}
    out = nbformat.read(dst, as_version=4)
    tags = [c.metadata.get("tags", []) for c in out.cells]
    assert "hide-input" in tags[1] and "hide-input" in tags[2] and not tags[3] and not tags[4]
    assert [o["name"] for o in out.cells[4].outputs] == ["stdout"]
    assert build._title(src) == "99 · A title"


def test_forest_draws_rows_with_numbers_and_counts_the_rest(build, tmp_path):
    rows = [_row("01_a"), _row("02_b", "does not hold", value=-0.2, threshold=0.25, direction="less"),
            {**_row("03_c", "inconclusive"), "plot": ""},  # a ledger row recorded before the plot numbers existed
            {**_row("04_d", "inconclusive"), "plot": {**_row("04_d")["plot"], "value": None}}]  # no estimate
    assert build.forest(rows, tmp_path / "forest") == (2, 2)
    assert (tmp_path / "forest.png").stat().st_size > 0 and "<svg" in (tmp_path / "forest.svg").read_text()


def test_contents_lists_the_findings_table_and_run_times(build, tmp_path, monkeypatch):
    """The start page's findings are lib.infra.results.findings_table (the README's table), not a table of its own."""
    from lib.infra import results

    nbs = []
    for stem, title in (("00_tour", "00 · Tour"), ("07_entropy", "07 · Entropy")):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\ntext")]
        nbformat.write(nb, tmp_path / f"{stem}.ipynb")
        nbs.append(tmp_path / f"{stem}.ipynb")
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    (tmp_path / "results" / "tiny").mkdir(parents=True)
    row = {**_row("07_entropy", "partly holds"), "finding": "entropy falls (tiny)", "paper": "no numbers"}
    (tmp_path / "results" / "tiny" / "claims.json").write_text(json.dumps({"model": "tiny", "rows": [row]}))
    page = build.contents(nbs)
    assert results.findings_table() in page and "| entropy falls (tiny) | no numbers | **partly holds**: 0.3" in page
    assert "(tiny) (tiny)" not in page  # the label is the ledger's, the model is a column
    assert "[07 · Entropy](notebooks/07_entropy.ipynb)" in page and f"| {int(index.test_seconds()['07'])} |" in page
    assert "## Paper B" in page and "## Paper A" not in page
    toc = build.toc(nbs)
    assert "file: notebooks/00_tour" in toc and "file: notebooks/07_entropy" in toc and "root: index" in toc


def test_the_start_page_shows_the_readme_findings_table(build):
    """With the committed ledgers: the start page, README.md and lib.infra.results.findings_table show one table."""
    from lib.infra import results, runner

    table = results.findings_table()
    assert table in build.contents(index.numbered_notebooks())
    assert runner.readme_findings((paths.ROOT / "README.md").read_text(encoding="utf-8")) == table


def test_published_ledgers_feed_the_site(build):
    rows = build.ledger_rows()
    assert rows and all({"notebook", "model", "verdict", "finding"} <= set(r) for r in rows)
    assert [r["notebook"] for r in rows] == sorted(r["notebook"] for r in rows)
    assert json.loads((paths.RESULTS / "smollm2-135m" / "claims.json").read_text())["model"] == "smollm2-135m"
