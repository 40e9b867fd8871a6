import json
import re

import pytest
import torch

from lib import plotting, stats, verdict
from lib.infra import cache, paths, results
from lib.infra.params import Run


@pytest.fixture
def tmp_project(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(paths, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    monkeypatch.delenv(paths.OUTPUTS_ENV, raising=False)  # these tests write the published folders (of tmp_path)
    monkeypatch.setenv(paths.PUBLISH_ENV, "1")
    return tmp_path


def _verdict(finding="a finding", value=0.4):
    c = verdict.Criterion(finding=finding, paper="0.5", effect="drop", threshold=0.1, control="random-k")
    return verdict.decide(c, stats.Estimate(value, value - 0.1, value + 0.1, 20),
                          controls=stats.against_controls(value, [0.001 * i for i in range(19)]))


def test_record_and_claims(tmp_project):
    results.record(Run("01_demo", "m/x"), _verdict(value=0.4), "0.4", numbers={"x": torch.tensor(0.4)})
    results.record(Run("01_demo", "m/x"), _verdict(value=0.45), "0.45")  # replaced, not duplicated
    doc = json.loads((tmp_project / "results" / "m--x" / "01_demo.json").read_text())
    assert len(doc["findings"]) == 1 and doc["findings"][0]["ours"] == "0.45"
    text = results.write_claims("m/x").read_text()
    detectable = f"{stats.mde_from_width(0.2):.2g}"  # the interval [0.35, 0.55]: 0.71 x its width
    assert f"| 01_demo | a finding | 0.5 | 0.45 [0.35, 0.55] (drop) | {detectable} |" in text and "**holds**" in text
    assert detectable == "0.14"
    with pytest.raises(TypeError, match="Verdict"):
        results.record(Run("01", "m"), "holds")
    with pytest.raises(TypeError, match="the notebook's run"):  # where a record goes is the run's, never guessed
        results.record("m", _verdict(value=0.4), "0.4")


def test_detectable_effect_from_an_interval_or_none():
    e = stats.Estimate(0.3, -0.2, 0.6, 30)
    assert abs(stats.mde_from_width(e.width) - stats.mde_from_interval(e)) < 1e-12
    assert abs(stats.mde_from_width(1.0) - (1.959964 + 0.841621) / (2 * 1.959964)) < 1e-5  # 0.71 x the width
    crit = verdict.Criterion(finding="f", paper="p", effect="e", threshold=0.1, control="c")
    assert verdict.decide(crit, e).ledger()["detectable"] == f"{stats.mde_from_width(0.8):.2g}"
    assert verdict.decide(crit, None).ledger()["detectable"] == ""
    with pytest.raises(ValueError, match="level and power"):
        stats.mde_from_width(1.0, level=1.5)


def test_a_subset_run_changes_only_its_own_rows(tmp_project):
    for nb in ("01_a", "02_b", "03_c"):
        results.record(Run(nb, "m"), _verdict(finding=f"finding {nb}"), "x")
    results.record(Run("01_a", "other"), _verdict(finding="finding 01_a"), "y")
    results.write_claims("m")
    results.write_claims("other")
    results.merge_claims(["m", "other"])
    before = (tmp_project / "results" / "m" / "claims.md").read_text().splitlines()
    merged_before = (tmp_project / "results" / "claims.md").read_text().splitlines()
    # a fresh clone: only the published ledgers are there; notebook 02 runs again with a new result
    for p in (tmp_project / "results").rglob("*.json"):
        if p.name != "claims.json":
            p.unlink()
    results.record(Run("02_b", "m"), _verdict(finding="finding 02_b", value=0.05), "z")
    results.write_claims("m")
    results.merge_claims(["m"])  # a run of one model names only that model
    after = (tmp_project / "results" / "m" / "claims.md").read_text().splitlines()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and len(changed) == 1 and "02_b" in after[changed[0]]
    merged_after = (tmp_project / "results" / "claims.md").read_text().splitlines()
    assert merged_after[4] == merged_before[4] and "other" in merged_after[4]  # no model column dropped
    assert sum(a != b for a, b in zip(merged_before, merged_after)) == 1


def test_cache_builds_once_and_writes_atomically(tmp_project):
    calls = []

    def build():
        calls.append(1)
        return {"w": torch.ones(3)}
    a = cache.get_or_build("probe", "m", {"n": 1}, build)
    b = cache.get_or_build("probe", "m", {"n": 1}, build)
    assert len(calls) == 1 and torch.equal(a["w"], b["w"])
    cache.get_or_build("probe", "m", {"n": 2}, build)
    assert len(calls) == 2
    with pytest.raises(RuntimeError):
        cache.atomic_save(1, tmp_project / "cache" / "broken.pt", save=lambda o, p: (_ for _ in ()).throw(RuntimeError()))
    assert not (tmp_project / "cache" / "broken.pt").exists()
    assert not list((tmp_project / "cache").glob(".broken*"))


def test_figures_are_saved_per_model(tmp_project):
    import matplotlib.pyplot as plt
    plotting.setup()
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    p = plotting.save(fig, "org/model", "00_line")
    assert p == tmp_project / "figures" / "org--model" / "00_line.png" and p.stat().st_size > 0
    svg = p.with_suffix(".svg").read_text()
    assert svg.startswith("<?xml") and "<dc:date>" not in svg  # an SVG beside the PNG, no date in it
    first = p.read_bytes(), svg
    plotting.save(fig, "org/model", "00_line")
    assert (p.read_bytes(), p.with_suffix(".svg").read_text()) == first  # same figure, same bytes
    assert plt.rcParams["figure.constrained_layout.use"]
    fig2, ax2 = plt.subplots()
    dots = ax2.scatter(range(20000), range(20000), s=1)  # every neuron of a model: an image in the SVG
    svg2 = plotting.save(fig2, "org/model", "00_dense").with_suffix(".svg").read_text()
    assert "<image" in svg2 and len(svg2) < 500_000 and not dots.get_rasterized()
    with pytest.raises(ValueError):
        plotting.save(fig, "m", "a/b")


def test_a_figure_drawn_again_with_the_same_numbers_is_not_rewritten(tmp_project):
    """Float-level noise (below the fingerprint's significant digits) leaves a saved figure's files untouched;
    a changed number redraws them."""
    import os

    import matplotlib.pyplot as plt

    def draw(y):
        fig, ax = plt.subplots()
        ax.plot([0, 1, 2], y)
        ax.set_title("t")
        return fig
    p = plotting.save(draw([0.1, 0.25, 0.3]), "m", "00_noise")
    stamp = p.stat().st_mtime_ns, p.with_suffix(".svg").stat().st_mtime_ns
    os.utime(p, ns=(1, 1))
    plotting.save(draw([0.1 + 1e-9, 0.25 - 1e-10, 0.3]), "m", "00_noise")
    assert p.stat().st_mtime_ns == 1 and p.with_suffix(".svg").stat().st_mtime_ns == stamp[1]
    plotting.save(draw([0.1, 0.35, 0.3]), "m", "00_noise")
    assert p.stat().st_mtime_ns != 1
    plt.close("all")


def test_an_adhoc_run_records_in_its_run_folder_and_leaves_the_published_ledger(tmp_project, monkeypatch):
    from lib.infra import params

    results.record(Run("01_a", "m"), _verdict(finding="finding 01_a"), "published")
    published = results.write_claims("m").read_text()
    run = params.Run(notebook="01_a", model_name="m", values={"seed": 1}, overrides={"seed": 1},
                     published=False, key="abc123def456")
    path = results.record(run, _verdict(finding="finding 01_a", value=0.05), "ad hoc")
    folder = tmp_project / "results" / "m" / "runs" / "abc123def456"
    assert path == folder / "01_a.json"
    assert "ad hoc" in (folder / "claims.json").read_text() and "did not publish" in (folder / "claims.md").read_text()
    assert json.loads((tmp_project / "results" / "m" / "01_a.json").read_text())["findings"][0]["ours"] == "published"
    assert results.write_claims("m").read_text() == published  # the run folder is not published


def test_a_subset_claims_merge_publishes_only_the_notebooks_named(tmp_project):
    """Records of other notebooks lying in results/<model>/ (an earlier run's) do not enter the ledger when a
    subset run merges its own: `make reproduce NOTEBOOKS=02` publishes 02's rows alone."""
    for nb in ("01_a", "02_b"):
        results.record(Run(nb, "m"), _verdict(finding=f"finding {nb}"), "first")
    published = results.write_claims("m").read_text()
    results.record(Run("01_a", "m"), _verdict(finding="finding 01_a", value=0.05), "stale")
    results.record(Run("02_b", "m"), _verdict(finding="finding 02_b", value=0.3), "subset")
    text = results.write_claims("m", notebooks=["02"]).read_text()
    assert "stale" not in json.dumps(results.load_ledger("m")) and "subset" in json.dumps(results.load_ledger("m"))
    assert sum(a != b for a, b in zip(published.splitlines(), text.splitlines())) == 1


def test_clean_results_then_claims_leaves_the_published_ledger(tmp_project):
    """With no per-notebook records at all (after make clean-results), make claims keeps every published row."""
    for nb in ("01_a", "02_b"):
        results.record(Run(nb, "m"), _verdict(finding=f"finding {nb}"), "x")
    results.write_claims("m")
    before = (tmp_project / "results" / "m" / "claims.json").read_bytes(), (tmp_project / "results" / "m" / "claims.md").read_bytes()
    for p in (tmp_project / "results" / "m").glob("0*.json"):
        p.unlink()
    results.write_claims("m")
    assert ((tmp_project / "results" / "m" / "claims.json").read_bytes(),
            (tmp_project / "results" / "m" / "claims.md").read_bytes()) == before


def test_a_rerun_drops_findings_it_no_longer_records(tmp_project, monkeypatch):
    """A finding renamed (or dropped) by a re-run leaves no stale row; one execution keeps all of its own."""
    results.record(Run("01_a", "m"), _verdict(finding="old name"), "first run")
    results.record(Run("01_a", "m"), _verdict(finding="second finding"), "first run")
    assert [r["finding"] for r in results.load_records("m")] == ["old name", "second finding"]
    monkeypatch.setattr(results, "_EXECUTION", "a later kernel")
    results.record(Run("01_a", "m"), _verdict(finding="new name"), "re-run")
    assert [r["finding"] for r in results.load_records("m")] == ["new name"]


# ----------------------------------------------------------------------------- the findings table (README.md)

def _ledger(root, model, rows):
    (root / "results" / model).mkdir(parents=True, exist_ok=True)
    (root / "results" / model / "claims.json").write_text(json.dumps({"model": model, "rows": rows}))


def _ledger_row(notebook, finding, verdict_word="holds", estimate="0.3 [0.2, 0.4] (drop)", paper="0.5 | 0.6"):
    return {"notebook": notebook, "finding": finding, "paper": paper, "estimate": estimate, "verdict": verdict_word}


def _cells(line: str) -> list[str]:
    """The cells of one markdown table line (escaped pipes stay inside their cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def test_findings_table_one_row_per_finding_one_column_per_model(tmp_project):
    _ledger(tmp_project, "b-model", [_ledger_row("07_x", "falls (b-model)", "does not hold"), _ledger_row("01_a", "a")])
    _ledger(tmp_project, "a-model", [_ledger_row("01_a", "a", estimate="0.1 [0.0, 0.2]"), _ledger_row("01_a", "a2"),
                                     _ledger_row("08_y", "no estimate", "inconclusive", estimate="none")])
    _ledger(tmp_project, "empty", [])
    lines = results.findings_table().splitlines()
    header, rows = _cells(lines[0]), [_cells(ln) for ln in lines[2:]]
    assert header == ["notebook", "finding", "paper", "a-model", "b-model"]  # no default model here; others sorted
    assert all(len(_cells(ln)) == len(header) for ln in lines) and set(lines[1]) == {"|", "-"}
    assert [(r[0], r[1]) for r in rows] == [("01_a", "a"), ("01_a", "a2"), ("07_x", "falls (b-model)"),
                                            ("08_y", "no estimate")]  # one row per (notebook, finding), in order
    assert rows[0][2] == "0.5 \\| 0.6"  # pipes in a cell are escaped
    assert rows[0][3:] == ["**holds**: 0.1 [0.0, 0.2]", "**holds**: 0.3 [0.2, 0.4] (drop)"]
    assert rows[2][3:] == ["", "**does not hold**: 0.3 [0.2, 0.4] (drop)"] and rows[3][3] == "**inconclusive**: none"
    picked = results.findings_table(["b-model"]).splitlines()
    assert _cells(picked[0])[3:] == ["b-model"] and len(picked) == 2 + 2
    assert _cells(results.findings_table(["nobody"]).splitlines()[2])[0] == "(no notebook has recorded a finding yet)"


def test_default_models_come_first_in_the_findings_table():
    assert results.default_models() == ["smollm2-135m", "minilm-l6"]  # the notebooks' parameters cells, in order
    header = _cells(results.findings_table().splitlines()[0])
    assert header[3:5] == ["smollm2-135m", "minilm-l6"]
    n = sum(len(results.load_ledger(m)) for m in header[3:])
    keys = {(r["notebook"], r["finding"]) for m in header[3:] for r in results.load_ledger(m)}
    assert len(results.findings_table().splitlines()) == 2 + len(keys) and n >= len(keys)


def test_readme_findings_table_is_the_committed_ledgers():
    """README.md's table between its markers is findings_table() of the committed ledgers: after a new ledger,
    `python -m lib readme` rewrites it (this test then passes again)."""
    from lib.infra import runner

    text = (paths.ROOT / "README.md").read_text(encoding="utf-8")
    assert runner.readme_findings(text) == results.findings_table(), "README findings: run `python -m lib readme`"
    assert runner.readme_with_findings(text, results.findings_table()) == text


def test_readme_rewrite_touches_only_the_block_between_the_markers(tmp_project):
    from lib.infra import runner

    start, end = runner.FINDINGS
    readme = tmp_project / "README.md"
    readme.write_text(f"# T\n\nbefore\n{start}\nold table\n{end}\nafter\n", encoding="utf-8")
    _ledger(tmp_project, "m", [_ledger_row("01_a", "a")])
    assert runner.write_readme(readme) is True and runner.write_readme(readme) is False
    text = readme.read_text(encoding="utf-8")
    assert text == f"# T\n\nbefore\n{start}\n\n{results.findings_table().rstrip()}\n\n{end}\nafter\n"
    assert runner.readme_findings(text) == results.findings_table()
    with pytest.raises(ValueError, match="findings"):
        runner.readme_with_findings("# no markers\n", "| a |\n")


def test_no_finding_label_names_a_model_twice():
    """A finding's label is the ledger's: a row that names its model (07 measures several) is not followed by
    the model's name again, in the table or on the site's start page."""
    models = results.models_with_records()
    named = re.compile(r"\((?:[^()]*[;, ])?(" + "|".join(map(re.escape, models)) + r")[;,)]")
    for line in results.findings_table().splitlines()[2:]:
        assert len(named.findall(_cells(line)[1])) <= 1, line
    assert any(named.search(_cells(line)[1]) for line in results.findings_table().splitlines()[2:])  # 07's rows
    text = (paths.ROOT / "README.md").read_text(encoding="utf-8")
    for m in models:
        for other in models:
            assert f"({m}) ({other})" not in text


DOCS = ("README.md", "docs/performance.md", "docs/running.md", "docs/methods.md", "docs/workflow.md", "docs/glossary.md")


def _tables(text: str):
    """Each markdown table of ``text`` (outside code fences) as its list of lines."""
    table, fenced = [], False
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            table.append(line)
            continue
        if table:
            yield table
        table = []


@pytest.mark.parametrize("doc", DOCS)
def test_docs_tables_are_well_formed_and_links_exist(doc):
    """Every table line has as many unescaped pipes as its header (and the delimiter row too); every relative
    link and image points at a file of the repository."""
    path = paths.ROOT / doc
    text = path.read_text(encoding="utf-8")
    for table in _tables(text):
        counts = [len(re.findall(r"(?<!\\)\|", ln)) for ln in table]
        assert len(table) >= 2 and set(counts) == {counts[0]}, f"{doc}: a table with {counts} pipes per line:\n{table[0]}"
        assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", table[1].strip()), f"{doc}: no delimiter row under {table[0]}"
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{doc}: the link {target} points at nothing"


def test_merge_without_models_puts_the_default_models_first(tmp_project, monkeypatch):
    """`python -m lib merge` with no models writes the columns in the order `make reproduce` does: the
    notebooks' own default models first (alphabetical order would put another model first)."""
    for m in ("zz-default", "aa-other"):
        results.record(Run("01_a", m), _verdict(finding="finding 01_a"), "x")
        results.write_claims(m)
    monkeypatch.setattr(results, "default_models", lambda: ["zz-default"])
    header = next(ln for ln in results.merge_claims().read_text().splitlines() if ln.startswith("| notebook"))
    assert header.index("zz-default") < header.index("aa-other")
