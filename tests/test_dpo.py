"""lib.papers.dpo on tiny random models: probe, steering hook, preference pairs, DPO steps, evaluation, cache."""
import numpy as np
import pytest
import torch

from lib import hooks, metrics, models
from lib.infra import paths, store
from lib.papers import dpo
from lib.papers.dpo import evaluation, training
from lib.papers.dpo import neurons as dpo_neurons
from lib.papers.dpo import shared_setup as dpo_setup


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "CACHE", tmp_path / "cache")
    yield
    torch.set_grad_enabled(True)  # other test modules run with the default


@pytest.fixture(scope="module")
def llama():
    lm = models.tiny_random("llama")
    lm.tokenizer.eos_token = "[SEP]"  # the MiniLM tokenizer has no EOS; DPO appends one to completions
    return lm


def _planted(n=40, seed=0):
    """Two classes of texts that differ in vocabulary: separable for any reasonable feature map."""
    rng = np.random.default_rng(seed)
    a = ["apple", "river", "green", "house", "table", "window"]
    b = ["zebra", "quantum", "violet", "engine", "marble", "thunder"]
    texts, labels = [], []
    for i in range(n):
        for words, y in ((a, 0), (b, 1)):
            texts.append(" ".join(rng.choice(words, size=rng.integers(3, 9))))
            labels.append(y)
    return texts, labels


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_probe_separates_planted_classes_and_matches_direct_fit(family):
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split

    lm = models.tiny_random(family)
    texts, labels = _planted()
    probe = dpo.fit_probe(lm, texts, labels, test_texts=texts[:20], test_labels=labels[:20], progress=False,
                          steer_depth=0.5)
    assert probe.direction.shape == (lm.info.d_model,) and probe.direction.dtype == torch.float32
    assert probe.val_accuracy >= 0.9 and probe.jigsaw_accuracy >= 0.9
    assert probe.n_train == 72
    # the slow, obvious way: features in input order, one batch, same split and classifier
    X = hooks.residual_means(lm, texts, "final", batch_size=len(texts), max_length=64, progress=False).numpy()
    torch.testing.assert_close(dpo.features(lm, texts, progress=False), torch.tensor(X), atol=1e-4, rtol=1e-4)
    Xtr, _, ytr, _ = train_test_split(X, np.array(labels), test_size=0.1, random_state=0, stratify=labels)
    # the steering direction: class-mean difference of the training split after block steer_layer
    assert probe.steer_layer == 1
    S = hooks.residual_means(lm, texts, probe.steer_layer, batch_size=len(texts), max_length=64, progress=False)
    itr, _ = train_test_split(np.arange(len(texts)), test_size=0.1, random_state=0, stratify=labels)
    y = torch.tensor(labels)[itr]
    ref_steer = S[itr][y == 1].mean(0) - S[itr][y == 0].mean(0)
    torch.testing.assert_close(probe.steer_direction, ref_steer, atol=1e-4, rtol=1e-4)
    ref = LogisticRegression(max_iter=5000).fit(Xtr, ytr)
    cos = torch.nn.functional.cosine_similarity(probe.direction, torch.tensor(ref.coef_[0], dtype=torch.float32), 0)
    assert cos > 0.99
    # the decision function agrees with sklearn's
    np.testing.assert_allclose(probe.logits(torch.tensor(X)).numpy(), ref.decision_function(X), atol=1e-2, rtol=1e-2)


def test_probe_states_are_pooled_residuals_from_one_cached_pass(llama, monkeypatch):
    """probe_states gives hooks.pooled_residuals' states at any asked layers, bit for bit, from one forward
    pass over every layer, cached by the texts: the probe's fit and a second read run no second pass."""
    texts, labels = _planted(n=12)
    layers = [0, llama.info.n_layers - 1, "final"]
    want = hooks.pooled_residuals(llama, texts, layers, batch_size=4, max_length=16, progress=False)
    got = dpo.probe_states(llama, texts, layers, max_length=16, batch_size=4, progress=False)
    for L in layers:
        assert torch.equal(got[L], want[L]), L
    monkeypatch.setattr(hooks, "pooled_residuals", lambda *a, **k: pytest.fail("a second forward pass"))
    again = dpo.probe_states(llama, texts, [1, "final"], max_length=16, batch_size=4, progress=False)
    assert torch.equal(again["final"], want["final"])
    probe = dpo.fit_probe(llama, texts, labels, 0.25, texts, labels, max_length=16, batch_size=4, progress=False,
                          steer_depth=0.5)  # its states: the same cached pass
    assert torch.isfinite(probe.direction).all() and probe.steer_direction is not None
    with pytest.raises(ValueError, match="block indices"):
        dpo.probe_states(llama, texts, ["embed"], max_length=16, batch_size=4)
    monkeypatch.undo()
    other = dpo.probe_states(llama, texts[:5], ["final"], max_length=16, batch_size=4, progress=False)
    assert other["final"].shape == (5, llama.info.d_model)  # other texts: another cache entry


def test_fit_probe_rejects_bad_labels(llama):
    with pytest.raises(ValueError, match="both classes"):
        dpo.fit_probe(llama, ["a", "b"], [1, 1], progress=False)


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_residual_add_adds_vector_and_is_removed(family):
    lm = models.tiny_random(family)
    enc = hooks.encode(lm, ["the cat sat on the mat", "hello"])
    seen = {}
    block = hooks.block_module(lm, 0)

    def out0():
        h = block.register_forward_hook(lambda m, a, o: seen.__setitem__("h", (o[0] if isinstance(o, tuple) else o).clone()))
        try:
            with torch.no_grad():
                lm.model(**enc)
        finally:
            h.remove()
        return seen["h"]

    before = out0()
    vec = torch.randn(lm.info.d_model)
    with hooks.residual_add(lm, vec, layers=[0]):
        # a hook registered after the steering hook sees the steered block output
        inside = out0()
    torch.testing.assert_close(inside, before + vec)
    torch.testing.assert_close(out0(), before)  # removed on exit
    with pytest.raises(ValueError, match="d_model"):
        with hooks.residual_add(lm, torch.zeros(3)):
            pass


def test_steering_changes_generation_and_preference_pairs(llama):
    prompts = ["the cat sat on", "one two three"]
    plain = metrics.generate(llama, prompts, max_new_tokens=5, progress=False)
    probe = dpo.Probe(torch.randn(llama.info.d_model), 0.0, 1.0, 1.0, 10, steer_layer=0,
                      steer_direction=torch.randn(llama.info.d_model))
    steered = dpo.steered_generate(llama, prompts, dpo.steering_vector(probe, 50.0), [0], max_new_tokens=5,
                                   progress=False)
    assert steered.new_ids != plain.new_ids
    assert metrics.generate(llama, prompts, max_new_tokens=5, progress=False).new_ids == plain.new_ids
    pairs = dpo.preference_pairs(llama, probe, n_pairs=3, steer_scale=50.0, max_new_tokens=5, progress=False,
                                 chunk=8)
    assert list(pairs.columns) == ["prompt", "chosen", "rejected", "tox_chosen", "tox_rejected", "distinct2_chosen",
                                   "distinct2_rejected"]
    assert len(pairs) <= 3 and pairs.attrs["n_tried"] <= 12
    assert (pairs.tox_rejected > pairs.tox_chosen).all() and (pairs.distinct2_rejected >= 0.5).all()
    np.testing.assert_allclose(pairs.distinct2_rejected, metrics.distinct_n(pairs.rejected.tolist()))
    again = dpo.preference_pairs(llama, probe, n_pairs=3, steer_scale=50.0, max_new_tokens=5, progress=False,
                                 chunk=8)
    assert again.equals(pairs) and again.attrs == pairs.attrs


def test_shuffled_pairs_swap_a_seeded_half_and_keep_the_texts():
    import pandas as pd

    pairs = pd.DataFrame({"prompt": [f"p{i}" for i in range(9)], "chosen": [f"c{i}" for i in range(9)],
                          "rejected": [f"r{i}" for i in range(9)], "tox_chosen": np.arange(9) / 20,
                          "tox_rejected": 0.5 + np.arange(9) / 20, "distinct2_chosen": np.ones(9),
                          "distinct2_rejected": np.full(9, 0.8)}, index=range(10, 19))
    pairs.attrs["scorer"] = "s"
    out = dpo.shuffled_pairs(pairs, seed=3)
    assert out.swapped.sum() == len(pairs) // 2 == 4 and list(out.index) == list(pairs.index)
    s = out.swapped.to_numpy()
    assert (out.chosen.to_numpy()[s] == pairs.rejected.to_numpy()[s]).all()
    assert (out.rejected.to_numpy()[s] == pairs.chosen.to_numpy()[s]).all()
    assert out.loc[~out.swapped, ["prompt", "chosen", "rejected"]].equals(pairs.loc[~s, ["prompt", "chosen", "rejected"]])
    assert out.prompt.equals(pairs.prompt)  # every prompt and text kept, each pair's two texts together
    assert sorted(out.chosen.tolist() + out.rejected.tolist()) == sorted(pairs.chosen.tolist() + pairs.rejected.tolist())
    np.testing.assert_array_equal(out.tox_chosen.to_numpy()[s], pairs.tox_rejected.to_numpy()[s])  # scores follow texts
    np.testing.assert_array_equal(out.distinct2_rejected.to_numpy()[s], pairs.distinct2_chosen.to_numpy()[s])
    assert out.attrs == {"scorer": "s", "shuffle_seed": 3} and "swapped" not in pairs.columns  # the input is unchanged
    assert dpo.shuffled_pairs(pairs, seed=3).equals(out)  # seeded
    assert any(not dpo.shuffled_pairs(pairs, seed=k).swapped.equals(out.swapped) for k in range(4, 8))
    assert training._pairs_key(out) != training._pairs_key(pairs)  # its own DPO runs, cache and records
    with pytest.raises(ValueError, match="'rejected'"):
        dpo.shuffled_pairs(pairs.drop(columns="rejected"))


def test_dpo_two_steps_change_weights_and_cache_hit_reloads_them(llama, monkeypatch, capfd):
    import pandas as pd

    pairs = pd.DataFrame({"prompt": ["the cat sat", "a river runs", "one two", "green house"],
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill"],
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra"],
                          "tox_chosen": [0.1] * 4, "tox_rejected": [0.9] * 4})
    before = {k: v.clone() for k, v in llama.model.state_dict().items()}
    capfd.readouterr()
    trained, log = dpo.train_dpo(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2)
    out = capfd.readouterr()
    assert "%|" not in out.err  # no bars: neither the trainer's nor TRL's dataset preparation
    assert "'loss'" not in out.out  # nor the per-step log dicts that transformers prints when its bar is off
    assert not torch.is_grad_enabled()
    assert list(log.step) == [1, 2] and np.isfinite(log.loss).all() and "reward_margin" in log
    for k, v in llama.model.state_dict().items():  # the base model is untouched
        torch.testing.assert_close(v, before[k])
    new = trained.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], new[k].to(before[k].device))]
    assert any("mlp.down_proj" in k for k in changed), "DPO did not change the MLP output weights"
    assert trained.name.startswith("tiny-llama-dpo-") and trained.info.n_layers == llama.info.n_layers
    # cache hit: no training, same weights and log
    monkeypatch.setattr(training, "_run_dpo", lambda *a, **k: pytest.fail("retrained despite the cache"))
    again, log2 = dpo.train_dpo(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2)
    pd.testing.assert_frame_equal(log, log2)
    for k, v in again.model.state_dict().items():
        torch.testing.assert_close(v, new[k])


def test_dpo_run_is_a_record_and_its_weights_are_trained_only_when_used(llama, monkeypatch):
    """A DPO run's log and weight change are a record: read back with an empty cache and in strict mode, nothing
    trains; the model is known by name and trains (into the cache) on its first use; the audit's recomputation
    trains again from scratch even when the cache holds the weights."""
    import shutil

    import pandas as pd

    from lib.infra import store

    pairs = pd.DataFrame({"prompt": ["the cat sat", "a river runs", "one two", "green house"],
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill"],
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra"]})
    first = dpo.dpo_run(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2)
    assert first.changed_tensors > 0 and first.n_tensors >= first.changed_tensors
    assert first.w_out_change.shape == (llama.info.n_layers,) and (first.w_out_change > 0).any()
    shutil.rmtree(training._dpo_folder(llama, pairs, 2, 1e-3, 0.1, 0, 2))  # the weights are gone, the record stays
    calls = []
    real = training._run_dpo
    monkeypatch.setattr(training, "_run_dpo", lambda *a, **k: calls.append(1) or real(*a, **k))
    with monkeypatch.context() as m:
        m.setenv(store.RECORDS_ENV, "strict")
        again = dpo.dpo_run(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2)
        pd.testing.assert_frame_equal(again.log, first.log)
        assert again.model.name == first.model.name and not again.model.is_loaded and not calls
        with torch.inference_mode():  # first use inside inference mode (as in generation): trains all the same
            assert again.model.info.n_layers == llama.info.n_layers and calls == [1]  # trained, cached
        dpo.dpo_run(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2).model.model
        assert calls == [1]  # read from the cache
    monkeypatch.setattr(store, "_AUDITING", [True])
    fresh = training._train_dpo(llama, pairs, 2, 1e-3, 0.1, 0, False, 2, training._dpo_folder(llama, pairs, 2, 1e-3, 0.1, 0, 2),
                           fresh=store.auditing())
    assert calls == [1, 1] and "dpo-audit-" in str(fresh)
    shutil.rmtree(fresh.parent)


def test_dpo_halfway_is_the_run_after_half_its_steps(llama, monkeypatch, tmp_path):
    """dpo_halfway reads the weights a run kept after steps // 2 of its steps: the weights of a run stopped
    there (4 steps and 2 steps share their warm-up of one step and their first batches), different from the
    base and from the end of the run, with the first half of the run's log; it trains nothing when cached."""
    import pandas as pd

    pairs = pd.DataFrame({"prompt": ["the cat sat", "a river runs", "one two", "green house"] * 2,
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill"] * 2,
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra"] * 2})
    full, log = dpo.train_dpo(llama, pairs, steps=4, lr=1e-3, seed=0, progress=False, batch_size=2)
    monkeypatch.setattr(training, "_run_dpo", lambda *a, **k: pytest.fail("trained again for the halfway weights"))
    half, log_half = dpo.dpo_halfway(llama, pairs, steps=4, lr=1e-3, seed=0, progress=False, batch_size=2)
    monkeypatch.undo()
    assert list(log_half.step) == [1, 2]
    pd.testing.assert_frame_equal(log_half, log.iloc[:2].reset_index(drop=True))
    assert half.name.endswith("-halfway") and half.name != full.name
    short, log_short = dpo.train_dpo(llama, pairs, steps=2, lr=1e-3, seed=0, progress=False, batch_size=2)
    np.testing.assert_allclose(log_half.loss, log_short.loss, rtol=1e-6)
    w_half, w_short, w_full = (m.model.state_dict() for m in (half, short, full))
    base = llama.model.state_dict()
    for k, v in w_half.items():
        torch.testing.assert_close(v, w_short[k])
    assert any(not torch.equal(v, w_full[k]) for k, v in w_half.items())  # not the end of the run
    assert any(not torch.equal(v, base[k]) for k, v in w_half.items())  # nor the base model
    with pytest.raises(ValueError, match="keep_at"):
        training._run_dpo(llama, pairs, 2, 1e-3, 0.1, 0, 2, False, tmp_path / "x", keep_at=3)


def test_dpo_precomputed_reference_gives_the_same_weights(llama, tmp_path):
    """The reference log-probabilities computed once before training (the default) train the same model,
    bit for bit, as a reference model run at every step (TRL's way without precompute_ref_log_probs)."""
    import pandas as pd
    from lib.infra import repro

    pairs = pd.DataFrame({"prompt": ["the cat sat", "a river runs", "one two", "green house", "blue sky"],
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill", " and sun"],
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra", " mud"]})
    weights = {}
    for pre in (True, False):
        repro.setup(0, grad=True)
        try:
            model, log = training._run_dpo(llama, pairs, 3, 1e-3, 0.1, 0, 2, False, tmp_path / str(pre), precompute_ref=pre)
        finally:
            torch.set_grad_enabled(False)
        weights[pre] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, log.loss.tolist())
    assert weights[True][1] == weights[False][1]
    changed = 0
    for k, v in weights[True][0].items():
        assert torch.equal(v, weights[False][0][k]), k
        changed += int(not torch.equal(v, llama.model.state_dict()[k]))
    assert changed  # it trained


def test_dpo_scores_the_completions_alone_and_trains_the_same(llama, tmp_path, monkeypatch):
    """By default TRL's fused LM head projects only the completions' positions onto the vocabulary, on a CPU
    too (lib.papers.dpo.training._completion_positions_only), and training gives the weights and losses of projecting every
    position, up to float rounding; the switch is put back afterwards."""
    import pandas as pd
    import trl.trainer.utils as trl_utils
    from lib.infra import repro

    pairs = pd.DataFrame({"prompt": ["the cat sat down on", "a long river runs", "one two", "green house"],
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill"],
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra"]})
    rows = {}
    original = trl_utils._ChunkedLogProbFunction

    def run(completions_only):
        class Spy:  # counts the positions each call of the fused head projects
            @staticmethod
            def apply(hidden, *args):
                rows.setdefault(completions_only, []).append(hidden.shape[0])
                return original.apply(hidden, *args)

        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
        training._REF_LOGPS.pop(llama.model, None)
        repro.setup(0, grad=True)
        try:
            model, log = training._run_dpo(llama, pairs, 3, 1e-3, 0.1, 0, 2, False, tmp_path / str(completions_only),
                                      completions_only=completions_only)
        finally:
            torch.set_grad_enabled(False)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, log.loss.to_numpy()

    use_triton = trl_utils._use_triton
    w_all, loss_all = run(False)
    w_comp, loss_comp = run(True)
    assert trl_utils._use_triton is use_triton  # put back
    assert len(rows[True]) == len(rows[False]) and all(a < b for a, b in zip(rows[True], rows[False]))
    np.testing.assert_allclose(loss_comp, loss_all, rtol=1e-5, atol=1e-6)
    for k, v in w_comp.items():
        torch.testing.assert_close(v, w_all[k], rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(v, llama.model.state_dict()[k]) for k, v in w_comp.items())  # it trained


def test_dpo_runs_share_the_reference_log_probs_and_train_the_same(llama, tmp_path, monkeypatch):
    """A second seed's run on the same pairs reads the first run's reference log-probabilities instead of
    computing them, and trains the same weights, bit for bit, as a run that computes them itself."""
    import pandas as pd
    from trl import DPOTrainer
    from lib.infra import repro

    pairs = pd.DataFrame({"prompt": ["the cat sat", "a river runs", "one two", "green house"],
                          "chosen": [" on the mat", " to the sea", " three four", " on the hill"],
                          "rejected": [" zebra engine", " thunder marble", " quantum violet", " engine zebra"]})
    computed = []
    original = DPOTrainer._precompute_ref_logps
    monkeypatch.setattr(DPOTrainer, "_precompute_ref_logps",
                        lambda self, *a, **k: computed.append(1) or original(self, *a, **k))

    def run(seed, name):
        repro.setup(seed, grad=True)
        try:
            model, log = training._run_dpo(llama, pairs, 2, 1e-3, 0.1, seed, 2, False, tmp_path / name)
        finally:
            torch.set_grad_enabled(False)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, log.loss.tolist()

    training._REF_LOGPS.pop(llama.model, None)
    run(0, "a")
    shared = run(1, "b")
    assert len(computed) == 1  # the second seed read the first one's
    training._REF_LOGPS.pop(llama.model, None)
    alone = run(1, "c")
    assert len(computed) == 2
    assert shared[1] == alone[1]
    assert all(torch.equal(v, alone[0][k]) for k, v in shared[0].items())
    other = pairs.assign(chosen=pairs.chosen + " too")  # other pairs: computed afresh
    repro.setup(0, grad=True)
    try:
        training._run_dpo(llama, other, 1, 1e-3, 0.1, 0, 2, False, tmp_path / "e")
    finally:
        torch.set_grad_enabled(False)
    assert len(computed) == 3


def test_evaluate_in_range_and_unchanged_under_identity_patch(llama):
    res = dpo.toxicity_perplexity_f1(llama, n_prompts=4, n_wiki=3, max_new_tokens=4, progress=False)
    assert 0 <= res["toxicity"] <= 1 and 0 <= res["f1"] <= 1
    assert np.isfinite(res["perplexity"]) and res["perplexity"] > 1
    assert res["n_prompts"] == 4 and res["n_wiki"] == 3 and res["scorer"] in metrics.SCORERS
    with hooks.intervene(llama, [(0, 1, "scale", 1.0), (1, 2, "add", 0.0)]):
        same = dpo.toxicity_perplexity_f1(llama, n_prompts=4, n_wiki=3, max_new_tokens=4, progress=False)
    assert same == res
    with hooks.intervene(llama, [(L, i, "set", 5.0) for L in range(2) for i in range(64)]):
        other = dpo.toxicity_perplexity_f1(llama, n_prompts=4, n_wiki=3, max_new_tokens=4, progress=False)
    assert other["perplexity"] != res["perplexity"]


def test_evaluate_toxicity_only_gives_the_full_evaluations_toxicities(llama, monkeypatch):
    """The controls' shortcut (notebooks 03 and 06): the same per-prompt toxicities as the full
    evaluation, under the same intervention, without running perplexity or F1."""
    kw = dict(n_prompts=4, n_wiki=3, max_new_tokens=4)
    table = [(L, i, "set", 5.0) for L in range(2) for i in range(64)]
    full = dpo.evaluate(llama, table, **kw)
    assert {"perplexity", "f1", "f1s", "toxicities"} <= set(full)
    monkeypatch.setattr(metrics, "perplexity", lambda *a, **k: pytest.fail("toxicity_only ran the perplexity"))
    short = dpo.evaluate(llama, table, toxicity_only=True, **kw)
    assert set(short) == {"toxicity", "toxicities", "continuations", "scorer", "n_prompts"}
    assert short["toxicities"] == full["toxicities"] and short["continuations"] == full["continuations"]
    assert short["toxicity"] == full["toxicity"]
    plain = dpo.evaluate(llama, None, toxicity_only=True, **kw)  # None: no intervention
    assert plain["continuations"] != short["continuations"]


def test_evaluate_each_gives_each_tables_toxicity_only_evaluation(llama):
    """The random controls' batched path (several tables per generation, from the shared prompt prefix):
    the same continuations and toxicities as one evaluate(..., toxicity_only=True) per table, and as the
    whole prompt pass (an outer hook turns the shared prefix off)."""
    kw = dict(n_prompts=5, n_wiki=3, max_new_tokens=4)
    tables = [[(L, i, "set", 5.0) for L in range(2) for i in range(0, 64, 2)], [],
              [(1, i, "add", -3.0) for i in range(32)], [(0, i, "zero", 0.0) for i in range(0, 64, 3)],
              [(1, 3, "scale", 2.0)]]
    each = dpo.evaluate_each(llama, tables, per_batch=2, **kw)
    one = [dpo.evaluate(llama, t, toxicity_only=True, **kw) for t in tables]
    assert each == one and len({tuple(e["continuations"]) for e in each}) > 1
    with hooks.intervene(llama, []), hooks.residual_add(llama, torch.zeros(llama.info.d_model), [0]):  # hooked: no prefix
        assert hooks.hooked(llama)
        whole = [dpo.evaluate(llama, t, toxicity_only=True, **kw) for t in tables]
    assert whole == one
    assert dpo.evaluate_each(llama, tables[:2], positions="all", **kw) == [
        dpo.evaluate(llama, t, toxicity_only=True, positions="all", **kw) for t in tables[:2]]
    with pytest.raises(ValueError, match="per_batch"):
        dpo.evaluate_each(llama, tables, per_batch=0, **kw)
    with pytest.raises(ValueError, match="positions"):
        dpo.evaluate_each(llama, tables, positions="first", **kw)


def test_evaluate_each_copies_activations_like_one_copy_at_a_time(llama):
    """copy_from: each neuron set's activations copied from another model, several sets per generation; the
    same continuations as one hooks.copy_activations block per set around evaluate(..., toxicity_only=True)
    (which reads whole prompts). Under 'last' both models start from their prompt prefixes: the source then
    reads one token a forward pass."""
    import copy
    import dataclasses

    src = dataclasses.replace(llama, model=copy.deepcopy(llama.model))
    with torch.no_grad():  # the source's first 16 neurons of the last block fire differently
        src.model.model.layers[1].mlp.up_proj.weight[:16] *= -4
    kw = dict(n_prompts=5, n_wiki=3, max_new_tokens=4)
    sets = [[(1, i) for i in range(16)], [], [(0, i) for i in range(0, 64, 2)] + [(1, 5)]]
    evaluation._prefix(src, dpo.evaluation_inputs(5, 3)["challenge_prompts"])  # the source's prompt prefix (kept per model), before counting
    for positions in ("last", "all"):
        widths = []  # tokens per forward pass of the source (counted without a hook: a hooked model gets no prefix)
        emb = src.model.get_input_embeddings()
        emb.forward = lambda ids, _f=emb.forward: (widths.append(ids.shape[1]), _f(ids))[1]
        try:
            each = dpo.evaluate_each(llama, sets, per_batch=2, positions=positions, copy_from=src, **kw)
        finally:
            del emb.forward
        assert (max(widths) == 1) == (positions == "last")
        one = []
        for cells in sets:
            with hooks.copy_activations(src, llama, cells, positions):
                one.append(dpo.evaluate(llama, toxicity_only=True, positions=positions, **kw))
        assert each == one
        assert each[0]["continuations"] != each[1]["continuations"]
    # two generations in one block (the source restarts from its prefix at each one's first step): the same
    chosen = dpo.evaluation_inputs(5, 3)["challenge_prompts"]
    with hooks.copy_activations_each(src, llama, sets[:2], "last", source_prefix=evaluation._prefix(src, chosen)) as each_batch:
        twice = [[g.continuations for g in metrics.generate(llama, chosen, 4, metrics.GENERATE_BATCH_SIZE, max_prompt_tokens=32,
                                                             progress=False, prefix=evaluation._prefix(llama, chosen), copies=2,
                                                             each_batch=each_batch)]
                 for _ in range(2)]
    last = dpo.evaluate_each(llama, sets[:2], per_batch=2, positions="last", copy_from=src, **kw)
    assert twice[0] == twice[1] == [e["continuations"] for e in last]
    with pytest.raises(ValueError, match="source prefix"):
        with hooks.copy_activations_each(src, llama, sets, "all", source_prefix=evaluation._prefix(src, ["a b c"])):
            pass


def test_evaluate_positions_and_the_two_perplexities(llama):
    """dpo.evaluate patches at the authors' positions by default ('last'); perplexity is scored with
    the table at every position ('perplexity', the same under both settings) and, for 'last', at
    position 0 of each window ('perplexity_authors', which a strong patch barely moves)."""
    kw = dict(n_prompts=4, n_wiki=3, max_new_tokens=4)
    plain = dpo.evaluate(llama, None, **kw)
    assert plain["perplexity_authors"] == plain["perplexity"]
    assert {k: v for k, v in plain.items() if k != "perplexity_authors"} == dpo.evaluate(llama, None, positions="all", **kw)
    assert dpo.evaluate(llama, [(0, 1, "scale", 1.0), (1, 2, "add", 0.0)], **kw) == plain  # a zero-change patch
    big = [(L, i, "set", 5.0) for L in range(2) for i in range(64)]
    last, every = dpo.evaluate(llama, big, **kw), dpo.evaluate(llama, big, positions="all", **kw)
    assert "perplexity_authors" not in every and last["perplexity"] == every["perplexity"] != plain["perplexity"]
    gap = lambda p: abs(np.log(p) - np.log(plain["perplexity"]))
    assert gap(last["perplexity_authors"]) < gap(last["perplexity"])
    assert list(last)[:3] == ["toxicity", "perplexity", "perplexity_authors"]
    with pytest.raises(ValueError, match="positions"):
        dpo.evaluate(llama, big, positions="first", **kw)


def test_read_prompts_and_prompt_sets(tmp_path):
    """The ``prompts`` parameter of notebooks 02-06: a JSONL file replaces the challenge prompts."""
    from lib import data

    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(['{"text": "So I told him", "id": "a"}', "", '{"text": "The weather today"}',
                             '{"text": "My neighbour is", "id": 3}', '{"text": "What I really think"}']) + "\n")
    assert dpo.read_prompts(f) == ["So I told him", "The weather today", "My neighbour is", "What I really think"]
    ev, st = dpo.prompt_sets(str(f), n_prompts=3, n_stats_prompts=2)
    assert ev == ["So I told him", "The weather today", "My neighbour is"] and st == ["So I told him", "The weather today"]
    with pytest.raises(ValueError, match="holds 4 prompts, but n_prompts = 5 asks for more"):
        dpo.prompt_sets(str(f), n_prompts=5, n_stats_prompts=2)
    # the default: the challenge prompts, statistics from stats_offset on, disjoint from the scored ones
    ev, st = dpo.prompt_sets("", n_prompts=4, n_stats_prompts=3, stats_offset=10)
    assert ev == data.challenge_prompts(4) and st == data.challenge_prompts(13)[10:]
    with pytest.raises(ValueError, match="stats_offset"):
        dpo.prompt_sets("", n_prompts=20, n_stats_prompts=3, stats_offset=10)
    for text, match in [('{"text": "ok"}\nnot json', "line 2: not JSON"), ('{"prompt": "x"}', "line 1: expected an object"),
                        ('{"text": "  "}', "non-empty"), ('{"text": "a", "id": 1}\n{"text": "b", "id": 1}', "id 1 already used on line 1"),
                        ("\n\n", "holds no prompts")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            dpo.read_prompts(bad)
    with pytest.raises(FileNotFoundError, match="Your own prompts"):
        dpo.read_prompts(tmp_path / "missing.jsonl")


def test_prompt_files_that_are_not_utf8_name_the_line(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_bytes(b'{"text": "So I told him"}\n{"text": "na\xefve"}\n')
    with pytest.raises(ValueError) as e:
        dpo.read_prompts(f)
    assert str(e.value).startswith("mine.jsonl line 2: not UTF-8 text (byte 0xef at byte 13 of the line)")


def test_too_many_statistics_prompts_blame_n_stats_prompts():
    """More statistics prompts than the challenge prompts hold: the error names n_stats_prompts, its largest
    value and how many prompts there are (not stats_offset, which the user did not set)."""
    from lib import data

    n = len(data.challenge_prompts())
    with pytest.raises(ValueError) as e:
        dpo.prompt_sets("", n_prompts=64, n_stats_prompts=100000, stats_offset=600)
    assert str(e.value) == (f"n_stats_prompts must be at most {n - 600}: there are {n} challenge prompts and the "
                            f"statistics start at stats_offset = 600; a lower stats_offset (at least n_prompts = 64) "
                            f"leaves up to {n - 64}; got 100000")
    for with_evaluation in (True, False):  # through paper A's setup (02-06; 04 scores no prompts), before anything loads
        with pytest.raises(ValueError, match=r"^n_stats_prompts must be at most \d+: there are \d+ challenge prompts"):
            dpo.setup("smollm2-135m", "cpu", overrides={"n_stats_prompts": 100000}, evaluation=with_evaluation)
    with pytest.raises(ValueError, match=r"^n_prompts must be at most \d+ \(the challenge prompts"):
        dpo.prompt_sets("", n_prompts=100000)
    assert len(dpo.prompt_sets("", n_prompts=64, n_stats_prompts=n - 64, stats_offset=64)[1]) == n - 64


def test_a_short_prompt_file_names_only_the_sizes_that_ask_for_more(tmp_path):
    """04 takes statistics only (n_prompts 0 there) and has no parameter n_prompts: the hint names n_stats_prompts."""
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(f'{{"text": "Prompt {i}"}}\n' for i in range(6)))
    with pytest.raises(ValueError) as e:
        dpo.prompt_sets(str(f), n_prompts=0, n_stats_prompts=40)
    msg = str(e.value)
    assert msg.endswith("holds 6 prompts, but n_stats_prompts = 40 asks for more: add prompts, or set n_stats_prompts "
                        "to at most 6 (a parameter of the notebook, else a key of overrides)")
    assert "n_prompts" not in msg.replace("n_stats_prompts", "")
    with pytest.raises(ValueError, match="n_prompts = 7 and n_stats_prompts = 8 ask for more: add prompts, or set "
                                         "n_prompts and n_stats_prompts to at most 6"):
        dpo.prompt_sets(str(f), n_prompts=7, n_stats_prompts=8)


def test_evaluate_scores_the_users_prompts_and_keys_the_cache_by_them(llama, tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"text": "So I told him"}\n{"text": "The weather today"}\n{"text": "My neighbour is"}\n')
    mine, _ = dpo.prompt_sets(str(f), n_prompts=3)
    kw = dict(n_prompts=3, n_wiki=2, max_new_tokens=3)
    ev = dpo.evaluate(llama, None, prompts=mine, toxicity_only=True, **kw)
    direct = metrics.generate(llama, mine, 3, max_prompt_tokens=32, progress=False)
    assert ev["continuations"] == direct.continuations and len(ev["toxicities"]) == 3
    assert ev["continuations"] != dpo.evaluate(llama, None, toxicity_only=True, **kw)["continuations"]
    with pytest.raises(ValueError, match="exactly n_prompts"):
        dpo.evaluate(llama, None, prompts=mine[:2], **kw)
    ref_kw = dict(kw, scorer="profanity-check", progress=False, details=True)
    theirs = dpo_neurons.reference_evaluations("tiny", llama, llama, {"steps": 0}, dpo.toxicity_perplexity_f1, **ref_kw)
    ours = dpo_neurons.reference_evaluations("tiny", llama, llama, {"steps": 0}, dpo.toxicity_perplexity_f1, prompts=mine, **ref_kw)
    assert ours["base"]["continuations"] == direct.continuations != theirs["base"]["continuations"]


def test_base_and_dpo_rejects_unknown_sizes():
    with pytest.raises(ValueError, match="unknown size"):
        dpo.base_and_dpo("smollm2-135m", n_pears=3)


def test_notebook_06_word_lists_default_to_the_shared_toxic_token_direction():
    """01 builds the toxic-token direction from dpo.TOXIC_WORDS / NONTOXIC_WORDS; 06 takes the lists as
    parameters (papermill needs literals), whose defaults must be the same words."""
    from lib.infra import params

    spec = params._parameters("06_activation_editing")
    assert spec["toxic_words"][1] == list(dpo.TOXIC_WORDS)
    assert spec["nontoxic_words"][1] == list(dpo.NONTOXIC_WORDS)


# ----------------------------------------------------------------------------- direction gate


def _word_scorer(words):
    """A stand-in scorer: the share of a text's words that are in ``words`` (0 for an empty text)."""
    def score(texts, scorer="auto", batch_size=64):
        out = [np.mean([w in words for w in t.split()]) if t.split() else 0.0 for t in texts]
        return np.asarray(out, dtype=float), "word-share"
    return score


def _planted_gate_model(n_planted=4):
    """A tiny Llama whose toxic direction u (single-token toxic minus friendly words' unembeddings) is
    written by ``n_planted`` neurons (value vectors = u); a probe whose class means differ along u and
    whose weights coef_ are random."""
    lm = models.tiny_random("llama")
    toxic = dpo.single_token_words(lm, dpo.TOXIC_WORD_POOL)
    U = hooks.unembedding(lm)
    e = torch.nn.functional.normalize(torch.randn(lm.info.d_model, generator=torch.Generator().manual_seed(0)), dim=0)
    with torch.no_grad():  # the toxic words' unembeddings share a large component e: the model "knows" them
        ids = [lm.tokenizer(" " + w, add_special_tokens=False)["input_ids"][0] for w in toxic]
        U[ids] += U.norm(dim=1).mean() * e
    u, toxic, _ = dpo.whole_word_direction(lm)
    assert u is not None and len(toxic) >= dpo.MIN_WHOLE_WORDS
    with torch.no_grad():
        for L, i in [(0, 3), (1, 7), (1, 20), (0, 40)][:n_planted]:
            hooks.block_module(lm, L).mlp.down_proj.weight[:, i] = 3 * u / u.norm()
    g = torch.Generator().manual_seed(1)
    X0 = torch.randn(20, lm.info.d_model, generator=g)
    X = torch.cat([X0, X0 + u])
    y = torch.tensor([0] * 20 + [1] * 20)
    probe = dpo.Probe(torch.randn(lm.info.d_model, generator=g), 0.0, 1.0, 1.0, 40, train_features=X,
                      train_labels=y)
    return lm, probe, set(toxic)


def test_candidate_directions_whole_words_are_single_tokens_and_class_mean_is_the_mean_difference():
    lm, probe, toxic = _planted_gate_model()
    c = dpo.candidate_directions(lm, probe)
    assert list(c) == list(dpo.DIRECTIONS)
    torch.testing.assert_close(c["class-mean"], probe.train_features[20:].mean(0) - probe.train_features[:20].mean(0))
    torch.testing.assert_close(c["probe"], probe.direction)
    assert all(len(lm.tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1 for w in toxic)
    # too few single-token words: no whole-word direction, and the candidate is left out
    none, _, _ = dpo.whole_word_direction(lm, toxic=["qqqzzxx", "vvbbnnmmx"])
    assert none is None


def test_gate_validates_a_planted_direction_and_not_random_weights(monkeypatch):
    lm, probe, toxic = _planted_gate_model()
    monkeypatch.setattr(metrics, "toxicity", _word_scorer(toxic))
    # 40 random directions: at this steering norm one of them also drives the tiny model to the toxic words (as
    # toxic as the planted direction), and the exact rank test needs more than 20 sets to place the planted one
    # beyond them at p <= 0.05 with that tie (2/41; with 20 sets 2/21)
    kw = dict(n_prompts=12, max_new_tokens=4, n_random=40, steer_fraction=20.0, n_neurons=4, n_neuron_sets=20,
              top_k_tokens=4, family=1)
    gate = dpo.validate_directions(lm, probe, progress=False, **kw)
    t = gate.table
    assert set(t.index) == set(dpo.DIRECTIONS)
    # the planted direction (as the class means and as the words) steers to toxic words and is written by
    # neurons that promote them; the probe's random weights do neither
    for name in ("class-mean", "toxic words"):
        assert t.loc[name, "steer_effect"] > t.loc[name, "steer_random_q95"] and t.loc[name, "validated"], name
    assert not t.loc["probe", "validated"]
    assert gate.best in ("class-mean", "toxic words") and gate.choose("auto")[0] == gate.best
    assert 0 <= gate.baseline_toxicity <= 1 and len(gate.random_effects) == 40
    # a cache hit gives the same table
    again = dpo.validate_directions(lm, probe, progress=False, **kw)
    assert again.table.equals(t) and again.best == gate.best


def test_gate_sweep_validates_the_planted_direction_in_one_setting_and_corrects_for_the_family(monkeypatch):
    """Two settings: the planted direction steers at a strong norm and not at 1% of the residual norm; validated
    means 'promoted tokens and at least one setting', each steering test at 0.05 / 2 (with the one random direction
    that ties the planted one, as in the single-setting test, 79 random directions place it at p = 2/80)."""
    lm, probe, toxic = _planted_gate_model()
    monkeypatch.setattr(metrics, "toxicity", _word_scorer(toxic))
    kw = dict(n_prompts=12, max_new_tokens=4, n_random=79, n_neurons=4, n_neuron_sets=20, top_k_tokens=4)
    sweep = {"last block": {"steer_fraction": 3.0}, "quiet": {"steer_fraction": 0.01}}
    gate = dpo.sweep_directions(lm, probe, progress=False, sweep=sweep, **kw)
    assert list(gate.sweep) == list(sweep) and all(g.settings["family"] == 2 for g in gate.sweep.values())
    t = gate.table
    assert t["steer ok: last block"].loc[["class-mean", "toxic words"]].all()
    assert not t["steer ok: quiet"].any()  # a steer of 1% of the norm moves nothing
    assert t.validated.loc[["class-mean", "toxic words"]].all() and not t.loc["probe", "validated"]
    assert gate.best == "class-mean" and gate.validated("class-mean")  # the first validated in DIRECTIONS' order
    assert "one of 2 settings" in gate.precondition("class-mean").name and gate.precondition("class-mean").met
    with pytest.raises(ValueError, match="n_random must be at least 39"):
        dpo.sweep_directions(lm, probe, progress=False, sweep=sweep, **{**kw, "n_random": 20})


def test_gate_finds_no_direction_when_nothing_is_planted(monkeypatch):
    lm = models.tiny_random("llama")
    g = torch.Generator().manual_seed(2)
    X = torch.randn(40, lm.info.d_model, generator=g)
    probe = dpo.Probe(torch.randn(lm.info.d_model, generator=g), 0.0, 1.0, 1.0, 40, train_features=X,
                      train_labels=torch.tensor([0, 1] * 20))
    # a scorer that no text can move: nothing can count as a toxicity direction
    monkeypatch.setattr(metrics, "toxicity", _word_scorer({"zzzunseenword"}))
    gate = dpo.validate_directions(lm, probe, progress=False, n_prompts=8, max_new_tokens=3, n_random=20,
                                   steer_fraction=20.0, n_neurons=4, n_neuron_sets=20, top_k_tokens=4, family=1)
    assert not gate.table.validated.any() and gate.best is None
    assert gate.choose("auto") == (None, None) and "no candidate passed" in gate.precondition("probe").name
    with pytest.raises(ValueError, match="unknown direction"):
        gate.choose("the probe")


def test_gate_rejects_bad_settings(llama):
    probe = dpo.Probe(torch.randn(llama.info.d_model), 0.0, 1.0, 1.0, 4, train_features=torch.randn(4, llama.info.d_model),
                      train_labels=torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="unknown gate settings"):
        dpo.validate_directions(llama, probe, n_randoms=30)
    with pytest.raises(ValueError, match="n_random must be at least 19"):
        dpo.validate_directions(llama, probe, n_random=5, family=1)
    with pytest.raises(ValueError, match="n_random must be at least 99"):  # a family of 5 settings: p <= 0.01
        dpo.validate_directions(llama, probe, n_random=50)
    with pytest.raises(ValueError, match="norm_of must be one of"):
        dpo.validate_directions(llama, probe, norm_of="unit")
    with pytest.raises(ValueError, match="steer_depth must lie in"):
        dpo.validate_directions(llama, probe, steer_depth=1.5)
    with pytest.raises(ValueError, match="set by the sweep"):
        dpo.sweep_directions(llama, probe, mode="lower")
    with pytest.raises(ValueError, match="at least one setting"):
        dpo.sweep_directions(llama, probe, sweep={})
    with pytest.raises(ValueError, match="n_neuron_sets must be at least 19"):
        dpo.validate_directions(llama, probe, n_neuron_sets=10)
    with pytest.raises(ValueError, match="training features"):
        dpo.candidate_directions(llama, dpo.Probe(torch.randn(llama.info.d_model), 0.0, 1.0, 1.0, 4))


def test_gate_pick_falls_back_and_precondition_fails_without_a_validated_direction():
    import pandas as pd

    vec = {k: torch.randn(4) for k in ("probe", "toxic tokens")}
    table = pd.DataFrame({"validated": [False, True]}, index=["probe", "toxic tokens"])
    gate = dpo.DirectionGate(table, vec, "toxic tokens", 1, 1.0, 0.0, [], "x", {})
    assert gate.pick("auto")[0] == "toxic tokens" and gate.pick("probe")[0] == "probe"
    assert gate.precondition("toxic tokens").met and not gate.precondition("probe").met
    assert not gate.precondition("toxic tokens", same_vector=False).met
    none = dpo.DirectionGate(table.assign(validated=False), vec, None, 1, 1.0, 0.0, [], "x", {})
    name, v = none.pick("auto", fallback="probe")
    assert name == "probe" and v is vec["probe"]
    pre = none.precondition(name)
    assert not pre.met and "no candidate passed" in pre.name


def test_preference_pairs_leave_out_looping_rejected_texts(monkeypatch):
    """A scorer that rates every steered text more toxic: with min_distinct2 = 1 a rejected text with any
    repeated word pair is left out (and counted), with 0 every pair is kept."""
    prompts_seen = []

    def toxic_when_steered(texts, scorer="auto", batch_size=64):
        prompts_seen.append(len(texts))
        return np.full(len(texts), 0.5 if len(prompts_seen) % 2 == 0 else 0.1), "stand-in"

    monkeypatch.setattr(metrics, "toxicity", toxic_when_steered)
    lm, _, _ = _planted_gate_model()  # steered at the last block along u, it writes whole toxic words, often repeated
    u, _, _ = dpo.whole_word_direction(lm)
    probe = dpo.Probe(torch.randn(lm.info.d_model), 0.0, 1.0, 1.0, 10, steer_layer=lm.info.n_layers - 1,
                      steer_direction=u)
    kw = dict(n_pairs=6, steer_scale=50.0, max_new_tokens=12, progress=False, chunk=8)
    every = dpo.preference_pairs(lm, probe, min_distinct2=0.0, **kw)
    strict = dpo.preference_pairs(lm, probe, min_distinct2=1.0, **kw)
    assert every.attrs["n_looping"] == 0 and len(every) == 6
    looping = int((metrics.distinct_n(every.rejected.tolist()) < 1.0).sum())
    assert looping > 0, "the strong steer should make some rejected texts repeat"
    assert (strict.distinct2_rejected == 1.0).all() and strict.attrs["n_looping"] >= looping
    with pytest.raises(ValueError, match="min_distinct2"):
        dpo.preference_pairs(lm, probe, min_distinct2=1.5, **kw)


# ----------------------------------------------------------------------------- one setup call


def test_sizes_check_themselves_and_default_to_the_shared_defaults():
    s = dpo.Sizes()
    assert s.training() == {k: getattr(dpo.Sizes, k) for k in dpo.TRAINING_KEYS}
    assert set(s.dpo_sizes()) == set(dpo.Sizes.DPO_KEYS) <= set(dpo.TRAINING_KEYS)
    assert dpo.Sizes(steer_scale=8).steer_scale == 8.0 and isinstance(dpo.Sizes(steer_scale=8).steer_scale, float)
    for bad, match in [({"n_pairs": 0}, "n_pairs must be positive"), ({"n_pairs": 2.5}, "n_pairs must be an integer"),
                       ({"n_pairs": True}, "n_pairs must be an integer"),
                       ({"steer_depth": 1.5}, r"steer_depth must lie in \[0, 1\]"),
                       ({"min_distinct2": -0.1}, "min_distinct2 must lie"), ({"stats_offset": -1}, "non-negative"),
                       ({"dpo_lr": 0.0}, "dpo_lr must be positive"), ({"beta": "0.1"}, "beta must be a number")]:
        with pytest.raises(ValueError, match=match):
            dpo.Sizes(**bad)
    with pytest.raises(ValueError, match="unknown size 'n_pears': did you mean 'n_pairs'"):
        dpo.Sizes.of({"n_pears": 3})
    with pytest.raises(ValueError, match="n_prompts: a parameter of this notebook"):
        dpo.Sizes.of({"n_prompts": 10}, n_prompts=32)
    s = dpo.Sizes.of({"n_pairs": 8}, n_prompts=32)
    assert (s.n_pairs, s.n_prompts, s.n_wiki) == (8, 32, dpo.Sizes.n_wiki)


def test_setup_checks_before_loading_and_reads_a_users_prompts(tmp_path, capsys):
    f = tmp_path / "mine.jsonl"
    f.write_text("".join(f'{{"text": "Prompt {i} says"}}\n' for i in range(6)))
    a = dpo.setup("smollm2-135m", "cpu", 0, {"n_stats_prompts": 5}, prompts=str(f), n_prompts=4, scorer="profanity-check")
    mine = [f"Prompt {i} says" for i in range(6)]
    assert a.eval_prompts == mine[:4] and a.stats_prompts == mine[:5] and a.prompt_kw == {"prompts": mine[:4]}
    assert a.base_lm is None and "overrides {'n_stats_prompts': 5}" in capsys.readouterr().out  # nothing loaded yet
    with pytest.raises(RuntimeError, match=r"call \.load\(\) first"):
        a.dpo_key
    only_stats = dpo.setup("smollm2-135m", "cpu", 0, {"n_stats_prompts": 5}, prompts=str(f), evaluation=False)
    assert only_stats.eval_prompts == [] and only_stats.prompt_kw == {}  # 04: 6 prompts are enough without evaluation
    default = dpo.setup("smollm2-135m", "cpu", 0)
    from lib import data

    assert default.prompt_kw == {} and default.eval_prompts == data.challenge_prompts(dpo.Sizes.n_prompts)
    for kw, match in [({"direction": "probes"}, "direction must be 'auto' or one of"), ({"positions": "first"}, "positions must be"),
                      ({"fallback": "x"}, "fallback must be"), ({"scorer": "nope"}, "scorer"),
                      ({"overrides": {"n_prompts": 9}, "n_prompts": 32}, "a parameter of this notebook")]:
        with pytest.raises(ValueError, match=match):
            dpo.setup("smollm2-135m", "cpu", 0, **kw)
    with pytest.raises(ValueError, match="encoder"):
        dpo.setup("minilm-l6", "cpu", 0)


def test_setup_load_wires_models_gate_and_sizes(llama, monkeypatch, capsys):
    """load() passes every size to base_and_dpo, picks the gate's direction (or the fallback), and the
    bound evaluate() and references() use the setup's sizes, prompts, scorer and positions."""
    import pandas as pd

    seen = {}

    def fake_base_and_dpo(model_name, device, seed, progress, **sizes):
        seen["sizes"] = sizes
        probe = dpo.Probe(torch.ones(llama.info.d_model), 0.0, 0.9, 0.8, 10)
        return llama, llama, probe

    vec = {k: torch.randn(llama.info.d_model, generator=torch.Generator().manual_seed(i))
           for i, k in enumerate(dpo.DIRECTIONS)}
    table = pd.DataFrame({"validated": [False, True, False, False]}, index=list(dpo.DIRECTIONS))
    gates = {"one": dpo.DirectionGate(table, vec, "class-mean", 1, 1.0, 0.0, [], "x", {}),
             "none": dpo.DirectionGate(table.assign(validated=False), vec, None, 1, 1.0, 0.0, [], "x", {})}
    which = {"gate": "one"}
    monkeypatch.setattr(dpo_setup, "base_and_dpo", fake_base_and_dpo)
    monkeypatch.setattr(dpo_setup, "sweep_directions", lambda lm, probe, seed, progress: gates[which["gate"]])
    a = dpo.setup("smollm2-135m", "cpu", 0, {"n_pairs": 8}, n_prompts=3, n_wiki=2,
                  scorer="profanity-check").load(progress=False)
    assert seen["sizes"] == {**dpo.Sizes().training(), "n_pairs": 8, "n_prompts": 3, "n_wiki": 2}
    assert a.direction == "class-mean" and torch.equal(a.w, vec["class-mean"]) and a.pre_direction.met
    assert a.dpo_key == {"dpo_model": llama.name, "seed": 0, **dpo.Sizes(n_pairs=8).dpo_sizes()}
    assert a.n_neurons == llama.info.n_layers * llama.info.d_mlp
    assert "uses the 'class-mean' direction" in capsys.readouterr().out
    which["gate"] = "none"
    b = dpo.setup("smollm2-135m", "cpu", 0, fallback="toxic tokens", same_vector=False).load(progress=False)
    assert b.direction == "toxic tokens" and not b.pre_direction.met
    assert dpo.setup("smollm2-135m", "cpu", 0, direction=None).load(progress=False).gate is None
    calls = []
    monkeypatch.setattr(dpo_setup, "evaluate", lambda lm, table, **kw: calls.append(kw) or {"toxicity": 0.0})
    a.evaluate(llama, [], toxicity_only=True)
    a.evaluate(llama, None, positions="all")
    bound = dict(n_prompts=3, n_wiki=2, max_new_tokens=20, scorer="profanity-check")
    assert calls == [dict(bound, toxicity_only=True, positions="last"), dict(bound, toxicity_only=False, positions="all")]
    stats_calls = []
    monkeypatch.setattr(dpo_neurons, "pair_stats", lambda *args, **kw: stats_calls.append((args, kw)) or {})
    a.activations(progress=False)
    a.activations(progress=False, texts="base")  # the same-text variant (04)
    assert [kw["texts"] for _, kw in stats_calls] == ["own", "base"]
    assert all(args[3] == a.dpo_key and args[4] == a.stats_prompts and kw["k"] == a.sizes.last_k for args, kw in stats_calls)


def test_setup_references_are_the_shared_cached_evaluations(llama, monkeypatch):
    """references() is the same cache entry as the explicit reference_evaluations call it replaces in 03, 05, 06."""
    monkeypatch.setattr(dpo_setup, "base_and_dpo", lambda model_name, device, seed, progress, **s:
                        (llama, llama, dpo.Probe(torch.ones(llama.info.d_model), 0.0, 0.9, 0.8, 10)))
    a = dpo.setup("smollm2-135m", "cpu", 0, {"max_new_tokens": 3}, n_prompts=2, n_wiki=2, scorer="profanity-check",
                  direction=None).load(progress=False)
    ev_base, ev_dpo = a.references()
    entries = sorted(store.root().rglob("toxicity-perplexity-f1/*.json*"))
    assert len(entries) == 1  # the stand-in 'DPO model' is the base model itself: one record serves both
    explicit = dict(n_prompts=2, n_wiki=2, max_new_tokens=3, scorer="profanity-check", progress=False, details=True)
    ref = dpo_neurons.reference_evaluations("smollm2-135m", llama, llama, a.dpo_key, dpo.toxicity_perplexity_f1, **explicit)
    assert sorted(store.root().rglob("toxicity-perplexity-f1/*.json*")) == entries  # the explicit call reads the same record
    assert ref["base"]["continuations"] == ev_base["continuations"] and len(ev_dpo["toxicities"]) == 2
    table = a.reference_table(ev_base, ev_dpo)  # one row per model, the per-prompt details left out
    assert list(table["model"]) == ["base", "DPO"] and "toxicities" not in table and table["n_prompts"].tolist() == [2, 2]
    # the checks every model's evaluation must pass: a planted out-of-range toxicity fails references()
    bad = {"base": {**ev_base, "toxicity": 1.5}, "tuned": ev_dpo}
    monkeypatch.setattr(dpo_neurons, "reference_evaluations", lambda *args, **kw: bad)
    with pytest.raises(AssertionError, match="base evaluation is out of range"):
        a.references()


def test_setup_mean_activations_checks_shapes_and_finiteness(llama, monkeypatch, capsys):
    """mean_activations() returns both models' means and reports them; a NaN or a wrong shape is an error."""
    monkeypatch.setattr(dpo_setup, "base_and_dpo", lambda model_name, device, seed, progress, **s:
                        (llama, llama, dpo.Probe(torch.ones(llama.info.d_model), 0.0, 0.9, 0.8, 10)))
    a = dpo.setup("smollm2-135m", "cpu", 0, direction=None).load(progress=False)
    shape = (llama.info.n_layers, llama.info.d_mlp)
    act = {"base": torch.zeros(shape), "tuned": torch.ones(shape), "count": {"base": 3, "tuned": 4}}
    monkeypatch.setattr(a, "activations", lambda *args, **kw: act)
    m_base, m_dpo, got = a.mean_activations()
    assert torch.equal(m_dpo, act["tuned"]) and got is act and "shapes and finiteness: ok" in capsys.readouterr().out
    act["tuned"] = torch.full(shape, float("nan"))
    with pytest.raises(AssertionError, match="not finite"):
        a.mean_activations()
    act["tuned"] = torch.ones(shape[0], shape[1] + 1)
    with pytest.raises(AssertionError, match="expected"):
        a.mean_activations()
