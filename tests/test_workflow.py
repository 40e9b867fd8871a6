"""The Snakemake workflow: a dry run of the full grid lists every notebook x model job with the
artifact dependencies as edges (nothing is executed); the claims merge; the runner's atomic output."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml

from lib.infra import index, paths, results, runner
from lib.infra.params import Run

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
CHAIN = {"02": {"01"}, "03": {"01"}, "04": {"03"}, "05": {"03"}, "06": {"03"},
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


def dry_run(tmp_path: Path, notebooks_dir: Path, run: str | None, extra: list[str] = (),
            command: list[str] | None = None) -> list[dict]:
    """`snakemake -n --forceall` in a scratch working directory; the jobs it lists, each as
    {rule, input: [...], output: [...]}. ``extra``: more `--config` entries; ``command``: the
    Snakemake command line to run instead of the plain one (e.g. the one `make reproduce` runs)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    cmd = command or [SNAKEMAKE, "--cores", "1", "--config"] + ([f"run={run}"] if run else [])
    assert "--config" in cmd  # its entries come last, so the scratch folders below join them
    proc = subprocess.run(
        [*cmd[:1], "-s", str(ROOT / "Snakefile"), "-n", "--forceall", "--nocolor", *cmd[1:], *extra,
         f"notebooks_dir={notebooks_dir}", f"workdir={work}"],
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
    its dependants wait for what it would have needed (01)."""
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
        assert f"results/{model}/01_toxicity_probe.ipynb" in needs04
        assert not any("03_" in f or "02_" in f for f in needs04)


def test_dry_run_on_the_repository_notebooks():
    """The real notebooks/ folder: every numbered notebook on its own default model (default run),
    in the repository itself (a dry run writes no results)."""
    proc = subprocess.run([SNAKEMAKE, "-n", "--forceall", "--nocolor", "--cores", "1", "--quiet", "rules"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", proc.stdout, re.M))
    assert int(counts["notebook"]) == len(index.numbered_notebooks())
    assert int(counts["merge_claims"]) == 1


def test_parameter_defaults_match_papermill(tmp_path):
    """The Snakefile reads each notebook's default model with lib.infra.index.parameter_defaults (fast);
    it must agree with papermill's own reading of the parameters cell. Papermill skips a line it cannot
    parse (e.g. a comment holding ' = ') and would hide that parameter from `papermill --help-notebook`,
    so every parameter must be readable by both."""
    import papermill

    for nb in [ROOT / "notebooks" / "00_tour.ipynb", *index.numbered_notebooks()]:
        ours = index.parameter_defaults(nb)
        theirs = papermill.inspect_notebook(str(nb))
        assert set(theirs) == set(ours) and "model_name" in ours, (nb.name, set(ours) - set(theirs))
        for k, v in theirs.items():
            assert repr(ours[k]) == repr(eval(v["default"])), (nb.name, k)  # noqa: S307 (literals)
    assert index.parameter_defaults(fake_notebook(tmp_path / "x.ipynb", "org/m")) == {"model_name": "org/m", "seed": 0}


@pytest.fixture
def tmp_results(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(paths, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.delenv(paths.OUTPUTS_ENV, raising=False)  # these tests write the published folders (of tmp_path)
    return tmp_path


def _verdict(finding: str, value: float):
    from lib import stats, verdict

    c = verdict.Criterion(finding=finding, paper="0.5", effect="drop", threshold=0.1, control="random-k")
    return verdict.decide(c, stats.Estimate(value, value - 0.05, value + 0.05, 20),
                          controls=stats.against_controls(value, [0.001 * i for i in range(10)]))


def test_merge_claims_puts_models_side_by_side(tmp_results):
    """The rule merge_claims: the models' published ledgers side by side, in the Snakefile's order."""
    results.record(Run("01_x", "m-a"), _verdict("probe finds toxicity", 0.4), "0.4")
    results.record(Run("02_y", "m-a"), _verdict("DPO lowers toxicity", 0.3), "0.3")
    results.record(Run("01_x", "org/m-b"), _verdict("probe finds toxicity", 0.02), "0.02")
    for m in ("m-a", "org/m-b"):
        results.write_claims(m)
    lines = results.merge_claims(["org--m-b", "m-a"]).read_text().splitlines()  # folder names, as the Snakefile passes
    assert "| notebook | finding | paper | org--m-b | m-a |" in lines
    (row01,) = [ln for ln in lines if ln.startswith("| 01_x | probe finds toxicity | 0.5 |")]
    assert row01.count("**") == 4  # a verdict in both columns
    (row02,) = [ln for ln in lines if ln.startswith("| 02_y |")]
    assert "| 0.5 |  | **" in row02  # m-b did not run 02
    assert (tmp_results / "results" / "claims.md").exists()
    # default: every model folder with a published ledger, in name order
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


# ----------------------------------------------------------------------------- NOTEBOOKS=...


def make_reproduce_command(**variables) -> list[str]:
    """The Snakemake command line `make reproduce VAR=...` runs (from `make -n`, which runs nothing)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    proc = subprocess.run([make, "-n", "reproduce", *[f"{k}={v}" for k, v in variables.items()]], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "snakemake" in ln and "--config" in ln]
    assert len(lines) == 1, proc.stdout
    recover = [i for i, ln in enumerate(proc.stdout.splitlines()) if "-m lib recover" in ln]
    assert recover and recover[0] < proc.stdout.splitlines().index(lines[0])  # recovery runs first
    cmd = shlex.split(lines[0])
    cmd[0] = str(ROOT / cmd[0]) if not Path(cmd[0]).is_absolute() else cmd[0]
    return [a if a != "all" or cmd[i - 1] != "--cores" else "1" for i, a in enumerate(cmd)]


@pytest.mark.parametrize("value, want", [("00", {"00"}), ("07,11", {"07", "11"}), ("00,07", {"00", "07"}),
                                         ("04", {"04"}), ("09,12", {"09", "12"})])
def test_make_reproduce_notebooks_selects_exactly_those(tmp_path, value, want):
    """`make reproduce NOTEBOOKS=00` runs notebook 00 alone (the Makefile quotes the value, the Snakefile
    zero-pads integers), and a subset runs only the notebooks it names, not those they follow in a full run
    (04 reads the records and the cache and measures what it lacks itself)."""
    nbdir = tmp_path / "notebooks"
    for stem, model in PLANNED.items():
        fake_notebook(nbdir / f"{stem}.ipynb", model)
    jobs = dry_run(tmp_path, nbdir, None, command=make_reproduce_command(NOTEBOOKS=value))
    assert {stem[:2] for _, stem in notebook_jobs(jobs)} == want
    assert len(notebook_jobs(jobs)) == len(want)  # each on its own default model only


@pytest.mark.parametrize("entry, want", [("only=00", {"00"}), ("only=7", {"07"}), ("only=07,11", {"07", "11"}),
                                         ("only=[0, 11]", {"00", "11"})])
def test_only_filter_on_the_plain_snakemake_command(tmp_path, entry, want):
    """`snakemake --config only=00` (no Makefile quoting) parses 00 as int 0: still notebook 00."""
    nbdir = tmp_path / "notebooks"
    for stem, model in PLANNED.items():
        fake_notebook(nbdir / f"{stem}.ipynb", model)
    jobs = dry_run(tmp_path, nbdir, "default", extra=[entry])
    assert {stem[:2] for _, stem in notebook_jobs(jobs)} == want


def test_only_filter_rejects_unknown_numbers(tmp_path):
    nbdir = tmp_path / "notebooks"
    fake_notebook(nbdir / "00_tour.ipynb", "smollm2-135m")
    proc = subprocess.run([SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "-n", "--cores", "1", "--config", "only=15",
                           f"notebooks_dir={nbdir}", f"workdir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no numbered notebook 15" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- a killed run


def _plant_stale_run(work: Path, target: str) -> Path:
    """What `kill -9` of Snakemake during a notebook job leaves: its lock files and the runner's partial."""
    locks = work / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    (locks / "0.input.lock").write_text("notebooks/00_tour.ipynb\n")
    (locks / "0.output.lock").write_text(f"{target}\n")
    partial = work / "results" / "smollm2-135m" / ".00_tour.partial.ipynb"
    partial.parent.mkdir(parents=True)
    partial.write_text("{}")
    return partial


def test_recover_removes_a_stale_lock_and_partial_so_the_run_proceeds(tmp_path):
    nbdir = tmp_path / "notebooks"
    fake_notebook(nbdir / "00_tour.ipynb", "smollm2-135m")
    work = tmp_path / "work"
    target = "results/smollm2-135m/model_dir.txt"
    partial = _plant_stale_run(work, target)
    cmd = [SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--cores", "1", "--nocolor", target, "--config",
           f"notebooks_dir={nbdir}", f"workdir={work}"]
    before = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=180)
    assert before.returncode != 0 and "cannot be locked" in before.stdout + before.stderr  # the reported failure
    assert not (work / target).exists()
    done = runner.recover(work)
    assert any("stale Snakemake lock" in line and ".venv/bin/snakemake --unlock" in line for line in done), done
    assert any(".00_tour.partial.ipynb" in line for line in done), done
    assert not (work / ".snakemake" / "locks").exists() and not partial.exists()
    after = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=180)
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
    assert (work / target).read_text().strip()  # the job ran: where the model's weights are
    assert runner.recover(work) == []  # nothing left to recover


def test_recover_leaves_a_live_runs_lock_alone(tmp_path):
    """A Snakemake process working in the folder holds its lock: nothing is removed."""
    work = tmp_path / "work"
    partial = _plant_stale_run(work, "results/smollm2-135m/model_dir.txt")
    fake = tmp_path / "bin" / "snakemake"  # a process whose program is called snakemake, in that folder
    fake.parent.mkdir()
    fake.symlink_to(sys.executable)
    proc = subprocess.Popen([str(fake), "-c", "import time; time.sleep(60)"], cwd=work)
    try:
        for _ in range(50):  # until /proc shows its command line
            if any(pid == proc.pid for pid, _ in runner.workflow_processes(work)):
                break
            time.sleep(0.1)
        assert (proc.pid, "snakemake") in runner.workflow_processes(work)
        (line,) = runner.recover(work)
        assert "left alone" in line and str(proc.pid) in line
        assert (work / ".snakemake" / "locks" / "0.output.lock").exists() and partial.exists()
    finally:
        proc.kill()
        proc.wait()
    assert runner.workflow_processes(work) == []
    assert len(runner.recover(work)) == 2


def test_docs_name_the_venv_snakemake_for_unlock():
    """Messages name a command that exists: `.venv/bin/snakemake --unlock` or `make reproduce`."""
    text = (ROOT / "docs" / "workflow.md").read_text()
    assert "make reproduce` recovers" in text or "recovers by itself" in text
    for m in re.finditer(r"`([^`]*--unlock[^`]*)`", text):
        assert m.group(1).startswith(".venv/bin/snakemake"), m.group(1)


# ----------------------------------------------------------------------------- make test-stability


def executed(path: Path, key_output: str, other: str = "anything\n", tagged: bool = False) -> Path:
    """A small executed notebook: a parameters cell, an ordinary cell and a key-number cell."""
    nb = nbformat.v4.new_notebook()
    key = nbformat.v4.new_code_cell("print(x)" if tagged else "# NBVAL_CHECK_OUTPUT\nprint(x)",
                                    metadata={"tags": ["nbval-check-output"]} if tagged else {})
    key.outputs = [nbformat.v4.new_output("stream", name="stdout", text=key_output)]
    plain = nbformat.v4.new_code_cell("print(y)")
    plain.outputs = [nbformat.v4.new_output("stream", name="stdout", text=other)]
    nb.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}), plain, key]
    nbformat.write(nb, path)
    return path


def test_compare_key_cells(tmp_path):
    a = executed(tmp_path / "a.ipynb", "toxicity 0.09 | perplexity 7,592 | ran in 3.2 s\n")
    same = executed(tmp_path / "b.ipynb", "toxicity 0.09 | perplexity 7,592 | ran in 41.0 s\n", other="else\n")
    moved = executed(tmp_path / "c.ipynb", "toxicity 0.08 | perplexity 7,887 | ran in 3.2 s\n")
    tagged = executed(tmp_path / "d.ipynb", "toxicity 0.09 | perplexity 7,592 | ran in 3.2 s\n", tagged=True)
    assert runner.key_cell_outputs(a) == ["toxicity 0.09 | perplexity 7,592 | ran in TIME\n"]  # nbval's sanitizers
    assert runner.compare_key_cells(a, same) == ""  # times and ordinary cells do not count
    assert runner.compare_key_cells(a, tagged) == ""  # the tag marks a key cell as well
    diff = runner.compare_key_cells(a, moved, "1 thread", "2 threads")
    assert "-toxicity 0.09 | perplexity 7,592" in diff and "+toxicity 0.08 | perplexity 7,887" in diff
    assert "1 thread (key cell 1)" in diff and "2 threads (key cell 1)" in diff
    none = nbformat.v4.new_notebook()
    assert "1 key-number cell(s) in a, 0 in b" in runner.compare_key_cells(a, none, "a", "b")


def test_stability_runs_each_thread_count_outside_the_tree(tmp_path):
    """Two papermill runs at COMPENDIUM_THREADS=1 and 2, in a copy of the tree: a key cell that prints
    the thread count differs (and is reported), the copy's lib is the one imported."""
    nb = fake_notebook(tmp_path / "99_threads.ipynb", "smollm2-135m",
                       "# NBVAL_CHECK_OUTPUT\nimport os, lib\nprint('threads', os.environ['COMPENDIUM_THREADS'])")
    out = tmp_path / "runs"
    report = runner.stability([nb], (1, 2), out_dir=out, timeout=300)
    assert set(report) == {"99_threads"}
    assert "-threads 1" in report["99_threads"] and "+threads 2" in report["99_threads"]
    for n in (1, 2):
        assert runner.key_cell_outputs(out / f"threads-{n}" / nb.name) == [f"threads {n}\n"]
    # the run imported the copy's lib, so its figures and records went to the copy
    probe = fake_notebook(tmp_path / "98_where.ipynb", "smollm2-135m",
                          "# NBVAL_CHECK_OUTPUT\nfrom lib.infra import paths\nprint(paths.ROOT)")
    assert runner.stability([probe], (1, 2), out_dir=out, timeout=300) == {"98_where": ""}
    assert runner.key_cell_outputs(out / "threads-1" / probe.name) == [f"{(out / 'tree').resolve()}\n"]
    assert not (out / "tree").exists()  # the copy is removed after the runs


# ----------------------------------------------------------------------------- messages


def test_messages_name_the_hub_cli_the_environment_ships():
    """The installed huggingface_hub ships `hf` (download, auth login), not `huggingface-cli`."""
    hf = Path(sys.executable).parent / "hf"
    assert hf.exists() and not (Path(sys.executable).parent / "huggingface-cli").exists()
    assert subprocess.run([str(hf), "download", "--help"], capture_output=True, timeout=60).returncode == 0
    files = [*sorted((ROOT / "lib").glob("*.py")), ROOT / "README.md", ROOT / "docs" / "workflow.md",
             ROOT / "Snakefile", ROOT / "Makefile"]
    assert not [f.name for f in files if "huggingface-cli" in f.read_text(encoding="utf-8")]


def test_kernel_config_drops_only_the_tcp_warning(tmp_path, caplog):
    import logging

    exec(compile(runner.KERNEL_CONFIG_TEXT, "ipython_kernel_config.py", "exec"), {"get_config": dict})
    log = logging.getLogger("IPKernelApp")
    with caplog.at_level(logging.WARNING):
        log.warning("Kernel is running over TCP without encryption. All communication ...")
        log.warning("some other kernel warning")
    assert [r.getMessage() for r in caplog.records] == ["some other kernel warning"]
    # a papermill run with the venv's kernel config prints no such warning
    assert runner.install_kernel_config(quiet=True) == runner.kernel_config_path()
    nb = fake_notebook(tmp_path / "01_x.ipynb", "m", "x = 1")
    proc = subprocess.run([sys.executable, "-m", "papermill", str(nb), str(tmp_path / "out.ipynb"),
                           "--log-level", "WARNING", "--no-progress-bar"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "without encryption" not in proc.stdout + proc.stderr


BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|it/s\]|s/it\]")


def test_committed_notebooks_store_no_progress_bars():
    """Stored outputs carry no tqdm / transformers bars (executions run with COMPENDIUM_PROGRESS=0)."""
    found = []
    for nb_path in index.numbered_notebooks():
        nb = nbformat.read(nb_path, as_version=4)
        for i, cell in enumerate(nb.cells):
            for out in cell.get("outputs", []):
                if out.get("name") == "stderr" and BAR.search(out.get("text", "")):
                    found.append(f"{nb_path.name} cell {i}")
    assert not found, f"progress bars stored in: {found}"


def test_executions_turn_bars_off():
    """The runner, nbval (make test-notebooks) and the stability check run with bars off."""
    from lib.infra import repro

    assert repro.quiet_env() == {"COMPENDIUM_PROGRESS": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    make = (paths.ROOT / "Makefile").read_text()
    for target in ("test:", "test-notebooks:"):  # both go through lib.infra.runner test (run_tests)
        assert "-m lib test" in make.split(f"\n{target}", 1)[1].split("\n\n", 1)[0]
    src = Path(runner.__file__).read_text()
    assert src.count("repro.quiet_env()") >= 3  # lib.infra.runner run, stability and test


# ----------------------------------------------------------------------------- make test (tests/Snakefile)


def test_waits_follow_the_index_and_skip_missing_notebooks():
    g = index.waits(["tests", "01", "02", "03", "05", "07", "08", "10"], tests=True)
    assert g["05"] == ["03"] and g["03"] == ["01"] and g["10"] == ["07", "08"] and g["tests"] == [] and g["01"] == []
    assert index.waits(["07", "08", "10"])["10"] == ["08"]  # test_after orders make test only
    assert index.waits(["01", "04"])["04"] == ["01"]  # 02 and 03 absent: 04 waits for what they need
    prio = index.chain_seconds(index.waits(["01", "02", "03", "11"]), {"01": 1, "02": 5, "03": 1, "11": 6})
    assert prio == {"01": 6.0, "02": 5.0, "03": 1.0, "11": 6.0}  # weight + heaviest chain that waits for it
    with pytest.raises(ValueError, match="cycle"):
        index.chain_seconds({"a": ["b"], "b": ["a"]}, {})


def test_make_test_and_make_reproduce_share_one_engine():
    """Both workflows are Snakemake files that take their order from the index; the runner keeps no scheduler."""
    src = Path(runner.__file__).read_text()
    assert runner.TEST_WORKFLOW == paths.ROOT / "tests" / "Snakefile"
    assert "def _schedule" not in src and "def test_order" not in src
    for wf in (paths.ROOT / "Snakefile", paths.ROOT / "tests" / "Snakefile"):
        assert "index.waits(" in wf.read_text()


def test_run_tests_order_workers_threads_and_failures(tmp_path, monkeypatch, capsys):
    """Fake jobs record when they start and end and the threads they were given: a job starts only
    after what it waits for has ended, never more than `workers` run at once, each gets
    COMPENDIUM_THREADS // workers threads, and a failing job is reported with its log."""
    monkeypatch.setenv("COMPENDIUM_THREADS", "2")
    stamp = tmp_path / "stamps"
    stamp.mkdir()
    script = ("import os, sys, time; j = sys.argv[1]; d = sys.argv[2]; open(f'{d}/{j}.start', 'w').write(repr(time.time()));"
              "time.sleep(0.3); open(f'{d}/{j}.end', 'w').write(repr(time.time()));"
              "print('threads', os.environ['COMPENDIUM_THREADS'], os.environ['COMPENDIUM_PROGRESS']); sys.exit(3 if j == '12' else 0)")
    done = runner.run_tests(["tests", "01", "02", "03", "11", "12"], workers=2, log_dir=tmp_path / "logs",
                            command=lambda j: [sys.executable, "-c", script, j, str(stamp)], root=tmp_path)
    assert {j: rc for j, (rc, _) in done.items()} == {"tests": 0, "01": 0, "02": 0, "03": 0, "11": 0, "12": 3}
    t = {p.name: float(p.read_text()) for p in stamp.iterdir()}
    for job, waits in (("02", "01"), ("03", "01"), ("12", "11")):
        assert t[f"{job}.start"] >= t[f"{waits}.end"]
    spans = [(t[f"{j}.start"], t[f"{j}.end"]) for j in done]
    assert max(sum(a <= s < b for a, b in spans) for s, _ in spans) <= 2  # at most two at once
    assert (tmp_path / "logs" / "01.log").read_text().strip() == "threads 1 0"
    out = capsys.readouterr().out
    assert "12 FAILED (exit 3)" in out and "threads 1 0" in out  # the failed job's log is printed
    with pytest.raises(ValueError, match="workers"):
        runner.run_tests(["01"], workers=0)


def test_make_test_reads_records_strictly_and_audits_a_sample(tmp_path, monkeypatch):
    """make test's notebook jobs run with COMPENDIUM_RECORDS=strict: a job that needs a record the repository lacks
    fails, naming the record and the command that builds it; a committed record in the audit's plan is measured
    again inside the job that reads it, and the 'audit' job reports the comparison (and fails beyond tolerance)."""
    from lib.infra import store

    monkeypatch.setenv("COMPENDIUM_THREADS", "2")
    script = ("import sys; from lib.infra import store\n"
              "store.step('toy', 1, 'a test step', lambda c, f: [store.within('v', c['v'], f['v'], 0.1, 'stated')])\n"
              "j, fresh = sys.argv[1], float(sys.argv[2])\n"
              "print(store.measure('toy', 'm', {'job': j}, lambda: {'v': fresh}))\n")
    store.step("toy", 1, "a test step")
    monkeypatch.setenv(store.NOTEBOOK_ENV, "01_toy")
    store.measure("toy", "m", {"job": "01"}, lambda: {"v": 1.0})  # committed, measured by notebook 01
    monkeypatch.delenv(store.NOTEBOOK_ENV)
    for fresh, audit_rc in ((1.05, 0), (2.0, 1)):
        logs = tmp_path / f"logs-{fresh}"
        done = runner.run_tests(["01", "02"], workers=2, log_dir=logs,
                                command=lambda j: [sys.executable, "-c", script, j, str(fresh)])
        assert done["02"][0] != 0 and done["01"][0] == audit_rc and done["audit"][0] == audit_rc
        log02 = (logs / "02.log").read_text()
        assert "MissingRecord: missing record" in log02 and "make reproduce" in log02  # nothing computed
        assert "{'v': 1.0}" in (logs / "01.log").read_text() or audit_rc  # the committed value, not the recomputed one
        report = (logs / "audit.log").read_text()
        assert ("all within tolerance" in report) == (audit_rc == 0) and "m/measurements/toy/" in report
    assert len(list(store.root().glob("m/measurements/toy/*.json*"))) == 1  # strict mode wrote nothing


def test_make_test_fails_when_a_job_changes_the_work_tree(tmp_path, monkeypatch, capsys):
    """run_tests compares `git status` before and after its jobs: job 'tree' passes when they leave the work tree
    as they found it (a change made before the tests is not theirs), and fails, naming the paths, when a job
    changes a tracked file or leaves a new one outside the ignored paths."""
    import subprocess as sp

    monkeypatch.setenv("COMPENDIUM_THREADS", "2")
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: sp.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (repo / ".gitignore").write_text("scratch/\n")
    (repo / "figure.svg").write_text("<svg/>\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree")
    (repo / "notes.txt").write_text("the user's own change, made before the tests\n")
    jobs = {"leaves it": "import os; os.makedirs('scratch', exist_ok=True); open('scratch/log', 'w').write('x')",
            "redraws": "open('figure.svg', 'w').write('<svg> </svg>')",
            "adds": "open('new.json', 'w').write('{}')"}
    for name, script in jobs.items():
        done = runner.run_tests(["01"], workers=1, log_dir=tmp_path / name.replace(" ", "-"), audit_budget=None,
                                command=lambda j: [sys.executable, "-c", f"import os; os.chdir({str(repo)!r}); {script}"],
                                root=repo)
        out = capsys.readouterr().out
        assert done["01"][0] == 0 and done["tree"][0] == (0 if name == "leaves it" else 1), (name, out)
        if name != "leaves it":
            assert "changed the work tree" in out and ("figure.svg" if name == "redraws" else "new.json") in out
        git("checkout", "figure.svg")
        (repo / "new.json").unlink(missing_ok=True)
    assert runner.tree_state(tmp_path / "not-a-repo") is None


def test_run_tests_shares_the_threads_among_the_workers(tmp_path, monkeypatch):
    """Each job gets COMPENDIUM_THREADS // workers threads: two workers on 2 threads run two jobs at one thread each,
    one worker runs one job at a time with both."""
    monkeypatch.setenv("COMPENDIUM_THREADS", "2")
    script = "import os; print('threads', os.environ['COMPENDIUM_THREADS'])"
    threads = lambda logs, j: (logs / f"{j}.log").read_text().split()[-1]  # noqa: E731
    for workers, want in ((2, "1"), (1, "2")):
        logs = tmp_path / f"w{workers}"
        runner.run_tests(["11", "12"], workers=workers, log_dir=logs, command=lambda j: [sys.executable, "-c", script],
                         audit_budget=None, root=tmp_path)
        assert [threads(logs, j) for j in ("11", "12")] == [want, want]


def test_clean_results_never_deletes_a_tracked_file():
    """`make clean-results` removes what runs leave (executed notebooks, timings, per-notebook records, run
    folders), never the committed ledgers or measurement records: no path its patterns match is, or holds, a
    file git tracks."""
    import glob
    import subprocess as sp

    make = (paths.ROOT / "Makefile").read_text()
    line = next(ln for ln in make.splitlines() if ln.strip().startswith("rm -rf results"))
    patterns = line.split()[2:]
    assert patterns and all(p.startswith("results/") for p in patterns)
    tracked = sp.run(["git", "ls-files", "results"], cwd=paths.ROOT, capture_output=True, text=True).stdout.split()
    assert any("/measurements/" in t for t in tracked) and any(t.endswith("claims.json") for t in tracked)
    hit = [t for p in patterns for m in glob.glob(str(paths.ROOT / p))
           for t in tracked if (paths.ROOT / t) == Path(m) or Path(m) in (paths.ROOT / t).parents]
    assert not hit, f"clean-results would delete tracked files: {hit[:5]}"
    # and a pattern that would, is caught: the rule as it was
    assert [t for m in glob.glob(str(paths.ROOT / "results/*/")) for t in tracked if Path(m) in (paths.ROOT / t).parents]


def test_make_test_writes_figures_and_notebook_records_outside_the_tree(tmp_path, monkeypatch):
    """run_tests gives every job COMPENDIUM_OUTPUTS (<logs>/outputs): a notebook's figures and ledger records go
    there, so a test run changes no tracked figure and feeds no published ledger."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lib import plotting

    monkeypatch.setenv("COMPENDIUM_THREADS", "2")
    script = "import os; print('outputs', os.environ['COMPENDIUM_OUTPUTS'])"
    runner.run_tests(["01"], workers=1, log_dir=tmp_path / "logs", command=lambda j: [sys.executable, "-c", script],
                     audit_budget=None)
    assert (tmp_path / "logs" / "01.log").read_text().split() == ["outputs", str(tmp_path / "logs" / "outputs")]
    monkeypatch.setenv(paths.OUTPUTS_ENV, str(tmp_path / "out"))
    monkeypatch.setattr(paths, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    fig = plt.figure()
    assert plotting.save(fig, "m", "01_demo") == tmp_path / "out" / "figures" / "m" / "01_demo.png"
    plt.close(fig)
    v = _verdict("a finding", 0.4)
    assert results.record(Run("01_demo", "m"), v, "x") == tmp_path / "out" / "results" / "m" / "01_demo.json"
    assert not (tmp_path / "figures").exists() and not (tmp_path / "results").exists()


# ----------------------------------------------------------------------------- make help, lib outside its environment


def test_make_help_lists_the_variables_the_targets_read():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # also inside make test
    proc = subprocess.run([make, "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("  make reproduce ") for ln in lines)  # the targets as before
    variables = lines[next(i for i, ln in enumerate(lines) if ln.startswith("variables")) + 1:]
    named = {ln.split()[0].split("=")[0] for ln in variables}
    assert named >= {"DEVICE", "MODEL", "NOTEBOOKS", "FRESH", "WORKERS", "JOB_THREADS", "AUDIT_BUDGET", "COMPENDIUM_THREADS"}
    for name in named:  # each one a variable the Makefile reads, or the threads variable lib reads
        assert f"$({name})" in (ROOT / "Makefile").read_text() or name == "COMPENDIUM_THREADS", name


def test_lib_outside_its_environment_names_the_missing_package():
    """`python -m lib` with a Python that lacks the packages (here the venv's without site-packages):
    one line naming the package and the fix, not a ModuleNotFoundError traceback. lib.infra.colab, which installs
    them, still runs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for how in (["-m", "lib", "--help"], ["-c", "from lib import data"]):
        proc = subprocess.run([sys.executable, "-S", *how], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stdout == "", how
        assert proc.stderr.strip() == (f"lib needs the package 'numpy', which {sys.executable} cannot import: "
                                       "run `make setup` and use .venv/bin/python (or activate .venv)"), how
    if sys.version_info >= (3, 11):  # tomllib (3.10 needs tomli from site-packages)
        proc = subprocess.run([sys.executable, "-S", "-m", "lib.infra.colab", "--help"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr


@pytest.mark.parametrize("nb", sorted(paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name[:2])
def test_stored_outputs_name_no_machine_path(nb):
    """The committed outputs are read on other machines: none prints this checkout's absolute path or an
    installed package's file (a library warning captured into a cell), and every cell has an id."""
    import json

    cells = json.loads(nb.read_text())["cells"]
    assert all("id" in c for c in cells), f"{nb.name}: cells without an id (nbformat warns inside the kernel)"
    text = json.dumps([c.get("outputs", []) for c in cells])
    for needle in (str(paths.ROOT), "site-packages"):
        assert needle not in text, f"{nb.name}: a stored output contains {needle!r}"
