import json

import pytest
import torch

from lib import cache, paths, plotting, results


@pytest.fixture
def tmp_project(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(paths, "FIGURES", tmp_path / "figures")
    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    return tmp_path


def test_record_and_claims(tmp_project):
    results.record("m/x", "01_demo", "a finding", "0.5", "0.4", "partly holds", numbers={"x": torch.tensor(0.4)})
    results.record("m/x", "01_demo", "a finding", "0.5", "0.45", "holds")  # replaced, not duplicated
    doc = json.loads((tmp_project / "results" / "m--x" / "01_demo.json").read_text())
    assert len(doc["findings"]) == 1 and doc["findings"][0]["ours"] == "0.45"
    text = results.write_claims("m/x").read_text()
    assert "| 01_demo | a finding | 0.5 | 0.45 | **holds** |" in text
    with pytest.raises(ValueError, match="verdict"):
        results.record("m", "01", "f", "p", "o", "passes")


def test_cache_builds_once_and_writes_atomically(tmp_project):
    calls = []

    def build():
        calls.append(1)
        return {"w": torch.ones(3)}
    a = cache.get_or_build("probe", "m", {"n": 1}, build)
    b = cache.get_or_build("probe", "m", {"n": 1}, build)
    assert len(calls) == 1 and torch.equal(a["w"], b["w"])
    cache.get_or_build("probe", "m", {"n": 2}, build)
    assert len(calls) == 2
    with pytest.raises(RuntimeError):
        cache.atomic_save(1, tmp_project / "cache" / "broken.pt", save=lambda o, p: (_ for _ in ()).throw(RuntimeError()))
    assert not (tmp_project / "cache" / "broken.pt").exists()
    assert not list((tmp_project / "cache").glob(".broken*"))


def test_figures_are_saved_per_model(tmp_project):
    import matplotlib.pyplot as plt
    plotting.setup()
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    p = plotting.save(fig, "org/model", "00_line")
    assert p == tmp_project / "figures" / "org--model" / "00_line.png" and p.stat().st_size > 0
    with pytest.raises(ValueError):
        plotting.save(fig, "m", "a/b")
