"""Check a notebook's parameters once, in its set-up cell (``lib.nb.start`` calls :func:`check`).

The names, defaults, types and ranges come from the notebook's own ``parameters`` cell, read with
papermill's inspection API, so they are declared in one place. A range is part of the annotation, after the
type (papermill reads these annotations, and ``papermill --help-notebook`` prints them)::

    n_random: "int, at least 1" = 10  # random control sets
    k_shares: "list[float], not empty, above 0, at most 1" = [0.01, 0.05]  # shares of all units
    seeds: "list[int], distinct, at least 6 items, at least 0" = [10, 11, 12, 13, 14, 15]

Clauses: ``at least N``, ``at most N``, ``above N``, ``below N`` (whole numbers: papermill's annotations hold
letters, digits, commas and brackets only), and for lists ``not empty``, ``distinct`` and ``at least N items``;
a bound applies to each item of a list. ``check``

* rejects a name papermill injected that is not a parameter (papermill itself only warns), naming
  the closest valid one: ``unknown parameter 'n_txets' for 00_tour: did you mean 'n_texts'? (...)``;
* coerces each value to its annotated type and writes it back into the namespace: an int where a
  float is expected becomes a float; a list given as a string (``-p tasks SST-2``,
  ``-p conditions TP+TN+AP+AN``, ``-p seeds 0,1,2``, ``-p seeds "[0, 1, 2]"``) is split at commas and
  each item converted to the element type of the default; a single number where a list is expected
  becomes a one-element list (``-p seeds 0`` -> ``[0]``); anything else of the wrong type is one
  line naming the parameter, the expected type and the value;
* checks each value against its annotation's range, then against the ``bounds`` its caller gives for the
  values whose limits the data, the model or a paper's code set (00's ``n_texts`` at most the Wikipedia
  prompts in data/, 09's ``tasks`` from paper B's tasks), before anything heavy runs; every failure is one
  line naming the parameter, the rule and the value;
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

from lib.infra import index, paths
from lib.infra.cache import atomic_write_text

# Parameters that choose how a run executes, not what it computes, in every notebook: a run that differs from the
# published settings only in these (and in its notebook's own, config/notebooks.yaml's `neutral`) is still the
# published run.
NEUTRAL = {
    "model_name": "every model has its own published run: its folder is results/<model>/",
    "device": "where it runs (cpu, cuda)",
    "device_map": "how params/<model>.yaml spreads a large model over the GPUs",
}

_LITERAL = (str, int, float, bool, type(None), list, dict, tuple)
_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "tuple": tuple, "dict": dict}


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
    published: bool = True  # True when overrides is empty and the run publishes (lib.infra.paths.publishing)
    key: str = ""  # 12 hex digits hashing the sorted overrides, "default" for an unpublished default run, "" when published

    def results_dir(self) -> Path:
        """results/<model>/ for the published run, else results/<model>/runs/<key>/ (with overrides.json)."""
        if self.published:
            return paths.results_dir(self.model_name)
        d = paths.RESULTS / paths.slug(self.model_name) / "runs" / self.key
        d.mkdir(parents=True, exist_ok=True)
        note = d / "overrides.json"
        if not note.exists():  # what the key stands for, written once
            atomic_write_text(note, json.dumps(self.overrides, indent=1, sort_keys=True, default=repr) + "\n")
        return d

    def figures_dir(self) -> Path:
        """figures/<model>/ for the published run, else results/<model>/runs/<key>/figures/."""
        if self.published:
            return paths.figures_dir(self.model_name)
        d = self.results_dir() / "figures"
        d.mkdir(parents=True, exist_ok=True)
        return d


def neutral(notebook: str) -> set[str]:
    """The names that choose how ``notebook`` runs, not what it computes: :data:`NEUTRAL` and its own (the index)."""
    return set(NEUTRAL) | set(index.neutral(notebook[:2]))


def check(namespace: dict, notebook: str, bounds: dict | None = None, registry_name: str | None = None) -> Run:
    """Check the parameters of ``notebook`` (its stem) as they stand in ``namespace`` (the notebook's
    ``globals()``): unknown injected names, wrong types and values outside their annotated range raise a
    one-line ValueError; coerced values are written back. ``bounds``: parameter -> check(name, value, every
    parameter's value), run after the types and ranges, which raises a one-line ValueError. ``registry_name``:
    the model's registry name when ``model_name`` is an alias of it (params/<registry name>.yaml applies).
    Returns the :class:`Run`: where the notebook's figures and ledger records go."""
    spec = _parameters(notebook)
    model_name = namespace.get("model_name", spec.get("model_name", (None, None))[1])
    settings = _model_settings(model_name, registry_name)  # params/<model>.yaml: also names the notebook lacks

    unknown = sorted(_injected(namespace, notebook) - set(spec) - set(settings))
    if unknown:
        raise ValueError(_unknown_message(unknown, sorted(spec), notebook))

    values, published = {}, {}
    for name, (typ, default, clauses) in spec.items():
        if default is not _NOT_LITERAL:
            default = _coerce(name, default, typ, default, notebook)  # e.g. a float parameter written as 1
        values[name] = _coerce(name, namespace[name], typ, default, notebook) if name in namespace else default
        _check_clauses(name, values[name], clauses, notebook)
        namespace[name] = values[name]
        published[name] = _coerce(name, settings[name], typ, default, f"{notebook} (params/<model>.yaml)") \
            if name in settings else default
    unknown_bounds = sorted(set(bounds or {}) - set(values))
    if unknown_bounds:
        raise ValueError(f"bounds for {', '.join(unknown_bounds)}: not parameters of {notebook}")
    for name, check_value in (bounds or {}).items():
        check_value(name, values[name], values)
    skip = neutral(notebook)
    overrides = {k: v for k, v in values.items() if k not in skip and not _same(v, published[k])}
    publishes = not overrides and paths.publishing()
    key = hashlib.sha256(json.dumps(sorted(overrides.items()), default=repr).encode()).hexdigest()[:12] \
        if overrides else ("" if publishes else "default")
    run = Run(notebook, str(values.get("model_name", model_name)), values, overrides, publishes, key)
    if not publishes and paths.outputs_dir() is None:
        where = paths.RESULTS / paths.slug(run.model_name) / "runs" / key
        where = where.relative_to(paths.ROOT) if where.is_relative_to(paths.ROOT) else where
        why = f"non-default parameters {overrides}" if overrides else \
            f"published parameters, not a publishing run (make reproduce NOTEBOOKS={notebook[:2]} publishes)"
        print(f"{why}: this run writes its figures and ledger to {where}/, not to the published ones")
    return run


# ----------------------------------------------------------------------------- the parameters cell


def _parameters(notebook: str) -> dict[str, tuple[tuple, object, tuple]]:
    """name -> ((type, element type), default, range clauses) from the notebook's parameters cell (papermill)."""
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
        annotation, _, rest = str(p["inferred_type_name"] or "").partition(",")
        if annotation.strip() == "None":  # papermill's word for no annotation
            annotation = ""
        try:
            clauses = parse_clauses(rest)
        except ValueError as e:
            raise ValueError(f"parameter {name!r} of {notebook}: {e}") from None
        out[name] = (_annotated_type(annotation, default), default, clauses)
    return out


_CLAUSE = re.compile(r"(at least|at most|above|below) (\d+)( items)?|not empty|distinct")
_OPS = {"at least": (lambda v, n: v >= n), "at most": (lambda v, n: v <= n), "above": (lambda v, n: v > n),
        "below": (lambda v, n: v < n)}


def parse_clauses(text: str) -> tuple:
    """The range clauses after an annotation's type ('at least 1, below 10' -> (('at least', 1, False),
    ('below', 10, False))); 'not empty' is ('at least', 1, True): at least 1 item."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _CLAUSE.fullmatch(part)
        if m is None:
            raise ValueError(f"unknown range clause {part!r} (use at least N, at most N, above N, below N, "
                             f"not empty, distinct, at least N items)")
        if part == "not empty":
            out.append(("at least", 1, True))
        elif part == "distinct":
            out.append(("distinct", None, True))
        else:
            out.append((m.group(1), int(m.group(2)), bool(m.group(3))))
    return tuple(out)


def _clause_text(clause: tuple) -> str:
    """'be at least 1', 'hold at least 3 items', 'hold distinct items'."""
    op, n, items = clause
    return "hold distinct items" if op == "distinct" else f"hold {op} {n} items" if items else f"be {op} {n}"


def _check_clauses(name: str, value, clauses: tuple, notebook: str) -> None:
    """One-line ValueError where ``value`` breaks a clause (a bound applies to each item of a list)."""
    for clause in clauses:
        op, n, items = clause
        if value is None:
            return
        if op == "distinct":
            ok = len(set(value)) == len(value)
        elif items:
            ok = _OPS[op](len(value), n)
        else:
            ok = all(_OPS[op](v, n) for v in (value if isinstance(value, (list, tuple)) else [value]))
        if not ok:
            each = " (each item)" if isinstance(value, (list, tuple)) and not items and op != "distinct" else ""
            raise ValueError(f"parameter {name!r} of {notebook} must {_clause_text(clause)}{each}, got {value!r}")


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


def _model_settings(model_name, registry_name: str | None = None) -> dict:
    """params/<model>.yaml for the model's registry name (``registry_name``, e.g. 'smollm2-135m' for its hub id),
    else for ``model_name`` ({} when there is none)."""
    if not isinstance(model_name, str) or not model_name.strip():
        return {}
    return (index.params_settings(registry_name) if registry_name else {}) or index.params_settings(model_name)


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
