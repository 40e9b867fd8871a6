"""The compendium as a Snakemake workflow: one job per numbered notebook x model.

    make reproduce                                  # default models on the local cores
    make reproduce MODEL=gpt2-medium                # one model's grid
    .venv/bin/snakemake -n --forceall --config run=all   # list the full grid without running it
    .venv/bin/snakemake --profile profiles/slurm        # the full grid on a SLURM cluster

Each job runs ``python -m lib run notebooks/<nb>.ipynb --model <model> --atomic``, which
writes results/<model>/<nb>.ipynb (only when the notebook ran through: see lib/infra/runner.py) and
results/<model>/timings/<nb>.json. The artifacts the notebooks share live in the cache (.cache/,
COMPENDIUM_CACHE); the executed notebook that builds an artifact is an input of the notebooks that
reuse it (NEEDS below), so the order is explicit and a changed notebook re-runs what depends on it.
Models and resources: config/models.yaml; per-model notebook parameters: params/<model>.yaml.
See docs/workflow.md.
"""
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(workflow.basedir)
sys.path.insert(0, str(ROOT))
from lib.infra import index, paths  # noqa: E402

configfile: str(ROOT / "config" / "models.yaml")

# Real runs work in the repository root (lib.infra.runner writes to <root>/results); the workflow tests
# point `notebooks_dir` and `workdir` at a scratch folder for a dry run.
workdir: config.get("workdir", str(ROOT))

PY = shlex.quote(sys.executable)  # the Python that runs Snakemake (the compendium's venv)
NB_DIR = Path(config.get("notebooks_dir", ROOT / "notebooks")).resolve()
PARAMS_DIR = ROOT / "params"

NUMBERED = re.compile(r"^(\d\d)_[a-z0-9_]+$")
NOTEBOOKS = {p.stem: p for p in sorted(NB_DIR.glob("*.ipynb")) if NUMBERED.match(p.stem)}
BY_NUMBER = {stem[:2]: stem for stem in NOTEBOOKS}
# Which notebooks' executed copies (and so their cached artifacts) each notebook needs, by number: the index
# config/notebooks.yaml (lib.infra.index), which `make test` (tests/Snakefile) reads too. A notebook not written yet
# is replaced by what it would itself need.
WAITS = index.waits(sorted(BY_NUMBER))

# ----------------------------------------------------------------------------- the grid


def default_model(stem):
    """The notebook's own default model_name (its parameters cell)."""
    defaults = index.parameter_defaults(NOTEBOOKS[stem])
    if "model_name" not in defaults:
        raise ValueError(f"{NOTEBOOKS[stem]} has no literal model_name in a cell tagged 'parameters'")
    return str(defaults["model_name"])


DEFAULTS = {stem: default_model(stem) for stem in NOTEBOOKS}  # each notebook's own model
MODELS = config.get("models") or {}


def paper_notebooks(model):
    numbers = {n for paper in MODELS[model]["papers"] for n in config["papers"][paper]}
    return [stem for stem in NOTEBOOKS if stem[:2] in numbers]


def canonical(name):
    """A paper model given by its Hugging Face id ('meta-llama/Llama-2-7b-hf') -> its short name."""
    from lib import models

    try:
        short = models.resolve_spec(name).name
    except ValueError:
        return name
    return short if short in MODELS else name


def grid(selection):
    """(model name, notebook stem) pairs for a `run` selection (see config/models.yaml)."""
    pairs = []
    for part in [s.strip() for s in str(selection).split(",") if s.strip()]:
        if part in ("default", "all"):
            pairs += [(m, stem) for stem, m in DEFAULTS.items()]
        if part in ("papers", "all"):
            pairs += [(m, stem) for m in MODELS for stem in paper_notebooks(m)]
        if part in ("default", "papers", "all"):
            continue
        part = canonical(part)
        if part in MODELS:
            pairs += [(part, stem) for stem in paper_notebooks(part)]
        elif part in DEFAULTS.values():
            pairs += [(part, stem) for stem, m in DEFAULTS.items() if m == part]
        else:
            pairs += [(part, stem) for stem in NOTEBOOKS]
    return list(dict.fromkeys(pairs))


def only_numbers(value):
    """The notebook numbers of `--config only=...` (make reproduce NOTEBOOKS=...) as two-digit strings.
    Snakemake reads `only=00` as the integer 0 and `only=07` as 7, so ints are zero-padded; a list
    (`only='[0, 7]'`) and a comma-separated string ("00,07") both work. An unknown number fails here."""
    parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
    numbers = []
    for p in parts:
        p = str(p).strip().strip("\"'")
        if not p:
            continue
        if not p.isdigit() or len(p) > 2:
            raise ValueError(f"NOTEBOOKS / only={value!r}: {p!r} is not a notebook number (use e.g. 00,07)")
        numbers.append(p.zfill(2))
    unknown = sorted(set(numbers) - set(BY_NUMBER))
    if unknown:
        raise ValueError(f"NOTEBOOKS / only={value!r}: no numbered notebook {', '.join(unknown)} in {NB_DIR} "
                         f"(have {', '.join(sorted(BY_NUMBER))})")
    return set(numbers)


GRID = grid(config.get("run", "default"))
# only=01,02: these notebooks alone, each reading the records and the cache (what a notebook lacks it measures
# itself), publishing only their figures and ledger rows; the notebooks they depend on in a full run do not run
ONLY = None
if config.get("only") not in (None, "", []):
    ONLY = only_numbers(config["only"])
    GRID = [(m, stem) for m, stem in GRID if stem[:2] in ONLY]
# Model names by their results/ folder (a Hugging Face id 'org/name' becomes 'org--name').
NAMES = {paths.slug(m): m for m in list(DEFAULTS.values()) + list(MODELS) + [m for m, _ in GRID]}
RUN_MODELS = list(dict.fromkeys(paths.slug(m) for m, _ in GRID))
# Column order of results/claims.md: default models, the papers' models, then anything else.
ORDER = list(dict.fromkeys([paths.slug(m) for m in DEFAULTS.values()] + [paths.slug(m) for m in MODELS]))


def resources(model, key):
    res = {**config.get("default_resources", {}), **(MODELS.get(model, {}).get("resources") or {})}
    return res.get(key)


def res(key, fallback=None):
    return lambda wc: resources(NAMES[wc.model], key) or fallback


# Every resource key that config/models.yaml sets anywhere (SLURM plugin names such as gpu_model,
# slurm_partition or constraint included); a model without a value leaves the key unset.
RESOURCE_KEYS = sorted({k for r in [config.get("default_resources") or {}]
                        + [(spec or {}).get("resources") or {} for spec in MODELS.values()] for k in r}
                       - {"gpu", "cpus_per_task", "mem_mb", "runtime"})
EXTRA_RESOURCES = {k: res(k) for k in RESOURCE_KEYS}


wildcard_constraints:
    model=r"[A-Za-z0-9._-]+",
    nb=r"\d\d_[a-z0-9_]+",

localrules: all, model_weights, claims, merge_claims


rule all:
    input:
        [f"results/{paths.slug(m)}/{stem}.ipynb" for m, stem in GRID],
        [f"results/{m}/claims.md" for m in RUN_MODELS],
        "results/claims.md",


rule model_weights:
    """Resolve the model's weights once, on the submitting host (it has the network a cluster's
    compute nodes often lack): the embedded models are converted, hub models downloaded to the
    Hugging Face cache. Gated models need `hf auth login` (or HF_TOKEN) first."""
    output:
        "results/{model}/model_dir.txt",
    params:
        name=lambda wc: NAMES[wc.model],
    shell:
        "{PY} -c 'import sys; from lib import models; print(models.model_dir(sys.argv[1]))' {params.name:q} > {output:q}"


rule notebook:
    """Execute one notebook for one model with papermill (lib.infra.runner)."""
    input:
        notebook=lambda wc: NOTEBOOKS[wc.nb],
        weights=ancient("results/{model}/model_dir.txt"),  # fetched once; not a reason to re-run
        needs=lambda wc: [] if ONLY else [f"results/{wc.model}/{BY_NUMBER[d]}.ipynb" for d in WAITS[wc.nb[:2]]],
        params=lambda wc: [str(p) for p in [PARAMS_DIR / f"{wc.model}.yaml"] if p.exists()],
    output:
        "results/{model}/{nb}.ipynb",
    log:
        "results/{model}/logs/{nb}.log",
    params:
        name=lambda wc: NAMES[wc.model],
        device=f"--device {shlex.quote(str(config['device']))}" if config.get("device") else "",
    # config job_threads (make reproduce: 1) runs a local job at that many threads, so 2 cores run two notebooks
    # side by side; a cluster job gets its model's cpus_per_task
    threads: lambda wc: int(config.get("job_threads") or 0) or resources(NAMES[wc.model], "cpus_per_task") or 2
    resources:
        gpu=res("gpu", 0),
        cpus_per_task=res("cpus_per_task", 2),
        mem_mb=res("mem_mb", 8000),
        runtime=res("runtime", 60),
        **EXTRA_RESOURCES,
    shell:
        "cd {ROOT} && COMPENDIUM_THREADS={threads} {PY} -m lib run {input.notebook:q} --model {params.name:q} --atomic "
        "{params.device} > {log:q} 2>&1"


rule claims:
    """results/<model>/claims.md from the findings the model's notebooks recorded."""
    input:
        lambda wc: [f"results/{wc.model}/{stem}.ipynb" for m, stem in GRID if paths.slug(m) == wc.model],
    output:
        "results/{model}/claims.md",
    params:
        name=lambda wc: NAMES[wc.model],
        only=f"--notebooks {','.join(sorted(ONLY))}" if ONLY else "",  # a subset publishes only its own rows
    shell:
        "cd {ROOT} && {PY} -m lib claims --model {params.name:q} {params.only}"


rule merge_claims:
    """results/claims.md: every model's verdicts side by side (models run earlier stay in the table)."""
    input:
        [f"results/{m}/claims.md" for m in RUN_MODELS],
    output:
        "results/claims.md",
    run:
        from lib.infra.results import merge_claims, models_with_records
        from lib.infra.runner import write_readme  # noqa: E402

        have = set(models_with_records())
        merge_claims([m for m in ORDER if m in have] + sorted(have - set(ORDER)))
        write_readme()  # README's findings table, from the same ledgers
