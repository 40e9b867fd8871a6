"""The Snakemake workflow: a dry run of the full grid lists every notebook x model job with the
artifact dependencies as edges (nothing is executed); the claims merge; the runner's atomic output."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from lib import paths, results, runner

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = shutil.which("snakemake", path=str(Path(sys.executable).parent)) or shutil.which("snakemake")
CONFIG = yaml.safe_load((ROOT / "config" / "models.yaml").read_text())

# The planned notebooks and their own default models (papers A and C and 07: smollm2, 08-10: MiniLM).
PLANNED = {
    "00_tour": "smollm2-135m",
    "01_toxicity_probe": "smollm2-135m", "02_dpo_reduces_toxicity": "smollm2-135m",
    "03_toxic_neurons_explain_little": "smollm2-135m", "04_four_neuron_groups": "smollm2-135m",
    "05_group_patching_replicates_dpo": "smollm2-135m", "06_activation_editing": "smollm2-135m",
    "07_attention_entropy_collapse": "smollm2-135m", "08_saobp_refinement": "minilm-l6",
    "09_global_token_dependency": "minilm-l6", "10_saobp_small_scale_gains": "minilm-l6",
    "11_relation_specific_neurons": "smollm2-135m", "12_neuron_cumulativity": "smollm2-135m",
    "13_neuron_versatility": "smollm2-135m", "14_neuron_interference": "smollm2-135m",
}
# The artifact chain: notebook -> the notebooks whose outputs (cached artifacts) it needs.
CHAIN = {"02": {"01"}, "03": {"02"}, "04": {"02", "03"}, "05": {"02", "03"}, "06": {"02"},
         "09": {"08"}, "10": {"08"}, "12": {"11"}, "13": {"11"}, "14": {"11"}}

pytestmark = pytest.mark.skipif(SNAKEMAKE is None, reason="snakemake is not installed")


def fake_notebook(path: Path, model_name: str, body: str = "print(model_name)") -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f'model_name = "{model_name}"  # which model\nseed = 0',
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def dry_run(tmp_path: Path, notebooks_dir: Path, run: str) -> list[dict]:
    """`snakemake -n --forceall` in a scratch working directory; the jobs it lists, each as
    {rule, input: [...], output: [...]}."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    proc = subprocess.run(
        [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-n", "--forceall", "--nocolor", "--cores", "1",
         "--config", f"run={run}", f"notebooks_dir={notebooks_dir}", f"workdir={work}"],
        cwd=work, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = []
    for line in proc.stdout.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):", line):
            jobs.append({"rule": m.group(1), "input": [], "output": []})
        elif jobs and (m := re.match(r"^\s+(input|output): (.*)$", line)):
            jobs[-1][m.group(1)] = [s.strip() for s in m.group(2).split(",")]
    assert not (work / "results").exists()  # a dry run writes nothing
    return jobs


def notebook_jobs(jobs: list[dict]) -> dict[tuple[str, str], dict]:
    """(model folder, notebook stem) -> job of the `notebook` rule."""
    out = {}
    for j in jobs:
        if j["rule"] == "notebook":
            (o,) = j["output"]
            _, model, name = o.split("/")
            out[(model, name.removesuffix(".ipynb"))] = j
    return out


def expected_grid(stems: list[str]) -> set[tuple[str, str]]:
    pairs = {(PLANNED[s], s) for s in stems}
    for model, spec in CONFIG["models"].items():
        numbers = {n for p in spec["papers"] for n in CONFIG["papers"][p]}
        pairs |= {(paths.slug(model), s) for s in stems if s[:2] in numbers}
    return pairs


def assert_topological(jobs: list[dict]) -> None:
    """Each input made by another job is made by a job that does not (transitively) need this one."""
    made_by = {o: i for i, j in enumerate(jobs) for o in j["output"]}
    edges = {i: {made_by[f] for f in j["input"] if f in made_by} for i, j in enumerate(jobs)}
    order, state = [], {}

    def visit(i):
        assert state.get(i) != "open", f"cycle through {jobs[i]['output']}"
        if i not in state:
            state[i] = "open"
            for k in sorted(edges[i]):
                visit(k)
            state[i] = "done"
            order.append(i)
    for i in range(len(jobs)):
        visit(i)
    pos = {i: n for n, i in enumerate(order)}
    assert all(pos[k] < pos[i] for i in edges for k in edges[i])


def test_dry_run_of_the_full_grid_lists_every_job_with_the_artifact_chain(tmp_path):
    nbdir = tmp_path / "notebooks"
    for stem, model in PLANNED.items():
        fake_notebook(nbdir / f"{stem}.ipynb", model)
    jobs = dry_run(tmp_path, nbdir, "all")
    nbjobs = notebook_jobs(jobs)
    want = expected_grid(list(PLANNED))
    assert set(nbjobs) == want
    assert len(want) == 15 + 4 * 6 + 2 * 4  # defaults + paper A's four models + paper C's two
    by_number = {s[:2]: s for s in PLANNED}
    for (model, stem), job in nbjobs.items():
        needed = {Path(f).stem[:2] for f in job["input"] if f.startswith(f"results/{model}/") and f.endswith(".ipynb")}
        assert needed == CHAIN.get(stem[:2], set()), (model, stem, needed)
        assert str(nbdir / f"{stem}.ipynb") in job["input"]
        assert f"results/{model}/model_dir.txt" in job["input"]
        for n in needed:  # dependencies stay within the model
            assert (model, by_number[n]) in nbjobs
    assert ("gpt2-medium", "02_dpo_reduces_toxicity") in nbjobs and ("llama-2-13b", "12_neuron_cumulativity") in nbjobs
    assert ("gpt2-medium", "12_neuron_cumulativity") not in nbjobs  # paper C is not run on GPT-2
    assert_topological(jobs)
    # one claims ledger per model and the merged table after all of them
    claims = {j["output"][0] for j in jobs if j["rule"] == "claims"}
    assert claims == {f"results/{m}/claims.md" for m, _ in want}
    (merge,) = [j for j in jobs if j["rule"] == "merge_claims"]
    assert set(merge["input"]) == claims and merge["output"] == ["results/claims.md"]
    # the per-model resources reach the jobs (params files exist for the multi-GPU models)
    for model, spec in CONFIG["models"].items():
        if spec["resources"].get("gpu", 0) > 1:
            assert (ROOT / "params" / f"{paths.slug(model)}.yaml").exists(), model
            assert yaml.safe_load((ROOT / "params" / f"{paths.slug(model)}.yaml").read_text())["device_map"] == "auto"


def test_one_model_and_missing_notebooks_keep_the_order(tmp_path):
    """`make reproduce MODEL=gpt2-medium`: paper A only; a notebook not written yet (03) is skipped and
    its dependants wait for what it would have needed (02)."""
    nbdir = tmp_path / "notebooks"
    stems = [s for s in PLANNED if s[:2] in ("00", "01", "02", "04", "05", "07", "11", "12")]
    for s in stems:
        fake_notebook(nbdir / f"{s}.ipynb", PLANNED[s])
    # a paper model runs its papers' notebooks (also when named by its Hugging Face id); a default
    # model runs the notebooks it is the default of
    nbjobs = notebook_jobs(dry_run(tmp_path, nbdir, "gpt2-medium,smollm2-135m,meta-llama/Llama-2-7b-hf"))
    assert set(nbjobs) == ({("gpt2-medium", s) for s in stems if s[:2] in ("01", "02", "04", "05")}
                           | {("smollm2-135m", s) for s in stems}
                           | {("llama-2-7b", s) for s in stems if s[:2] in ("11", "12")})
    for model in ("gpt2-medium", "smollm2-135m"):
        needs04 = [f for f in nbjobs[(model, "04_four_neuron_groups")]["input"] if f.endswith(".ipynb")]
        assert f"results/{model}/02_dpo_reduces_toxicity.ipynb" in needs04
        assert not any("03_" in f for f in needs04)


def test_dry_run_on_the_repository_notebooks():
    """The real notebooks/ folder: every numbered notebook on its own default model (default run),
    in the repository itself (a dry run writes no results)."""
    proc = subprocess.run([SNAKEMAKE, "-n", "--forceall", "--nocolor", "--cores", "1", "--quiet", "rules"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, re.M))
    assert int(counts["notebook"]) == len(runner.numbered_notebooks())
    assert int(counts["merge_claims"]) == 1


def test_parameter_defaults_match_papermill(tmp_path):
    """The Snakefile reads each notebook's default model with lib.runner.parameter_defaults (fast);
    it must agree with papermill's own reading of the parameters cell. Papermill skips a line it cannot
    parse (e.g. a comment holding ' = ') and would hide that parameter from `papermill --help-notebook`,
    so every parameter must be readable by both."""
    import papermill

    for nb in [ROOT / "notebooks" / "00_tour.ipynb", *runner.numbered_notebooks()]:
        ours = runner.parameter_defaults(nb)
        theirs = papermill.inspect_notebook(str(nb))
        assert set(theirs) == set(ours) and "model_name" in ours, (nb.name, set(ours) - set(theirs))
        for k, v in theirs.items():
            assert repr(ours[k]) == repr(eval(v["default"])), (nb.name, k)  # noqa: S307 (literals)
    assert runner.parameter_defaults(fake_notebook(tmp_path / "x.ipynb", "org/m")) == {"model_name": "org/m", "seed": 0}


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(paths, "NOTEBOOKS", tmp_path / "notebooks")
    return tmp_path


def test_merge_claims_puts_models_side_by_side(tmp_results):
    results.record("m-a", "01_x", "probe finds toxicity", "0.9", "0.81", "holds")
    results.record("m-a", "02_y", "DPO lowers toxicity", "-50%", "-10%", "partly holds")
    results.record("org/m-b", "01_x", "probe finds toxicity", "0.9", "0.55", "does not hold")
    text = results.merge_claims(["org/m-b", "m-a"]).read_text()
    lines = text.splitlines()
    assert "| notebook | finding | paper | org/m-b | m-a |" in lines
    assert "| 01_x | probe finds toxicity | 0.9 | **does not hold**: 0.55 | **holds**: 0.81 |" in lines
    assert "| 02_y | DPO lowers toxicity | -50% |  | **partly holds**: -10% |" in lines  # m-b did not run 02
    assert (tmp_results / "results" / "claims.md").exists()
    # default: every model folder with records, in name order
    assert results.models_with_records() == ["m-a", "org--m-b"]
    assert "| notebook | finding | paper | m-a | org--m-b |" in results.merge_claims().read_text()


def test_merge_claims_with_no_records(tmp_results):
    text = results.merge_claims([]).read_text()
    assert "no notebook has recorded a finding yet" in text


def test_atomic_run_leaves_no_output_when_a_notebook_fails(tmp_results):
    """The runner's --atomic mode (used by the Snakefile): the executed notebook appears only when it ran
    through; a failure leaves <nb>.failed.ipynb to read and removes a stale output."""
    ok = fake_notebook(tmp_results / "notebooks" / "01_ok.ipynb", "m", "x = 1 + 1")
    bad = fake_notebook(tmp_results / "notebooks" / "02_bad.ipynb", "m", "raise ValueError('boom')")
    out = tmp_results / "results" / "m"
    rec = runner.run(ok, atomic=True)
    assert rec["exit_code"] == 0 and (out / "01_ok.ipynb").exists()
    (out / "02_bad.ipynb").write_text("{}")  # a stale output from an earlier run
    with pytest.raises(SystemExit, match="failed"):
        runner.run(bad, atomic=True)
    assert not (out / "02_bad.ipynb").exists()
    failed = nbformat.read(out / "02_bad.failed.ipynb", 4)
    assert any("boom" in json.dumps(c.get("outputs", [])) for c in failed.cells)
    assert not list(out.glob(".*partial*"))
    assert json.loads((out / "timings" / "02_bad.json").read_text())["exit_code"] != 0
