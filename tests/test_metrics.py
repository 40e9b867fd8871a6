import math

import numpy as np
import pytest
import torch

from lib import hooks, metrics


def test_uniform_attention_has_maximal_entropy():
    b, h, n = 2, 3, 5
    probs = torch.full((b, h, n, n), 1 / n)
    raw, norm = metrics.attention_entropy(probs)
    torch.testing.assert_close(raw, torch.full((b, h), math.log(n)))
    torch.testing.assert_close(norm, torch.ones(b, h))
    onehot = torch.eye(n).expand(b, h, n, n)
    raw, norm = metrics.attention_entropy(onehot)
    assert float(raw.abs().max()) < 1e-6 and float(norm.abs().max()) < 1e-6


def test_entropy_respects_causal_mask_and_padding():
    n = 4
    valid = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    probs = valid.float() / valid.float().sum(-1, keepdim=True)  # uniform over the allowed keys
    raw, norm = metrics.attention_entropy(probs, valid)
    expected = np.mean([math.log(k) for k in range(1, n + 1)])
    assert abs(float(raw) - expected) < 1e-6
    assert abs(float(norm) - 1.0) < 1e-6  # the first query (one key) is skipped in the normalised mean
    raw2, _ = metrics.attention_entropy(probs, valid, query_mask=torch.tensor([[0, 1, 1, 1]]))
    assert abs(float(raw2) - np.mean([math.log(k) for k in range(2, n + 1)])) < 1e-6


def test_average_precision_of_a_planted_neuron_is_one():
    rng = np.random.default_rng(0)
    y = np.array([1] * 20 + [0] * 30)
    scores = rng.normal(size=(50, 4))
    scores[:, 2] = y * 5 + rng.uniform(0, 1, 50)  # separates the classes perfectly
    ap = metrics.average_precision(scores, y)
    assert ap.shape == (4,) and ap[2] == 1.0 and (ap[[0, 1, 3]] < 1).all()
    with pytest.raises(ValueError, match="both"):
        metrics.average_precision(scores, np.ones(50))


def test_f1_bag_of_tokens():
    assert metrics.f1_bag_of_tokens([1, 2, 3], [1, 2, 3]) == 1.0
    assert metrics.f1_bag_of_tokens([1, 1, 2], [1, 3]) == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert metrics.f1_bag_of_tokens([], [1]) == 0.0


def test_toxicity_scores_are_probabilities():
    scores, name = metrics.toxicity(["have a lovely day", "you are a fucking idiot", ""])
    assert name in ("profanity-check", "detoxify")
    assert scores.shape == (3,) and ((0 <= scores) & (scores <= 1)).all()
    assert scores[1] > scores[0]
    with pytest.raises(ValueError, match="scorer"):
        metrics.toxicity(["x"], scorer="perspective")


def test_batched_generation_equals_one_by_one(tiny_decoder):
    prompts = ["the cat", "a much longer prompt with several words in it", "hello"]
    batched = metrics.generate(tiny_decoder, prompts, max_new_tokens=5, batch_size=3, progress=False)
    single = [metrics.generate(tiny_decoder, [p], max_new_tokens=5, batch_size=1, progress=False) for p in prompts]
    assert batched.new_ids == [s.new_ids[0] for s in single]
    assert all(len(ids) <= 5 for ids in batched.new_ids)
    with pytest.raises(ValueError, match="max_new_tokens"):
        metrics.generate(tiny_decoder, prompts, max_new_tokens=0)


def test_generation_truncates_prompts(tiny_decoder):
    g = metrics.generate(tiny_decoder, ["one two three four five six seven"], max_new_tokens=2,
                         max_prompt_tokens=3, progress=False)
    assert len(g.prompt_ids[0]) == 3


def test_perplexity_single_window_equals_exp_loss(tiny_decoder):
    text = "the quick brown fox jumps over the lazy dog"
    ppl = metrics.perplexity(tiny_decoder, [text], window=64, stride=64, progress=False)
    ids = torch.tensor([tiny_decoder.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        loss = tiny_decoder.model(input_ids=ids, labels=ids).loss
    assert ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)
    # strided windows score every token once; with full context they agree closely
    ppl2 = metrics.perplexity(tiny_decoder, [text], window=8, stride=4, progress=False)
    assert ppl2 > 1 and math.isfinite(ppl2)
    with pytest.raises(ValueError, match="stride"):
        metrics.perplexity(tiny_decoder, [text], window=4, stride=8)


def test_generation_refuses_encoders():
    from lib import models
    with pytest.raises(ValueError, match="encoder"):
        metrics.generate(models.tiny_random("bert"), ["x"])


def test_perplexity_bar_total_is_the_windows_scored(tiny_decoder, monkeypatch):
    """The bar's total is the number of windows actually scored (it froze at 6/8 when the loop stopped early)."""
    from lib.infra import repro

    seen = {}

    def recording_bar(iterable, **kwargs):
        items = list(iterable)
        seen["total"], seen["done"] = len(items), 0
        for x in items:
            seen["done"] += 1
            yield x

    monkeypatch.setattr(repro, "bar", recording_bar)
    text = " ".join(["the cat sat on the mat"] * 10)
    metrics.perplexity(tiny_decoder, [text], window=16, stride=4)
    assert seen["total"] == seen["done"] > 1


def test_progress_switch(monkeypatch):
    from lib.infra import repro

    monkeypatch.delenv(repro.PROGRESS_ENV, raising=False)
    assert repro.progress_on() and not repro.bar(range(2)).disable
    assert repro.bar(range(2), progress=False).disable
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv(repro.PROGRESS_ENV, off)
        assert not repro.progress_on() and repro.bar(range(2)).disable
    monkeypatch.setenv(repro.PROGRESS_ENV, "maybe")
    with pytest.raises(ValueError, match="COMPENDIUM_PROGRESS"):
        repro.progress_on()
    assert repro.quiet_env()[repro.PROGRESS_ENV] == "0"


def test_library_bars_silence_trl_and_restore_the_environment(monkeypatch):
    """With bars off, library_bars sets TQDM_DISABLE (TRL's precompute bar reads it) and puts back what was there."""
    import os

    from lib.infra import repro

    monkeypatch.delenv(repro.PROGRESS_ENV, raising=False)
    for before in (None, ""):
        if before is None:
            monkeypatch.delenv("TQDM_DISABLE", raising=False)
        else:
            monkeypatch.setenv("TQDM_DISABLE", before)
        with repro.library_bars(progress=False):
            assert os.environ["TQDM_DISABLE"] == "1"
        assert os.environ.get("TQDM_DISABLE") == before
        with repro.library_bars(progress=True):
            assert os.environ.get("TQDM_DISABLE") == before


def _planted_frames(n: int, seed: int, planted: bool):
    """Davidson- and Jigsaw-shaped frames whose toxic rows use other words than the rest (planted),
    or the same words with labels at random (no effect to find)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    calm = ["river", "garden", "window", "table", "music", "bread", "cloud"]
    rude = ["idiot", "stupid", "hate", "ugly", "moron", "trash", "loser"]
    rows = []
    for i in range(n):
        y = int(i % 2)
        words = rude if (y and planted) else calm
        rows.append((" ".join(rng.choice(words, size=6)), y if planted else int(rng.integers(2))))
    tweets = pd.DataFrame({"tweet": [f"RT @user{i}: {t} &amp;" for i, (t, _) in enumerate(rows)],
                           "toxic": [y for _, y in rows]})
    comments = pd.DataFrame({"comment_text": [t for t, _ in rows], "toxic": [y for _, y in rows]})
    return tweets, comments


@pytest.mark.parametrize("planted", [True, False])
def test_embedding_scorer_finds_a_planted_vocabulary_and_nothing_in_shuffled_labels(planted, tmp_path, monkeypatch):
    """The second toxicity scorer (metrics.EMBEDDING_SCORER) on a tiny random BERT: it must separate
    texts whose toxic class uses other words (held-out AUC near 1) and must not when the labels are
    random; scores are probabilities, a text without words scores 0, and the fit is cached."""
    from lib import data, models
    from lib.infra import paths

    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    tweets, comments = _planted_frames(80, 0, planted)
    monkeypatch.setattr(data, "davidson_tweets", lambda: tweets)
    monkeypatch.setattr(data, "jigsaw_sample", lambda: comments)
    monkeypatch.setitem(metrics._ENCODERS, "tiny-bert", models.tiny_random("bert"))
    monkeypatch.setattr(metrics, "_SCORERS", {})
    scorer = metrics.embedding_scorer(n_davidson_per_class=30, encoder="tiny-bert", max_length=16)
    assert set(scorer.auc) == {"davidson", "jigsaw"} and scorer.n_test == {"davidson": 12, "jigsaw": 40}
    if planted:
        assert min(scorer.auc.values()) > 0.9
    else:
        assert max(scorer.auc.values()) < 0.8
    p = scorer.score(["idiot stupid hate", "river garden table", "", " ... "])
    assert p.shape == (4,) and ((0 <= p) & (p <= 1)).all() and p[2] == p[3] == 0
    if planted:
        assert p[0] > p[1]
    monkeypatch.setattr(metrics, "_SCORERS", {})
    again = metrics.embedding_scorer(n_davidson_per_class=30, encoder="tiny-bert", max_length=16)  # from the cache
    np.testing.assert_array_equal(again.score(["idiot stupid hate"]), scorer.score(["idiot stupid hate"]))
    assert metrics._plain_tweet("RT @someone: you &amp; me http://t.co/x &#128514;") == "you me"


def test_rescored_splits_one_batch_back_into_evaluations():
    from lib.papers import dpo

    evs = [{"continuations": ["a fine day", "you idiot"]}, {"continuations": []}, {"continuations": ["shit happens"]}]
    parts = dpo.rescored(evs, "profanity-check")
    assert [len(p) for p in parts] == [2, 0, 1]
    direct, _ = metrics.toxicity(["a fine day", "you idiot", "shit happens"], "profanity-check")
    np.testing.assert_array_equal(np.concatenate(parts), direct)


def test_distinct_n_counts_repetition():
    from lib import metrics

    d = metrics.distinct_n(["a b c d", "about about about about about", "one", "x y x y x y"], n=2)
    assert d[0] == 1.0 and d[1] == pytest.approx(1 / 4) and d[2] == 1.0 and d[3] == pytest.approx(2 / 5)
    assert metrics.distinct_n(["a b a b"], n=1)[0] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        metrics.distinct_n(["a"], n=0)
