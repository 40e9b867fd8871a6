"""lib.infra.params.check: unknown names, types, list parsing, published vs ad-hoc runs, where figures go;
and every numbered notebook fed a misspelled and a mistyped parameter through papermill's own
injection, executing only the cells up to and including the check (nothing heavy runs)."""
from __future__ import annotations

import copy
import json

import matplotlib
import nbformat
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from lib import plotting
from lib.infra import index, params, paths, repro

matplotlib.use("Agg")

NOTEBOOKS = sorted(p.stem for p in paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

TINY_PARAMS = '''# Parameters
model_name: str = "tiny-model"  # which model
device: str = "auto"  # where
seed: int = 0  # seed
n_texts: int = 8  # texts
lr: float = 0.1  # learning rate
flag: bool = True  # a switch
tasks: list = ["SST-2", "LM"]  # tasks
seeds: list = [0, 1]  # seeds
batch_size: int = 4  # per forward pass
'''


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A small notebook (as 11_tiny and 08_tiny) in a scratch project: setup, parameters, check, more."""
    for name in ("NOTEBOOKS", "PARAMS", "RESULTS", "FIGURES"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setattr(paths, name, tmp_path / name.lower())
    monkeypatch.setattr(paths, "ROOT", tmp_path)
    monkeypatch.delenv(paths.OUTPUTS_ENV, raising=False)  # the published and run folders of this scratch project
    monkeypatch.setenv(paths.PUBLISH_ENV, "1")  # a publishing run (make reproduce's) unless a test says otherwise
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for stem in ("11_tiny", "08_tiny"):
        nb.cells = [nbformat.v4.new_code_cell("import os\n\nfrom lib.infra import params"),
                    nbformat.v4.new_code_cell(TINY_PARAMS, metadata={"tags": ["parameters"]}),
                    nbformat.v4.new_code_cell(f'run = params.check(globals(), "{stem}")\nlabel = "x"'),
                    nbformat.v4.new_code_cell("later = [1, 2]  # defined after the check\nfor i in range(2):\n    pass")]
        nbformat.write(nb, paths.NOTEBOOKS / f"{stem}.ipynb")
    return tmp_path


def execute_to_check(stem: str, parameters: dict, history: bool = False) -> dict:
    """papermill's injection of ``parameters`` into notebook ``stem``; then the cells up to the injected
    one and the check (a numbered notebook's set-up cell; a tiny notebook's check line) in a fresh namespace.
    history: keep IPython's input history (_ih) as a kernel does."""
    nb = parameterize_notebook(copy.deepcopy(load_notebook_node(str(paths.NOTEBOOKS / f"{stem}.ipynb"))), parameters)
    (inj,) = [i for i, c in enumerate(nb.cells) if "injected-parameters" in c.metadata.tags]
    after = nb.cells[inj + 1]
    if "setup" in after.metadata.get("tags", []):  # a numbered notebook: its set-up cell (lib.nb.start), whole
        check_line = after.source
        assert check_line.splitlines()[-1].startswith(f'run = nb.start(globals(), "{stem}"'), check_line
    else:  # the scratch project's tiny notebooks: the check line itself
        check_line = after.source.splitlines()[0]
        assert check_line.startswith(f'run = params.check(globals(), "{stem}")'), check_line
    ns = {"_ih": [""]} if history else {}
    for src in [c.source for c in nb.cells[:inj + 1] if c.cell_type == "code"] + [check_line]:
        if history:
            ns["_ih"].append(src)
        exec(compile(src, stem, "exec"), ns)
    return ns


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


# ----------------------------------------------------------------------------- check() on a small notebook


def test_defaults_are_the_published_run(tiny):
    ns = execute_to_check("11_tiny", {"model_name": "tiny-model"})
    run = ns["run"]
    assert run.published and run.key == "" and run.overrides == {}
    assert run.values["tasks"] == ["SST-2", "LM"] and run.notebook == "11_tiny"
    assert run.results_dir() == tiny / "results" / "tiny-model" and run.figures_dir() == tiny / "figures" / "tiny-model"


@pytest.mark.parametrize("history", [False, True], ids=["exec", "ipython-history"])
def test_a_misspelled_name_is_one_line_naming_the_closest(tiny, history):
    with pytest.raises(ValueError) as e:
        execute_to_check("11_tiny", {"n_txets": 5}, history)
    assert one_line_error(e) == ("unknown parameter 'n_txets' for 11_tiny: did you mean 'n_texts'? (valid: batch_size, "
                                 "device, flag, lr, model_name, n_texts, seed, seeds, tasks)")
    with pytest.raises(ValueError, match=r"unknown parameters for 11_tiny: 'lrr': did you mean 'lr'\?; 'zzz' \(valid"):
        execute_to_check("11_tiny", {"zzz": 1, "lrr": 0.2}, history)


def test_globals_of_the_notebook_itself_are_not_parameters(tiny):
    """A re-run of the check cell after later cells ran (their literals are globals) passes; so does a
    scratch variable in a kernel whose history holds no papermill cell."""
    ns = execute_to_check("11_tiny", {})
    ns.update(later=[3], label="y")
    assert params.check(ns, "11_tiny").published
    ns.update(_ih=["", "scratch = 3"], scratch=3)
    assert params.check(ns, "11_tiny").published
    del ns["_ih"]
    with pytest.raises(ValueError, match="unknown parameter 'scratch'"):  # a plain exec has no history to go by
        params.check(ns, "11_tiny")


@pytest.mark.parametrize("given, want", [
    ("LM", ["LM"]), ("SST-2, LM", ["SST-2", "LM"]), ('["CoLA"]', ["CoLA"]), ("", []), (("LM",), ["LM"]),
])
def test_a_list_given_as_text_is_split_at_commas(tiny, given, want):
    ns = execute_to_check("11_tiny", {"tasks": given})
    assert ns["tasks"] == want and ns["run"].values["tasks"] == want


@pytest.mark.parametrize("given, want", [("0,2", [0, 2]), ("[3, 4]", [3, 4]), (5, [5]), ([0, 1], [0, 1])])
def test_list_items_take_the_element_type_and_a_number_becomes_a_one_element_list(tiny, given, want):
    ns = execute_to_check("11_tiny", {"seeds": given})
    assert ns["seeds"] == want and all(type(s) is int for s in ns["seeds"])


@pytest.mark.parametrize("name, value, expect", [
    ("n_texts", "abc", "parameter 'n_texts' of 11_tiny expects int, got 'abc'"),
    ("n_texts", 2.5, "expects int, got 2.5"),
    ("n_texts", True, "expects int, got True"),
    ("lr", "fast", "parameter 'lr' of 11_tiny expects float, got 'fast'"),
    ("flag", "yes", "parameter 'flag' of 11_tiny expects bool, got 'yes'"),
    ("model_name", 7, "parameter 'model_name' of 11_tiny expects str, got 7"),
    ("seeds", "a,b", "parameter 'seeds' of 11_tiny expects list[int], got 'a,b': 'a' is not int"),
    ("seeds", "[0, 1", "expects list[int], got '[0, 1': not a readable list"),
    ("tasks", 3, "parameter 'tasks' of 11_tiny expects list[str], got 3: 3 is not str"),
    ("tasks", {"a": 1}, "expects list[str], got {'a': 1}"),
])
def test_a_wrong_type_is_one_line_naming_parameter_type_and_value(tiny, name, value, expect):
    with pytest.raises(ValueError) as e:
        execute_to_check("11_tiny", {name: value})
    assert expect in one_line_error(e)


def test_values_are_coerced_and_written_back(tiny):
    ns = execute_to_check("11_tiny", {"lr": 1, "n_texts": 8})
    assert ns["lr"] == 1.0 and type(ns["lr"]) is float
    assert ns["run"].overrides == {"lr": 1.0}  # n_texts is at its default: not an override
    ns = execute_to_check("11_tiny", {"lr": 0.1})
    assert ns["run"].published and type(ns["lr"]) is float


def test_overrides_key_and_neutral_names(tiny):
    a = execute_to_check("11_tiny", {"seed": 1, "n_texts": 9})["run"]
    b = execute_to_check("11_tiny", {"n_texts": 9, "seed": 1})["run"]
    c = execute_to_check("11_tiny", {"seed": 2, "n_texts": 9})["run"]
    assert not a.published and a.overrides == {"seed": 1, "n_texts": 9}
    assert len(a.key) == 12 and int(a.key, 16) >= 0 and a.key == b.key != c.key
    # device, model_name and (in 07 and 11-14) batch_size choose how a run executes, not what it computes
    d = execute_to_check("11_tiny", {"device": "cpu", "model_name": "other-model", "batch_size": 2})["run"]
    assert d.published and d.model_name == "other-model" and d.results_dir() == tiny / "results" / "other-model"
    assert "batch_size" in params.neutral("11_tiny") and "batch_size" not in params.neutral("08_tiny")
    e = execute_to_check("08_tiny", {"batch_size": 2})["run"]  # a training batch in 08: an override
    assert e.overrides == {"batch_size": 2}
    assert e.results_dir() == tiny / "results" / "tiny-model" / "runs" / e.key
    assert e.figures_dir() == e.results_dir() / "figures"
    assert json.loads((e.results_dir() / "overrides.json").read_text()) == {"batch_size": 2}


def test_published_settings_include_the_models_params_file(tiny):
    (tiny / "params" / "tiny-model.yaml").write_text("device_map: auto\nn_texts: 16\n")
    assert execute_to_check("11_tiny", {"n_texts": 16, "device_map": "auto"})["run"].published
    assert execute_to_check("11_tiny", {"device_map": "auto"})["run"].overrides == {"n_texts": 8}
    with pytest.raises(ValueError, match="unknown parameter 'device_map' for 11_tiny: did you mean 'device'"):
        execute_to_check("11_tiny", {"model_name": "no-params-file", "device_map": "auto"})


def test_a_default_run_that_does_not_publish_writes_to_its_run_folder(tiny, monkeypatch, capsys):
    """Papermill or Jupyter by hand at the published parameters: figures and ledger records go to
    results/<model>/runs/default/, never to the published folders (only make reproduce publishes)."""
    import matplotlib.pyplot as plt

    monkeypatch.delenv(paths.PUBLISH_ENV)
    run = execute_to_check("08_tiny", {})["run"]
    assert not run.published and run.key == "default" and run.overrides == {}
    assert "make reproduce NOTEBOOKS=08 publishes" in capsys.readouterr().out
    fig = plt.figure()
    path = plotting.save(fig, run, "08_demo")
    assert path == tiny / "results" / "tiny-model" / "runs" / "default" / "figures" / "08_demo.png"
    assert not (tiny / "figures" / "tiny-model").exists() or not any((tiny / "figures" / "tiny-model").iterdir())
    plt.close(fig)


def test_plotting_save_of_an_adhoc_run_goes_to_its_run_folder(tiny):
    import matplotlib.pyplot as plt

    fig = plt.figure()
    run = execute_to_check("08_tiny", {"n_texts": 3})["run"]
    path = plotting.save(fig, run, "08_demo")
    assert path == tiny / "results" / "tiny-model" / "runs" / run.key / "figures" / "08_demo.png" and path.exists()
    assert not (tiny / "figures" / "tiny-model" / "08_demo.png").exists()
    assert plotting.save(fig, "another-model", "08_demo") == tiny / "figures" / "another-model" / "08_demo.png"
    published = execute_to_check("08_tiny", {})["run"]  # the published run: the tracked folder
    assert plotting.save(fig, published, "08_demo") == tiny / "figures" / "tiny-model" / "08_demo.png"
    plt.close(fig)


@pytest.mark.parametrize("raw, want", [("abc", None), ("0", None), ("-2", None), ("1.5", None), ("3", 3), ("", 2)])
def test_compendium_threads_is_a_positive_integer(monkeypatch, raw, want):
    monkeypatch.setenv("COMPENDIUM_THREADS", raw)
    if want is None:
        with pytest.raises(ValueError) as e:
            repro.env_threads()
        assert one_line_error(e) == f"COMPENDIUM_THREADS must be a positive integer (torch's CPU threads), got {raw!r}"
    else:
        assert repro.env_threads() == want


# ----------------------------------------------------------------------------- the 15 notebooks


def _int_parameter(stem: str) -> str:
    import papermill

    spec = papermill.inspect_notebook(str(paths.NOTEBOOKS / f"{stem}.ipynb"))
    return next(n for n, p in spec.items() if p["inferred_type_name"].partition(",")[0] == "int" and n != "seed" and len(n) >= 4)


def _typo(name: str) -> str:
    i = next(i for i in range(1, len(name) - 1) if name[i] != name[i + 1])
    return name[:i] + name[i + 1] + name[i] + name[i + 2:]


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_every_notebook_rejects_a_misspelled_and_a_mistyped_parameter(stem):
    name = _int_parameter(stem)
    for history in (False, True):
        with pytest.raises(ValueError) as e:
            execute_to_check(stem, {_typo(name): 5}, history)
        assert one_line_error(e).startswith(f"unknown parameter {_typo(name)!r} for {stem}: did you mean {name!r}?")
    with pytest.raises(ValueError) as e:
        execute_to_check(stem, {name: "abc"})
    assert one_line_error(e).startswith(f"parameter {name!r} of {stem} expects int, got 'abc'")
    ns = execute_to_check(stem, {"seed": 1, "device": "cpu"})
    assert ns["run"].overrides == {"seed": 1} and ns["run"].notebook == stem and ns["device"] == "cpu"


@pytest.mark.parametrize("stem", NOTEBOOKS)
def test_papermill_reads_every_line_of_the_parameters_cell(stem):
    """papermill skips a parameter line it cannot parse (with only a warning, e.g. for ':=' in the
    comment), and lib.infra.params then neither type-checks nor lists that parameter."""
    import re

    import papermill

    nb = load_notebook_node(str(paths.NOTEBOOKS / f"{stem}.ipynb"))
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    declared = [m.group(1) for m in (re.match(r'^(\w+)\s*:\s*(?:[\w\[\]]+|"[^"]*")\s*=', line) for line in cell.source.splitlines())
                if m]
    assert declared and list(papermill.inspect_notebook(str(paths.NOTEBOOKS / f"{stem}.ipynb"))) == declared


def execute_derived(stem: str, parameters: dict) -> dict:
    """As execute_to_check, then the imports and the whole derived-configuration cell (light: names, choices, data
    sizes): the two cells after the set-up cell."""
    ns = execute_to_check(stem, parameters)
    nb = load_notebook_node(str(paths.NOTEBOOKS / f"{stem}.ipynb"))
    (ip,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.tags]
    assert "setup" in nb.cells[ip + 1].metadata.tags
    for cell in nb.cells[ip + 2:ip + 4]:
        exec(compile(cell.source, stem, "exec"), ns)
    return ns


def test_list_parameters_given_as_text_pass_the_notebooks_own_checks():
    ns = execute_derived("05_group_patching_replicates_dpo", {"conditions": "TP+TN+AP+AN"})
    assert ns["conditions"] == ["TP+TN+AP+AN"] and ns["ALL4"] == "TP+TN+AP+AN"
    ns = execute_derived("09_global_token_dependency", {"tasks": "SST-2"})
    assert ns["tasks"] == ["SST-2"]
    with pytest.raises(ValueError) as e:
        execute_derived("10_saobp_small_scale_gains", {"seeds": 0})
    assert one_line_error(e) == "parameter 'seeds' of 10_saobp_small_scale_gains must hold at least 3 items, got [0]"
    assert execute_derived("10_saobp_small_scale_gains", {"seeds": "3,4,5"})["seeds"] == [3, 4, 5]


@pytest.mark.parametrize("stem", ["02_dpo_reduces_toxicity", "03_toxic_neurons_explain_little", "04_four_neuron_groups",
                                  "05_group_patching_replicates_dpo", "06_activation_editing"])
def test_a_users_prompt_file_replaces_the_challenge_prompts(stem, tmp_path):
    """Paper A's ``prompts`` parameter: the notebook's derived configuration reads the file the test
    writes (scored prompts and statistics prompts, lib.papers.dpo.prompt_sets), is an ad-hoc run, and a file
    with too few prompts stops there with a one-line error."""
    f = tmp_path / "my_prompts.jsonl"
    f.write_text("".join(f'{{"text": "Prompt number {i} says", "id": {i}}}\n' for i in range(6)))
    def sizes(n_prompts, n_stats):
        """02 scores prompts, 04 only takes statistics; their sizes are fields of lib.papers.dpo.Sizes, given through overrides
        unless the notebook sets them itself (02, 03, 05, 06: n_prompts)"""
        if stem == "02_dpo_reduces_toxicity":
            return {"n_prompts": n_prompts}
        stats = {"overrides": {"n_stats_prompts": n_stats}}
        return stats if stem == "04_four_neuron_groups" else {"n_prompts": n_prompts, **stats}

    ns = execute_derived(stem, {"prompts": str(f), **sizes(4, 5)})
    mine = [f"Prompt number {i} says" for i in range(6)]
    if stem != "04_four_neuron_groups":
        assert ns["eval_prompts"] == mine[:4] and ns["prompt_kw"] == {"prompts": mine[:4]}
    if stem != "02_dpo_reduces_toxicity":
        assert ns["stats_prompts"] == mine[:5]
    assert "prompts" in ns["run"].overrides  # not the published run: its records go under results/<model>/runs/
    with pytest.raises(ValueError) as e:
        execute_derived(stem, {"prompts": str(f), **sizes(40, 40)})
    assert "holds 6 prompts" in one_line_error(e)
    default = execute_derived(stem, {})
    assert default.get("prompt_kw", {}) == {}  # the challenge prompts: no argument, the cached evaluations' keys stay


def test_one_candidate_relation_is_named_as_the_problem():
    from lib import data

    one = data.lre_relation_names()[0]
    for stem in ("11_relation_specific_neurons", "14_neuron_interference"):
        with pytest.raises(ValueError) as e:
            execute_derived(stem, {"candidate_relations": f"{one}, {one}"})
        msg = one_line_error(e)
        assert "names 1 relation(s)" in msg and "at least two" in msg and "larger model" not in msg


def test_papermill_run_with_a_misspelled_parameter_fails_at_the_check(tmp_path):
    """The whole path: papermill executes 00 in a kernel; the injected misspelling stops it in the
    derived-configuration cell (before any model loads)."""
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as e:
        papermill.execute_notebook(str(paths.NOTEBOOKS / "00_tour.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"n_txets": 5}, cwd=str(paths.NOTEBOOKS), progress_bar=False,
                                   kernel_name="python3")
    assert e.value.ename == "ValueError"
    assert e.value.evalue.startswith("unknown parameter 'n_txets' for 00_tour: did you mean 'n_texts'?")


def test_tour_sizes_beyond_the_data_or_the_model_stop_at_the_check(tmp_path):
    """00's n_texts beyond the Wikipedia prompts in data/ (once quietly capped) and top_k_tokens or n_neurons
    beyond the model (once a RuntimeError deep in the run): one line at params.check, naming the largest value.
    The model's bounds come from its config.json (here a local folder holding only that)."""
    from lib import data

    n_wiki = len(data.wiki_samples())
    with pytest.raises(ValueError) as e:
        execute_to_check("00_tour", {"n_texts": 100000})
    assert one_line_error(e) == (f"n_texts must be at most {n_wiki} (the Wikipedia prompts in "
                                 "data/lee2024/wiki_samples.jsonl), got 100000")
    folder = tmp_path / "small-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100, "n_layer": 2, "n_embd": 8}))
    with pytest.raises(ValueError) as e:
        execute_to_check("00_tour", {"model_name": str(folder), "top_k_tokens": 10000000})
    assert one_line_error(e) == f"top_k_tokens must be at most 100 (the vocabulary of {folder}), got 10000000"
    with pytest.raises(ValueError) as e:
        execute_to_check("00_tour", {"model_name": str(folder), "n_neurons": 65})
    assert one_line_error(e) == f"n_neurons must be at most 64 (the MLP neurons of {folder}: 2 layers x 32), got 65"
    ns = execute_to_check("00_tour", {"model_name": str(folder), "n_texts": n_wiki, "top_k_tokens": 100, "n_neurons": 64})
    assert (ns["n_texts"], ns["top_k_tokens"], ns["n_neurons"]) == (n_wiki, 100, 64)
    # a model whose config is not at hand here: its own load says so later; the check does not guess a bound
    assert execute_to_check("00_tour", {"model_name": "someone/not-cached", "top_k_tokens": 10000000})["top_k_tokens"] == 10000000


@pytest.mark.parametrize("stem", ["09_global_token_dependency", "10_saobp_small_scale_gains"])
def test_an_empty_or_misspelled_task_list_is_named_at_the_check(stem):
    from lib.papers.saobp import scratch

    for given in ([], "[]"):
        with pytest.raises(ValueError) as e:
            execute_to_check(stem, {"tasks": given})
        assert one_line_error(e) == f"tasks is empty: name at least one task, any of {', '.join(scratch.SCRATCH_TASKS)}"
    with pytest.raises(ValueError) as e:
        execute_to_check(stem, {"tasks": "sst-2,LM"})
    assert one_line_error(e).startswith("unknown tasks 'sst-2' (did you mean 'SST-2'?): use any of SST-2, ")
    assert execute_to_check(stem, {"tasks": "RTE,LM"})["tasks"] == ["RTE", "LM"]


# ----------------------------------------------------------------------------- ranges in the annotations


def test_range_clauses_parse_and_reject_what_is_not_a_clause():
    assert params.parse_clauses(" at least 1, below 10") == (("at least", 1, False), ("below", 10, False))
    assert params.parse_clauses("not empty, distinct, at least 6 items") == (
        ("at least", 1, True), ("distinct", None, True), ("at least", 6, True))
    assert params.parse_clauses("") == ()
    with pytest.raises(ValueError, match="unknown range clause 'positive'"):
        params.parse_clauses("positive")


@pytest.mark.parametrize("annotation, good, bad, message", [
    ("int, at least 1", 1, 0, "must be at least 1, got 0"),
    ("float, above 0, at most 1", 1.0, 0.0, "must be above 0, got 0.0"),
    ("float, at least 0, below 1", 0.0, 1.0, "must be below 1, got 1.0"),
    ("list[float], not empty, above 0, at most 1", [0.5, 1.0], [], "must hold at least 1 items, got []"),
    ("list[float], not empty, above 0, at most 1", [0.5], [0.5, 1.5], "must be at most 1 (each item), got [0.5, 1.5]"),
    ("list[int], distinct, at least 2 items, at least 0", [0, 1], [1, 1], "must hold distinct items, got [1, 1]"),
    ("list[int], distinct, at least 2 items, at least 0", [0, 1], [0, -1], "must be at least 0 (each item), got [0, -1]"),
])
def test_an_annotated_range_passes_its_edge_and_names_the_broken_clause(tmp_path, monkeypatch, annotation, good, bad,
                                                                        message):
    """A value on the edge of its range passes; one outside it is one line naming the parameter and the clause
    (planted in a scratch notebook whose parameters cell declares the range)."""
    monkeypatch.setattr(paths, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(paths, "PARAMS", tmp_path)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(f'x: "{annotation}" = {good!r}  # the value', metadata={"tags": ["parameters"]})]
    nbformat.write(nb, tmp_path / "01_range.ipynb")
    assert params.check({"x": good}, "01_range").values["x"] == good
    with pytest.raises(ValueError) as e:
        params.check({"x": bad}, "01_range")
    assert one_line_error(e) == f"parameter 'x' of 01_range {message}"


def test_every_numbered_notebook_declares_its_ranges_in_annotations_not_in_checks():
    """The plain range checks of the set-up live in the parameters' annotations: no notebook's derived-
    configuration cell raises on a bare 'must be a positive integer' any more, and every range clause parses."""
    import papermill

    for path in index.numbered_notebooks():
        spec = papermill.inspect_notebook(str(path))
        for name, p in spec.items():
            params.parse_clauses(p["inferred_type_name"].partition(",")[2])  # raises on a clause it cannot read
        source = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert "must be a positive integer" not in source, path.name
