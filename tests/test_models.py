import json
from pathlib import Path

import pytest
import torch

from lib import models


def test_registry_names_resolve():
    for name in models.available():
        spec = models.resolve_spec(name)
        assert spec.name == name
        assert models.resolve_spec(spec.hub_id).name == name  # hub ids map to the same entry


@pytest.mark.parametrize("bad", ["", "no-such-model", "./missing/folder"])
def test_unknown_model_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="model"):
        models.resolve_spec(bad)


@pytest.mark.parametrize("bad", ["gpu", "cuda0", "tpu"])
def test_unknown_device(bad):
    with pytest.raises(ValueError, match="device"):
        models.resolve_device(bad)


def test_bad_dtype_and_task():
    with pytest.raises(ValueError, match="dtype"):
        models.resolve_dtype("float8", "cpu")
    with pytest.raises(ValueError, match="task"):
        models.load("minilm-l6", task="translation")


def test_offline_uncached_model_fails_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(models.ModelUnavailableError, match="gpt2-medium.*`hf download openai-community/gpt2-medium`"):
        models.load("gpt2-medium")


@pytest.mark.parametrize("family", models.FAMILIES)
def test_tiny_models_round_trip_through_load(family, tmp_path):
    """The on-disk path used for downloaded models: save_pretrained, then models.load(folder)."""
    ref = models.tiny_random(family)
    lm = models.tiny_random(family, folder=tmp_path / family)
    info = lm.info
    assert info.family == family and info.n_layers == 2 and info.d_mlp == 64 and info.d_model == 32
    assert lm.mlp_out_module(1) is not None and lm.attention_module(0) is not None
    enc = ref.tokenizer(["hello world"], return_tensors="pt")
    a = ref.model(**enc)[0]
    b = lm.model(**enc)[0]
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="layer"):
        info.check_layer(2)
    with pytest.raises(ValueError, match="neuron"):
        info.check_neuron(64)


def _fake_hub_cache(cache: Path, hub_id: str, folder: Path) -> None:
    """Lay out a saved folder the way huggingface_hub caches a download."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.mark.parametrize("name,family", [("gpt2-medium", "gpt2"), ("gemma-2-2b", "gemma2"),
                                         ("mistral-7b", "mistral"), ("llama-3.1-8b", "llama"),
                                         ("bert-base", "bert")])
def test_hub_names_load_from_the_hf_cache(name, family, tmp_path, monkeypatch):
    """The papers' models load by short name from the Hugging Face cache (here: tiny stand-ins)."""
    models.tiny_random(family, folder=tmp_path / "src")
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, models.REGISTRY[name].hub_id, tmp_path / "src")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    lm = models.load(name, device="cpu")
    assert lm.info.family == family and lm.name == name
    if name == "gemma-2-2b":
        assert lm.model.config._attn_implementation == "eager"


def test_embedded_decoder_is_cached_safetensors():
    folder = models.prepare_embedded("smollm2-135m")
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert (folder / "model.safetensors").exists()


def test_embedded_encoder_loads():
    lm = models.load("minilm-l6", device="cpu")
    assert lm.info.family == "bert" and lm.info.n_layers == 6 and lm.info.d_model == 384
    assert lm.info.n_heads == 12 and lm.info.d_mlp == 1536


def test_unsupported_model_type_is_a_clear_error():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="'opt' is not supported"):
        models.info_from_model(SimpleNamespace(config=SimpleNamespace(model_type="opt")))


def test_device_map_argument_and_its_environment_fallback(tmp_path, monkeypatch):
    """load(device_map=...) is the parameter; COMPENDIUM_DEVICE_MAP (set by lib.infra.runner) is only the
    fallback when none is passed, and never overrides an explicit cpu / mps / cuda:N device."""
    models.tiny_random("llama", folder=tmp_path / "m")
    monkeypatch.delenv(models.DEVICE_MAP_ENV, raising=False)
    assert models.default_device_map() is None
    assert models.load(str(tmp_path / "m"), device="cpu").device_map is None
    lm = models.load(str(tmp_path / "m"), device_map="cpu")
    assert lm.device_map == "cpu" and lm.device == "cpu"
    monkeypatch.setenv(models.DEVICE_MAP_ENV, "cpu")
    assert models.default_device_map("auto") == models.default_device_map("cuda") == "cpu"
    assert models.default_device_map("cpu") is None and models.default_device_map("cuda:1") is None
    assert models.load(str(tmp_path / "m"), device="cpu").device_map is None  # explicit device kept
    assert models.load(str(tmp_path / "m")).device_map == "cpu"  # the fallback
    monkeypatch.setenv(models.DEVICE_MAP_ENV, "")
    assert models.default_device_map() is None
