"""Planted-effect tests: the positive and negative controls of each causal method.

Each method runs here as the notebooks run it (lib.papers.relations, lib.papers.dpo.neurons, lib.hooks, lib.papers.saobp,
lib.stats, lib.verdict) on tiny random-weight Llama models built from configs, in pairs:

* a model where the effect is planted by construction must give the verdict "holds";
* the same pipeline on the model without the plant must not.

So a "does not hold" in a notebook means the method could have seen the effect, and a "holds" means
it does not appear on a model that has none.

How the plants are made. A tiny model's hidden dimension ``FEATURE`` is made *private*: it is zeroed
in every token embedding and in every weight that reads or writes it (attention, MLP, LM head), so
nothing in the random model uses it. A plant then writes a value into that dimension of chosen token
embeddings and wires chosen MLP neurons (gate and up rows) to read it, so those neurons, and only
they, fire on those tokens; their W_out columns write a chosen token's unembedding. Attention
collapse is planted by scaling up the query and key weights of the deep layers. The final norm is
sharpened (x ``SHARPEN``) so that what the planted neurons write moves log-probabilities by nats,
not by the hundredths a random model's flat logits allow; both arms of a pair get it.

Criteria are stated before any measurement, as the notebooks state theirs.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from lib import data, hooks, models, stats, verdict
from lib.papers import dpo, relations, saobp
from lib.papers.dpo import neurons as dn

FEATURE = 0  # the private hidden dimension that plants use
SHARPEN = 10.0  # final-norm gain (logits x 10): a random model's logits are otherwise nearly flat
N_CONTROLS = 19  # random neuron sets per control distribution: the fewest with which the rank test reaches p <= 0.05

# ----------------------------------------------------------------------------- criteria (before results)

IDENTIFICATION = verdict.Criterion(
    finding="lib's AP identification ranks a relation's neurons at the top",
    paper="C: relation-specific neurons are found by average precision",
    effect="mean rank percentile of the planted neurons' gate and up units in Study.top's order for r, minus 0.5 (chance)",
    threshold=0.4, control=f"{N_CONTROLS} site-and-layer-matched random unit sets (relations.random_units)")
DEACTIVATION = verdict.Criterion(
    finding="switching off r's top-AP neurons lowers recall of r",
    paper="C: deactivating relation-specific neurons lowers the relation's accuracy",
    effect="gold answer's first-token log-prob on r's test prompts, top-k of r off minus none (nats)",
    threshold=-1.0, direction="less",
    control=f"k layer-matched random neurons off ({N_CONTROLS} seeds)")
SHARES = verdict.Criterion(
    finding="the neurons whose activation changed carry the projection change along w",
    paper="A: the projection change of DPO is carried by identifiable neuron groups",
    effect="share of the positive projection change along w carried by the set, per prompt (0..1)",
    threshold=0.5, control=f"{N_CONTROLS} layer-matched random neuron sets")
PATCHING = verdict.Criterion(
    finding="patching the set to the copy's mean activations reproduces the copy's output change",
    paper="A: patching neuron groups into the base model reproduces DPO",
    effect="log-prob of w's token after each prompt, base with the set patched minus base (nats)",
    threshold=-1.0, direction="less",
    control=f"{N_CONTROLS} layer-matched random sets patched to the copy's means")
ENTROPY = verdict.Criterion(
    finding="attention entropy falls in deeper layers",
    paper="B: attention entropy collapses in the deeper layers of small models",
    effect="normalised attention entropy per text, mean over the last third of layers minus the first third",
    threshold=-0.1, direction="less", needs_control=False,
    control="the same texts' first third of layers (paired per text)")

# the preconditions' thresholds, also stated before any result
MIN_ITEMS = 30  # prompts, texts or neurons behind an interval
MIN_ACCURACY = 0.5  # "the model knows the relation": baseline accuracy on r's test facts
MIN_COPY_CHANGE = -1.0  # "the copy changes the output": its change of w's token log-prob (nats)


# ----------------------------------------------------------------------------- construction


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these models' matrices are too small to gain from two, and on 2 shared
    cores a second thread mostly waits (measured here while other jobs ran: this file took 47 s with
    one thread at load 9, 65-159 s with two at load 3-6)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """lib.papers.relations caches its runs by model name; these tests write to a folder of their own."""
    from lib.infra import paths

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "CACHE", tmp_path_factory.mktemp("planted-cache"))
        yield


def tiny_llama(**overrides) -> models.Loaded:
    """A tiny random Llama (seed 0) whose FEATURE dimension nothing reads or writes, with a sharpened
    final norm and a decoder-style tokenizer ([CLS] as BOS, no [SEP] after the text: the MiniLM
    tokenizer of the tiny models appends one, which would stand between a prompt and its answer)."""
    cfg = dict(hidden_size=64, head_dim=16, intermediate_size=128)
    lm = models.tiny_random("llama", seed=0, **{**cfg, **overrides})
    tok = lm.tokenizer
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A", pair="[CLS] $A $B", special_tokens=[("[CLS]", tok.cls_token_id)])
    m = lm.model
    with torch.no_grad():
        m.get_input_embeddings().weight[:, FEATURE] = 0
        for layer in m.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            for p in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
                p.weight[:, FEATURE] = 0  # [out, d_model]: nothing reads FEATURE
            a.o_proj.weight[FEATURE] = 0  # [d_model, in]: nothing writes it
            mlp.down_proj.weight[FEATURE] = 0
        m.lm_head.weight[:, FEATURE] = 0
        m.model.norm.weight.mul_(SHARPEN)
    return lm


def token_id(lm: models.Loaded, word: str) -> int:
    ids = lm.tokenizer(word, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, f"{word!r} is not one token"
    return ids[0]


def unembedding_direction(lm: models.Loaded, word: str) -> torch.Tensor:
    """[d_model] unit vector along ``word``'s row of the LM head (FEATURE left at 0)."""
    g = lm.model.lm_head.weight[token_id(lm, word)].detach().clone()
    g[FEATURE] = 0
    return g / g.norm()


def wire(lm: models.Loaded, neurons, tokens=None, value: float = 0.05, gain: float = 5.0,
         writes: torch.Tensor | None = None):
    """Plant: ``tokens`` (default: every token) carry ``value`` in FEATURE; each (layer, neuron) reads
    FEATURE alone (gate and up rows gain * e_FEATURE), so it fires there and is exactly 0 elsewhere,
    and writes ``writes`` (its W_out column) when given."""
    emb = lm.model.get_input_embeddings().weight
    with torch.no_grad():
        emb[slice(None) if tokens is None else list(tokens), FEATURE] = value
        for L, i in np.asarray(neurons, dtype=int).reshape(-1, 2):
            mlp = lm.model.model.layers[L].mlp
            for p in (mlp.gate_proj, mlp.up_proj):
                p.weight[i] = 0
                p.weight[i, FEATURE] = gain
            if writes is not None:
                mlp.down_proj.weight[:, i] = writes


def chosen_neurons(lm: models.Loaded, layer: int, n: int, seed: int) -> np.ndarray:
    """[n, 2] (layer, neuron) drawn at random in one layer, sorted."""
    idx = np.sort(np.random.default_rng(seed).choice(lm.info.d_mlp, n, replace=False))
    return np.stack([np.full(n, layer), idx], 1)


# ----------------------------------------------------------------------------- paper C: identification, deactivation

RELATION = "capital"  # the relation that gets planted neurons
GOLD = {"capital": "paris", "colour": "blue", "language": "french"}  # one answer token per relation
TEMPLATE = "the fact about {}"  # shared by all relations: only what is planted tells them apart
N_IDENT, N_TEST = 30, 40  # facts per relation
N_PLANTED = 32  # neurons of the relation, all in the last layer (layer-matched controls draw from it)


def fact_relations(lm: models.Loaded) -> dict[str, dict]:
    """Three relations of single-token subjects (distinct vocabulary words, seeded), each answered by
    its own one-token object, as a facts dict for ``relations.setup`` (one shared template)."""
    vocab = lm.tokenizer.get_vocab()
    taken = set(TEMPLATE.split()) | set(GOLD.values())
    words = sorted(w for w, i in vocab.items() if 2000 < i < 29000 and w.isascii() and w.isalpha()
                   and len(w) >= 4 and w not in taken)
    pick = np.random.default_rng(0).choice(len(words), len(GOLD) * (N_IDENT + N_TEST), replace=False)
    out = {}
    for j, name in enumerate(sorted(GOLD)):
        facts = [{"subject": words[i], "object": GOLD[name]}
                 for i in pick[j * (N_IDENT + N_TEST):(j + 1) * (N_IDENT + N_TEST)]]
        out[name] = {"templates": [TEMPLATE], "samples": facts, "language": "en"}
    return out


def relation_model(arm: str):
    """(model, facts, planted neurons) for one arm:

    planted  N_PLANTED neurons of the last layer fire on the relation's subject tokens (and on
             nothing else) and write its answer's unembedding: the model answers through them;
    random   the same model without the plant (it does not know the relation);
    direct   the relation's subject embeddings carry its answer's unembedding themselves, so the
             model answers correctly with no neuron involved: knowing the relation is not enough.
    """
    lm = tiny_llama(intermediate_size=256)
    facts = fact_relations(lm)
    subjects = [token_id(lm, f["subject"]) for f in facts[RELATION]["samples"]]
    planted = chosen_neurons(lm, lm.info.n_layers - 1, N_PLANTED, seed=1)
    answer = unembedding_direction(lm, GOLD[RELATION])
    if arm == "planted":
        wire(lm, planted, subjects, writes=4.0 * answer)
    elif arm == "direct":
        with torch.no_grad():
            lm.model.get_input_embeddings().weight[subjects] += 2.0 * answer
    elif arm != "random":
        raise ValueError(arm)
    return lm, facts, planted


def planted_units(study: relations.Study, planted: np.ndarray) -> np.ndarray:
    """Flat unit indices of the planted neurons at the gate and up sites (each one's output units)."""
    out = []
    for off_site, (site, L, off, w) in enumerate(study.units.blocks()):
        if site in ("gate", "up"):
            out += [off + i for Lp, i in planted.tolist() if Lp == L]
    return np.sort(np.array(out, dtype=np.int64))


def rank_percentiles(study: relations.Study, name: str, units: np.ndarray) -> np.ndarray:
    """1 - rank / n_units of each unit in the study's order for ``name`` (best first): 1 = top."""
    order = study.top(name, study.units.size)
    rank = np.empty(study.units.size, dtype=np.int64)
    rank[order] = np.arange(study.units.size)
    return 1 - rank[np.asarray(units)] / study.units.size


@pytest.fixture(scope="module", params=["planted", "random", "direct"])
def relation_run(request):
    """The notebooks' pipeline (relations.setup, the paper's protocol: up, gate and down units) on one
    arm: screen, select, identify, top-k, deactivate, matched random-k controls."""
    arm = request.param
    lm, facts, planted = relation_model(arm)
    study = relations.setup(f"tiny-planted-{arm}", lm=lm, facts=facts, n_test=N_TEST, min_correct=20,
                            max_ident=N_IDENT, k=2 * N_PLANTED, progress=False)
    out = {"arm": arm, "lm": lm, "planted": planted, "study": study, "selected": RELATION in study.names}
    if not out["selected"]:
        return out
    units = planted_units(study, planted)
    top = study.top(RELATION)
    runs = {"none": study.run(only=RELATION), "top": study.run(off=top, only=RELATION)}
    for s in range(N_CONTROLS):
        runs[f"random{s}"] = study.run(off=study.random_like(top, seed=s), only=RELATION)
    out.update(units=units, top=top, by={c: df.sort_values("item") for c, df in runs.items()})
    return out


def test_identification_finds_planted_neurons(relation_run):
    r = relation_run
    if r["arm"] == "random":  # the model does not know the relation: the pipeline must not select it
        assert not r["selected"], r["study"].screen
        return
    assert r["selected"], r["study"].screen
    study, units = r["study"], r["units"]
    pct = rank_percentiles(study, RELATION, units)
    est = stats.bootstrap_mean(pct - 0.5)
    ctl = [rank_percentiles(study, RELATION, study.random_like(units, seed=s)).mean() - 0.5 for s in range(N_CONTROLS)]
    v = verdict.decide(IDENTIFICATION, est, [verdict.require("planted units", len(units), ">=", MIN_ITEMS)],
                       stats.against_controls(est.value, ctl))
    precision = len(set(r["top"].tolist()) & set(units.tolist())) / len(r["top"])  # share of the top-k that is planted
    if r["arm"] == "planted":
        assert v.verdict == "holds", v
        assert precision >= 0.9, precision
    else:  # the 'planted' indices are ordinary neurons here
        assert v.verdict != "holds", v
        assert precision <= 0.25, precision


def test_deactivation_lowers_recall_through_planted_neurons(relation_run):
    r = relation_run
    if not r["selected"]:  # a random model does not know the relation: the test cannot run
        v = verdict.decide(DEACTIVATION, None, [verdict.require("r selected (answered right often enough)", 0, ">=", 1)])
        assert r["arm"] == "random" and v.verdict == "inconclusive" and "precondition not met" in v.reason, v
        return
    by = r["by"]
    none, top = by["none"], by["top"]
    est = stats.paired_bootstrap(top["logprob"].to_numpy(), none["logprob"].to_numpy())
    ctl = [float((by[f"random{s}"]["logprob"].to_numpy() - none["logprob"].to_numpy()).mean())
           for s in range(N_CONTROLS)]
    accuracy = float(none["correct"].mean())
    pre = [verdict.require("accuracy on r's test facts (the model knows r)", accuracy, ">=", MIN_ACCURACY),
           verdict.require("test prompts", len(none), ">=", MIN_ITEMS)]
    v = verdict.decide(DEACTIVATION, est, pre, stats.against_controls(est.value, ctl, greater=False))
    acc = stats.mcnemar(top["correct"].to_numpy(), none["correct"].to_numpy())  # facts lost / gained
    if r["arm"] == "planted":
        assert v.verdict == "holds", v
        assert acc.lost >= 0.9 * len(none) and acc.pvalue < 1e-6, acc
    elif r["arm"] == "random":  # a random model does not know the relation: the test cannot run
        assert v.verdict == "inconclusive" and "precondition not met" in v.reason, v
    else:  # knows the relation, but not through neurons: the identified neurons change nothing
        assert accuracy >= MIN_ACCURACY
        assert v.verdict != "holds", v
        assert acc.lost == 0, acc


# ----------------------------------------------------------------------------- paper A: projection shares, patching

N_SET = 16  # neurons in the set S (last layer)
WORD = "bad"  # w = this token's centred unembedding; S writes along it
MAX_TOKENS = 16  # prompt tokens kept (the first ones)
WRITE = 3e-3  # |W_out column| of S: the base model's S write is comparable to the rest of the residual


def copy_pair(arm: str):
    """(base, copy, S, w) for one arm. In the base model S reads a feature every token carries and
    writes along w (a 'toxic' group).

    planted    the copy's S neurons have their up rows x 0.2: their activations fall by 80%;
    same       the copy is the base model (no shift anywhere);
    elsewhere  the copy shifts another random set of the same layer, whose value vectors are random.
    """
    base = tiny_llama()
    S = chosen_neurons(base, base.info.n_layers - 1, N_SET, seed=2)
    w = hooks.token_direction(base, [WORD])
    w[FEATURE] = 0
    wire(base, S, gain=1.0, writes=WRITE * w / w.norm())
    tuned = copy.deepcopy(base)
    shifted = {"planted": S, "same": S[:0],
               "elsewhere": dpo.random_neurons(S, base.info.n_layers, base.info.d_mlp, seed=99)}[arm]
    with torch.no_grad():
        for L, i in shifted:
            up = tuned.model.model.layers[L].mlp.up_proj.weight
            up[i] *= 0.2 if arm == "planted" else 5.0
    return base, tuned, S, w


def per_prompt_means(lm, gen, k):
    """[n_prompts, n_layers, d_mlp]: generation_stats' statistic per prompt (last k of prompt + continuation)."""
    st = hooks.mlp_activation_stats(lm, gen.full_texts, positions="last_k", k=k, pooled=True, progress=False)
    return st.pooled


def last_logprob(lm, prompts, token: int, table=None) -> np.ndarray:
    """Log-prob of ``token`` after each prompt (its first MAX_TOKENS tokens), with an intervention table active."""
    enc = hooks.encode(lm, prompts, max_length=MAX_TOKENS)
    with hooks.intervene(lm, [] if table is None else table), torch.no_grad():
        logits = lm.model(**enc, logits_to_keep=1).logits[:, -1].float()  # [n, vocab]
    return torch.log_softmax(logits, -1)[:, token].numpy()


@pytest.fixture(scope="module", params=["planted", "same", "elsewhere"])
def pair_run(request):
    arm = request.param
    base, tuned, S, w = copy_pair(arm)
    prompts = data.challenge_prompts(80)
    stats_prompts, eval_prompts = prompts[:40], prompts[40:]  # statistics and evaluation disjoint
    k = 6  # tokens generated, and last positions counted (notebooks 03-06: 20 and 20)
    kw = dict(max_new_tokens=k, k=k, max_prompt_tokens=MAX_TOKENS, progress=False)
    sb, gb = dn.generation_stats(base, stats_prompts, **kw)
    st, gt = dn.generation_stats(tuned, stats_prompts, **kw)
    return {"arm": arm, "base": base, "tuned": tuned, "S": S, "w": w, "k": k, "m_base": sb.mean, "m_tuned": st.mean,
            "gen_base": gb, "gen_tuned": gt, "eval_prompts": eval_prompts}


def test_projection_shares_point_to_the_shifted_neurons(pair_run):
    r = pair_run
    base, tuned, S, w = r["base"], r["tuned"], r["S"], r["w"]
    delta = dn.projection_deltas(base, tuned, r["m_base"], r["m_tuned"], w)  # [n_layers, d_mlp], notebooks 03-05
    total = float(delta.clamp_min(0).sum())
    pre = [verdict.require("positive projection change along w (the copy differs)", total, ">", 1e-6),
           verdict.require("prompts", len(r["gen_base"].prompts), ">=", MIN_ITEMS)]
    est, ctl = None, None
    if pre[0].met:
        pb, pt = per_prompt_means(base, r["gen_base"], r["k"]), per_prompt_means(tuned, r["gen_tuned"], r["k"])
        deltas = [dn.projection_deltas(base, tuned, pb[p], pt[p], w) for p in range(len(pb))]
        sets = [dpo.random_neurons(S, base.info.n_layers, base.info.d_mlp, seed=s) for s in range(N_CONTROLS)]

        def share(neurons):  # per prompt; a prompt with no positive change counts as a share of 0
            return np.nan_to_num([dn.positive_share(d, neurons.tolist()) for d in deltas])
        est = stats.bootstrap_mean(share(S))
        ctl = stats.against_controls(est.value, [share(s).mean() for s in sets])
    v = verdict.decide(SHARES, est, pre, ctl)
    if r["arm"] == "planted":
        assert v.verdict == "holds", v
        assert dn.positive_share(delta, S.tolist()) >= 0.9  # the notebooks' pooled statistic agrees
    elif r["arm"] == "same":
        assert total == 0 and v.verdict == "inconclusive" and "precondition not met" in v.reason, v
    else:
        assert v.verdict != "holds", v


def test_patching_recovers_the_copy_change(pair_run):
    r = pair_run
    base, tuned, S = r["base"], r["tuned"], r["S"]
    prompts, token = r["eval_prompts"], token_id(base, WORD)
    lp_base, lp_tuned = last_logprob(base, prompts, token), last_logprob(tuned, prompts, token)
    copy_change = float((lp_tuned - lp_base).mean())
    pre = [verdict.require("the copy's change of w's token log-prob (nats)", copy_change, "<=", MIN_COPY_CHANGE),
           verdict.require("evaluation prompts", len(prompts), ">=", MIN_ITEMS)]
    lp_patch = last_logprob(base, prompts, token, dn.patch_table(S.tolist(), r["m_tuned"]))  # notebook 05
    est = stats.paired_bootstrap(lp_patch, lp_base)
    sets = [dpo.random_neurons(S, base.info.n_layers, base.info.d_mlp, seed=s) for s in range(N_CONTROLS)]
    ctl = [float((last_logprob(base, prompts, token, dn.patch_table(s.tolist(), r["m_tuned"])) - lp_base).mean())
           for s in sets]
    v = verdict.decide(PATCHING, est, pre, stats.against_controls(est.value, ctl, greater=False))
    # notebook 05's shift variant: each token keeps its activation, moved by (copy - base) means
    shift = dn.patch_table(S.tolist(), r["m_tuned"] - r["m_base"]).assign(mode="add")
    lp_shift = last_logprob(base, prompts, token, shift)
    if r["arm"] == "planted":
        assert v.verdict == "holds", v
        assert dn.reduction_share(lp_base.mean(), lp_patch.mean(), lp_tuned.mean()) >= 0.5
        assert dn.reduction_share(lp_base.mean(), lp_shift.mean(), lp_tuned.mean()) >= 0.5
    else:
        assert v.verdict != "holds", v
    if r["arm"] == "same":  # no change: a zero shift is no intervention at all
        assert (r["m_tuned"] == r["m_base"]).all()
        np.testing.assert_array_equal(lp_shift, lp_base)
        assert v.verdict == "inconclusive" and "precondition not met" in v.reason, v


# ----------------------------------------------------------------------------- paper B: attention entropy

N_TEXTS = 40


def attention_model(arm: str) -> models.Loaded:
    """A tiny random Llama of 6 layers. planted: the last two layers' query and key weights x 30, so
    their attention logits grow 900-fold and each query attends to a few keys (collapse);
    shallow: the same in the first two layers (entropy then rises with depth); random: unmodified."""
    lm = models.tiny_random("llama", seed=0, num_hidden_layers=6)
    layers = {"planted": (4, 5), "shallow": (0, 1), "random": ()}[arm]
    with torch.no_grad():
        for L in layers:
            a = lm.model.model.layers[L].self_attn
            a.q_proj.weight.mul_(30.0)
            a.k_proj.weight.mul_(30.0)
    return lm


@pytest.mark.parametrize("arm", ["planted", "shallow", "random"])
def test_entropy_statistic_detects_planted_collapse(arm):
    lm = attention_model(arm)
    texts = [r["prompt"].strip() + " " + r["gold"] for r in data.wiki_samples(N_TEXTS)]
    enc = hooks.encode(lm, texts, max_length=32)
    st = saobp.attention_stats(lm, enc, batch_size=20, keep_sequences=True)  # notebook 07's statistic
    e = st.per_sequence("entropy_norm")  # [n_texts, n_layers], head means
    third = max(1, lm.info.n_layers // 3)
    est = stats.paired_bootstrap(e[:, -third:].mean(1), e[:, :third].mean(1))
    v = verdict.decide(ENTROPY, est, [verdict.require("texts", len(e), ">=", MIN_ITEMS)])
    if arm == "planted":
        assert v.verdict == "holds", v
    else:
        assert v.verdict != "holds", v
    if arm == "shallow":  # a rise with depth: the interval excludes a fall of the threshold's size
        assert v.verdict == "does not hold", v
