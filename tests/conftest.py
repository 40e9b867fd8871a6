"""Fixtures: tiny random-weight models of every family (built from configs, no hub), on --device."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

import tempfile  # noqa: E402

from lib import models  # noqa: E402
from lib.infra import paths, store

# The measurement store of the tests: never the repository's results/, never make test's strict mode or audit
# (module-scoped fixtures write here; each test gets an empty store of its own, see below)
os.environ[store.STORE_ENV] = tempfile.mkdtemp(prefix="compendium-test-store-")
for _var in (store.RECORDS_ENV, store.AUDIT_PLAN_ENV, store.AUDIT_LOG_ENV):
    os.environ.pop(_var, None)
# Figures and ledger records of the notebooks the tests run (in kernels that inherit this) stay out of the tree
os.environ[paths.OUTPUTS_ENV] = tempfile.mkdtemp(prefix="compendium-test-outputs-")


@pytest.fixture(autouse=True)
def own_store(tmp_path, monkeypatch):
    """Each test: an empty measurement store (COMPENDIUM_STORE), records computed as needed ('use'), no notebook named."""
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "store"))
    monkeypatch.delenv(store.RECORDS_ENV, raising=False)
    monkeypatch.delenv(store.NOTEBOOK_ENV, raising=False)
    return tmp_path / "store"

FAMILIES = list(models.FAMILIES)
DECODERS = [f for f in FAMILIES if f != "bert"]


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="device for the tiny models (cpu, cuda, ...)")


@pytest.fixture(scope="session")
def device(request):
    return models.resolve_device(request.config.getoption("--device"))


def _tiny_on(family, device):
    loaded = models.tiny_random(family)
    loaded.model.to(device)
    loaded.device = device
    return loaded


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, device):
    """A tiny random model of each family (GPT-2, Llama, Gemma-2, Mistral, BERT)."""
    return _tiny_on(request.param, device)


@pytest.fixture(scope="module", params=DECODERS)
def tiny_decoder(request, device):
    """A tiny random decoder of each family."""
    return _tiny_on(request.param, device)


@pytest.fixture
def texts():
    return ["the cat sat on the mat", "a b", "hello there my friend , how are you today ?", "one"]
