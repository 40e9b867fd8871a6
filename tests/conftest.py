"""Fixtures: tiny random-weight models of every family (built from configs, no hub), on --device."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from lib import models  # noqa: E402

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
