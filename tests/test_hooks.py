"""Hooks checked against hand computation on tiny random models of all five families."""
import pytest
import torch

from lib import hooks, models


def _enc(lm, texts):
    return hooks.encode(lm, texts)


def _full_activations(lm, enc, layer):
    """The slow, obvious way: keep the whole [batch, pos, d_mlp] input of W_out."""
    seen = {}
    h = lm.mlp_out_module(layer).register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    try:
        with torch.no_grad():
            out = lm.model(**enc)
    finally:
        h.remove()
    return seen["x"], out


def _out(lm, enc):
    with torch.no_grad():
        return lm.model(**enc)[0]


def test_position_mask_left_and_right_padding():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    torch.testing.assert_close(hooks.position_mask(am, "last_k", k=2),
                               torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [1, 1, 0, 0, 0]]).float())
    torch.testing.assert_close(hooks.position_mask(am, "from", start=[1, 3, 1]),
                               torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 1, 0, 0, 0]]).float())
    with pytest.raises(ValueError, match="positions"):
        hooks.position_mask(am, "middle")
    with pytest.raises(ValueError, match="k > 0"):
        hooks.position_mask(am, "last_k", k=0)


@pytest.mark.parametrize("mode,k", [("all", None), ("last_k", 3)])
def test_streamed_means_equal_full_tensor_means(tiny, texts, mode, k):
    stats = hooks.mlp_activation_stats(tiny, texts, positions=mode, k=k, batch_size=3, pooled=True, progress=False)
    enc = _enc(tiny, texts)
    mask = hooks.position_mask(enc["attention_mask"], mode, k)
    for L in range(tiny.info.n_layers):
        x, _ = _full_activations(tiny, enc, L)  # [batch, pos, d_mlp]
        full = (x * mask[..., None]).sum((0, 1)) / mask.sum()
        torch.testing.assert_close(stats.mean[L], full.cpu(), atol=1e-5, rtol=1e-4)
        per_seq = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        torch.testing.assert_close(stats.pooled[:, L], per_seq.cpu(), atol=1e-5, rtol=1e-4)
    assert stats.count[0] == mask.sum()


def test_setting_a_neuron_to_its_observed_activation_changes_nothing(tiny):
    enc = _enc(tiny, ["the same text"])
    x, out = _full_activations(tiny, enc, 1)
    ref = out[0]
    neuron = 5
    # 'set' writes one value at all positions: use a one-token input so the observed value is unique
    enc1 = _enc(tiny, ["the"])
    x1, out1 = _full_activations(tiny, enc1, 1)
    vals = x1[0, :, neuron]
    with hooks.intervene(tiny, [(1, neuron, "set", float(v)) for v in vals[-1:]], positions="last"):
        torch.testing.assert_close(_out(tiny, enc1), out1[0])
    with hooks.intervene(tiny, [(1, neuron, "scale", 1.0), (0, 3, "add", 0.0)]):
        torch.testing.assert_close(_out(tiny, enc), ref)


def test_zeroing_a_neuron_equals_zeroing_its_value_vector(tiny):
    enc = _enc(tiny, ["zero this neuron please"])
    layer, neuron = 1, 7
    with hooks.intervene(tiny, [{"layer": layer, "neuron": neuron, "mode": "zero"}]):
        hooked = _out(tiny, enc)
    W = tiny.mlp_out_module(layer).weight
    saved = W.detach().clone()
    with torch.no_grad():
        if tiny.info.family == "gpt2":
            W[neuron] = 0  # Conv1D: [d_mlp, d_model]
        else:
            W[:, neuron] = 0  # Linear: [d_model, d_mlp]
    try:
        edited = _out(tiny, enc)
    finally:
        with torch.no_grad():
            W.copy_(saved)
    torch.testing.assert_close(hooked, edited)
    assert not torch.allclose(hooked, _out(tiny, enc))


def test_value_vectors_match_weights(tiny):
    vv = hooks.value_vectors(tiny)
    assert vv.shape == (tiny.info.n_layers, tiny.info.d_mlp, tiny.info.d_model)
    # the MLP output is activations @ value vectors (+ bias)
    enc = _enc(tiny, ["check the value vectors"])
    seen = {}
    mod = tiny.mlp_out_module(0)
    h = mod.register_forward_hook(lambda m, a, o: seen.update(x=a[0].detach(), y=o.detach()))
    with torch.no_grad():
        tiny.model(**enc)
    h.remove()
    bias = mod.bias if getattr(mod, "bias", None) is not None else 0
    torch.testing.assert_close(seen["x"] @ vv[0] + bias, seen["y"], atol=1e-5, rtol=1e-4)
    cos = hooks.cosine_with(vv[0], vv[0][3])
    assert cos.shape == (tiny.info.d_mlp,) and abs(float(cos[3]) - 1) < 1e-5


def test_hooks_are_gone_after_exit_even_on_error(tiny):
    mod = tiny.mlp_out_module(0)
    before = len(mod._forward_pre_hooks)
    with pytest.raises(RuntimeError):
        with hooks.intervene(tiny, [(0, 1, "zero", 0)]):
            assert len(mod._forward_pre_hooks) == before + 1
            raise RuntimeError("boom")
    assert len(mod._forward_pre_hooks) == before
    with hooks.MLPRecorder(tiny):
        pass
    assert len(mod._forward_pre_hooks) == before


def test_bad_interventions_fail_early(tiny):
    for table, match in [([(99, 0, "zero", 0)], "layer"), ([(0, 10_000, "zero", 0)], "neuron"),
                         ([(0, 0, "double", 0)], "mode")]:
        with pytest.raises(ValueError, match=match):
            with hooks.intervene(tiny, table):
                pass


def test_intervention_is_active_during_cached_generation(tiny_decoder):
    tok = tiny_decoder.tokenizer
    enc = tok(["a short prompt"], return_tensors="pt").to(tiny_decoder.model.device)
    gen = lambda: tiny_decoder.model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        plain = gen()
        table = [(L, n, "add", 50.0) for L in range(2) for n in range(64)]
        with hooks.intervene(tiny_decoder, table, positions="last"):
            edited = gen()
        again = gen()
    assert torch.equal(plain, again)
    assert not torch.equal(plain[:, enc["input_ids"].shape[1]:], edited[:, enc["input_ids"].shape[1]:])


def test_last_position_patch_in_cached_generation_writes_from_the_last_prompt_token_on(tiny_decoder):
    """The authors' patching protocol (lib.papers.dpo.PATCH_POSITIONS 'last'): under the KV cache, writing the
    last position of each forward call patches the last prompt token and every generated token, and
    leaves the prompt's other positions alone. A greedy loop without the cache that patches exactly
    those positions of the whole sequence must give the same tokens; patching every position differs."""
    tok, model = tiny_decoder.tokenizer, tiny_decoder.model
    prompt = tok("a short prompt to continue", return_tensors="pt")["input_ids"].to(model.device)
    table = [(L, n, "add", 3.0) for L in range(2) for n in range(0, 64, 2)]
    with torch.no_grad():
        with hooks.intervene(tiny_decoder, table, positions="last"):
            cached = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                    do_sample=False, pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:]
        seq = prompt
        for _ in range(5):
            with hooks.intervene(tiny_decoder, table, positions=list(range(prompt.shape[1] - 1, seq.shape[1]))):
                nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        with hooks.intervene(tiny_decoder, table, positions="all"):
            every = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                   do_sample=False, pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:]
    assert cached.tolist() == seq[0, prompt.shape[1]:].tolist()
    with torch.no_grad(), hooks.intervene(tiny_decoder, table, positions="last"):
        lg = model(input_ids=prompt).logits
    with torch.no_grad():
        plain = model(input_ids=prompt).logits
    torch.testing.assert_close(lg[:, :-1], plain[:, :-1])  # the prompt's earlier positions are untouched
    assert not torch.allclose(lg[:, -1], plain[:, -1])
    with torch.no_grad(), hooks.intervene(tiny_decoder, table, positions="all"):
        assert not torch.allclose(model(input_ids=prompt).logits[:, :-1], plain[:, :-1])
    assert every.shape == cached.shape


def test_residual_means(tiny, texts):
    for layer in (-1, 0, "embed", "final"):
        r = hooks.residual_means(tiny, texts, layer=layer, batch_size=2, progress=False)
        assert r.shape == (len(texts), tiny.info.d_model) and torch.isfinite(r).all()
    for bad in (17, -3, "last", 1.0):
        with pytest.raises(ValueError, match="layer"):
            hooks.residual_means(tiny, texts, layer=bad)


def test_pooled_residuals_keeps_input_order_and_matches_one_text_at_a_time(tiny, texts):
    """Batched by length, returned in input order: each row equals the text's state pooled alone
    (no padding), at every requested layer of the one pass."""
    layers = ("embed", 0, 1, -1, "final")
    got = hooks.pooled_residuals(tiny, texts, layers, batch_size=3, progress=False)
    assert list(got) == list(layers)
    for L in layers:
        alone = torch.cat([hooks.residual_means(tiny, [t], L, progress=False) for t in texts])
        torch.testing.assert_close(got[L], alone, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got[0], got[-1])
    assert torch.equal(got[1], got[-1])  # -1 is the last block (2 blocks)
    with pytest.raises(ValueError, match="layer"):
        hooks.pooled_residuals(tiny, texts, (0, 99))


def test_residual_layers_are_block_outputs(tiny, texts):
    """The layer convention, the slow way: L is what block L returns (the point residual_add edits),
    'embed' what enters block 0, 'final' the model's last hidden state (after the final norm); HF's
    hidden_states[i] is block i-1 for 0 < i < n_layers."""
    enc = _enc(tiny, texts)
    seen = {}
    hs = [hooks.block_module(tiny, L).register_forward_hook(
        lambda m, a, o, L=L: seen.__setitem__(L, (o[0] if isinstance(o, tuple) else o).detach()))
        for L in range(tiny.info.n_layers)]
    try:
        with torch.no_grad():
            res = tiny.model.base_model(**enc, output_hidden_states=True)
    finally:
        for h in hs:
            h.remove()
    m = enc["attention_mask"].unsqueeze(-1).float()
    pool = lambda h: (h.float() * m).sum(1) / m.sum(1)  # noqa: E731
    blocks = [hooks.block_module(tiny, L) for L in range(tiny.info.n_layers)]
    n_hooks = lambda: [(len(b._forward_hooks), len(b._forward_pre_hooks)) for b in blocks]  # noqa: E731
    before = n_hooks()  # (HF's own hidden_states recorder stays installed)
    got = hooks.pooled_residuals(tiny, texts, ("embed", 0, 1, "final"), batch_size=len(texts), progress=False)
    assert n_hooks() == before  # pooled_residuals removed its hooks
    for L in range(tiny.info.n_layers):
        torch.testing.assert_close(got[L], pool(seen[L]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["embed"], pool(res.hidden_states[0]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[0], pool(res.hidden_states[1]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got["final"], pool(res.last_hidden_state), atol=1e-5, rtol=1e-4)
    if tiny.info.family == "bert":  # no final norm: 'final' is the last block's output
        torch.testing.assert_close(got["final"], got[1])
    else:
        assert not torch.allclose(got["final"], got[1])
    assert hooks.residual_point(tiny, -1) == tiny.info.n_layers - 1


def test_compendium_attention_equals_eager_and_captures(tiny, texts):
    enc = _enc(tiny, texts)
    tiny.model.set_attn_implementation("eager")
    ref = _out(tiny, enc)
    rec = hooks.AttentionRecorder()
    with hooks.attention(tiny, capture=rec):
        got = _out(tiny, enc)
    assert tiny.model.config._attn_implementation == "eager"
    m = enc["attention_mask"].bool()
    torch.testing.assert_close(got[m], ref[m], atol=1e-5, rtol=1e-4)
    assert sorted(rec.patterns) == list(range(tiny.info.n_layers))
    p = rec.patterns[1]
    assert p.shape[:2] == (len(texts), tiny.info.n_heads)
    real_q = m[:, None, :].expand(p.shape[:3]).cpu()
    torch.testing.assert_close(p.sum(-1)[real_q], torch.ones(int(real_q.sum())))
    if tiny.info.is_causal:  # no attention to later positions
        upper = torch.triu(torch.ones(p.shape[-2:], dtype=torch.bool), diagonal=1)
        assert float((p * upper)[real_q].abs().max()) == 0


def test_identity_refinement_changes_nothing(tiny, texts):
    enc = _enc(tiny, texts)
    with hooks.attention(tiny):
        ref = _out(tiny, enc)
    with hooks.attention(tiny, refine=lambda s, valid, layer: s):
        got = _out(tiny, enc)
    torch.testing.assert_close(got, ref)
    with hooks.attention(tiny, refine=lambda s, valid, layer: s * 0.0, layers=[0]):
        flat = _out(tiny, enc)
    assert not torch.allclose(flat, ref)


def test_attention_plugs_are_explicit_and_gone_after_exit(tiny, texts):
    """Callbacks get the block index; nothing is set on the HF modules; an inner block takes over its
    layers and hands them back; every plug is gone after the outer block, even on error."""
    enc = _enc(tiny, texts)
    mods = [tiny.attention_module(L) for L in range(tiny.info.n_layers)]
    before = [set(vars(m)) for m in mods]
    impl = tiny.model.config._attn_implementation
    n_hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in tiny.model.modules())  # noqa: E731
    hooks_before = n_hooks()
    outer, inner = [], []
    with pytest.raises(RuntimeError, match="boom"):
        with hooks.attention(tiny, capture=lambda p, v, layer: outer.append(layer)) as plugs:
            assert sorted(plugs) == list(range(tiny.info.n_layers))
            assert [set(vars(m)) for m in mods] == before
            with hooks.attention(tiny, capture=lambda p, v, layer: inner.append(layer), layers=[-1]):
                _out(tiny, enc)
            assert outer == [0] and inner == [tiny.info.n_layers - 1]
            _out(tiny, enc)
            assert outer == [0, 0, 1] and all(type(L) is not bool and isinstance(L, int) for L in outer)
            raise RuntimeError("boom")
    assert n_hooks() == hooks_before
    assert tiny.model.config._attn_implementation == impl
    assert [set(vars(m)) for m in mods] == before
    _out(tiny, enc)
    assert outer == [0, 0, 1]  # no capture outside the block


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_residual_norm_is_the_median_over_real_tokens_after_the_first(family):
    lm = models.tiny_random(family)
    texts = ["the cat sat on the mat today", "a b", "hello there my friend"]
    L = 0  # (HF's last hidden state is after the final norm, so the reference reads an earlier block)
    seen = []
    for t in texts:  # one text at a time: no padding at all
        enc = hooks.encode(lm, [t])
        with torch.no_grad():
            out = lm.model(**enc, output_hidden_states=True)
        seen.append(out.hidden_states[L + 1][0, 1:].norm(dim=-1))  # hidden_states[L + 1] = output of block L
    ref = float(torch.cat(seen).median())
    assert hooks.residual_norm(lm, texts, L) == pytest.approx(ref, rel=1e-4)


# ----------------------------------------------------------------------------- same-text patching


def _planted_source(lm, layer, neurons):
    """A copy of ``lm`` whose MLP neurons ``neurons`` of ``layer`` (and nothing else) compute other
    activations: their rows of the up projection are perturbed. Copying exactly those neurons from it
    must turn ``lm`` into it; copying any others must change nothing."""
    import copy

    src = copy.deepcopy(lm)
    up = hooks.resolve(src, f"blocks.{layer}.mlp.hook_up")[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if hasattr(up, "nf"):  # GPT-2's Conv1D: weight [d_model, d_mlp]
            up.weight[:, neurons] += torch.randn(up.weight.shape[0], len(neurons), generator=g).to(up.weight) * 2
        else:  # nn.Linear: weight [d_mlp, d_model]
            up.weight[neurons] += torch.randn(len(neurons), up.weight.shape[1], generator=g).to(up.weight) * 2
    return src


def test_copy_activations_finds_the_planted_neurons_and_only_them(tiny_decoder, texts):
    from lib import metrics

    layer, planted, others = 1, [3, 7, 11], [4, 8, 12]
    src = _planted_source(tiny_decoder, layer, planted)
    enc = _enc(tiny_decoder, texts)
    own, theirs = _out(tiny_decoder, enc), _out(src, enc)
    assert not torch.allclose(own, theirs, atol=1e-4)  # the planted change shows in the output
    with hooks.copy_activations(src, tiny_decoder, [(layer, i) for i in planted], positions="all"):
        torch.testing.assert_close(_out(tiny_decoder, enc), theirs, atol=1e-5, rtol=1e-4)
        # generation: the source runs in lockstep with its own KV cache, so the target writes the source's text
        copied = metrics.generate(tiny_decoder, texts, max_new_tokens=6, batch_size=2, progress=False)
    ref = metrics.generate(src, texts, max_new_tokens=6, batch_size=2, progress=False)
    assert copied.new_ids == ref.new_ids
    with hooks.copy_activations(src, tiny_decoder, [(layer, i) for i in others], positions="all"):
        torch.testing.assert_close(_out(tiny_decoder, enc), own, atol=1e-5, rtol=1e-4)  # the others are the same
    torch.testing.assert_close(_out(tiny_decoder, enc), own)  # hooks gone after the block


def test_copy_activations_last_writes_each_new_token(tiny_decoder):
    from lib import metrics

    layer, planted = 0, [1, 2, 5, 9]
    src = _planted_source(tiny_decoder, layer, planted)
    # prompts cut to one token: 'last' then writes every position of every forward, as 'all' does
    one = {"max_new_tokens": 6, "max_prompt_tokens": 1, "progress": False}
    with hooks.copy_activations(src, tiny_decoder, [(layer, i) for i in planted], positions="last"):
        copied = metrics.generate(tiny_decoder, ["the", "a b"], **one)
    assert copied.new_ids == metrics.generate(src, ["the", "a b"], **one).new_ids
    enc = _enc(tiny_decoder, ["a longer prompt of several tokens"])
    with hooks.copy_activations(src, tiny_decoder, [(layer, i) for i in planted], positions="last"):
        last = _out(tiny_decoder, enc)
    # the obvious way: the source's activations of the planted neurons at the last position, set there by intervene
    x_src, _ = _full_activations(src, enc, layer)  # [1, pos, d_mlp]
    with hooks.intervene(tiny_decoder, [(layer, i, "set", float(x_src[0, -1, i])) for i in planted], positions="last"):
        torch.testing.assert_close(last, _out(tiny_decoder, enc), atol=1e-5, rtol=1e-4)
    own = _out(tiny_decoder, enc)
    torch.testing.assert_close(last[:, :-1], own[:, :-1])  # earlier positions are the target's own
    assert not torch.allclose(last[:, -1], own[:, -1], atol=1e-4)


def test_copy_activations_rejects_bad_arguments(tiny_decoder):
    with pytest.raises(ValueError, match="two different models"):
        with hooks.copy_activations(tiny_decoder, tiny_decoder, [(0, 1)]):
            pass
    src = _planted_source(tiny_decoder, 0, [1])
    with pytest.raises(ValueError, match="positions"):
        with hooks.copy_activations(src, tiny_decoder, [(0, 1)], positions="first"):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with hooks.copy_activations(src, tiny_decoder, [(0, tiny_decoder.info.d_mlp)]):
            pass


def test_copy_activations_each_gives_each_copy_its_own_neurons(tiny_decoder):
    """Several neuron sets in one batch (one per copy of each prompt): the same generations as each set copied
    alone, for both positions; the batch must hold the copies."""
    from lib import metrics

    src = _planted_source(tiny_decoder, 1, [3, 7, 11])
    prompts = ["the cat sat on the mat", "a b", "hello there my friend", "one"]
    kw = {"max_new_tokens": 6, "progress": False}
    sets = [[(1, 3), (1, 7), (1, 11)], [], [(0, 2), (1, 7)]]
    for positions in ("last", "all"):
        with hooks.copy_activations_each(src, tiny_decoder, sets, positions):
            each = metrics.generate(tiny_decoder, prompts, copies=len(sets), **kw)
        alone = []
        for cells in sets:
            with hooks.copy_activations(src, tiny_decoder, cells, positions):
                alone.append(metrics.generate(tiny_decoder, prompts, **kw).new_ids)
        assert [g.new_ids for g in each] == alone
        assert alone[0] != alone[1]  # the sets differ in what they write, so a mix-up of rows would show
    assert alone[1] == metrics.generate(tiny_decoder, prompts, **kw).new_ids  # an empty set: the target's own
    assert not hooks.hooked(tiny_decoder)
    with pytest.raises(ValueError, match="copies"), hooks.copy_activations_each(src, tiny_decoder, sets):
        metrics.generate(tiny_decoder, prompts, copies=2, **kw)
    with pytest.raises(ValueError, match="at least one"), hooks.copy_activations_each(src, tiny_decoder, []):
        pass


PROMPTS = ["the cat sat on the mat", "a b", "hello there my friend , how are you today ?", "one", "x y z w"]


def test_prompt_prefix_gives_the_same_continuations_and_checks_what_it_was_built_for(tiny_decoder):
    from lib import metrics

    kw = {"max_new_tokens": 6, "progress": False, "batch_size": 2}
    prefix = metrics.prompt_prefix(tiny_decoder, PROMPTS, batch_size=2)
    assert metrics.generate(tiny_decoder, PROMPTS, prefix=prefix, **kw).new_ids == metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids
    with pytest.raises(ValueError, match="other prompts or another batch size"):
        metrics.generate(tiny_decoder, PROMPTS[:3], prefix=prefix, **kw)
    with pytest.raises(ValueError, match="other prompts or another batch size"):
        metrics.generate(tiny_decoder, PROMPTS, prefix=prefix, **{**kw, "batch_size": 3})
    with pytest.raises(RuntimeError, match="without hooks"), hooks.intervene(tiny_decoder, [(0, 1, "zero")]):
        metrics.prompt_prefix(tiny_decoder, PROMPTS)
    other = models.tiny_random(tiny_decoder.info.family)
    with pytest.raises(ValueError, match="another model"):
        metrics.generate(other, PROMPTS, prefix=prefix, **kw)


def test_a_last_position_patch_from_the_shared_prefix_equals_the_full_prompt_pass(tiny_decoder):
    """The prefix holds the positions a 'last' patch never writes: starting from it under the patch gives
    the tokens of the whole prompt pass under the same patch."""
    from lib import metrics

    kw = {"max_new_tokens": 6, "progress": False}
    table = [(L, n, "add", 3.0) for L in range(2) for n in range(0, 64, 2)]
    prefix = metrics.prompt_prefix(tiny_decoder, PROMPTS)
    with hooks.intervene(tiny_decoder, table, positions="last"):
        full = metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids
        shared = metrics.generate(tiny_decoder, PROMPTS, prefix=prefix, **kw).new_ids
    assert shared == full
    assert full != metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids  # the patch changes the tokens


@pytest.mark.parametrize("positions", ["last", "all"])
def test_intervene_each_gives_each_copy_its_own_table(tiny_decoder, positions):
    from lib import metrics

    kw = {"max_new_tokens": 6, "progress": False}
    tables = [[(L, n, "add", 3.0) for L in range(2) for n in range(0, 64, 2)], [],
              [(1, n, "set", -2.0) for n in range(0, 64, 3)] + [(0, 5, "scale", 4.0), (0, 7, "zero", 0.0)]]
    with hooks.intervene_each(tiny_decoder, tables, positions=positions):
        each = metrics.generate(tiny_decoder, PROMPTS, copies=len(tables), **kw)
    alone = []
    for t in tables:
        with hooks.intervene(tiny_decoder, t, positions=positions):
            alone.append(metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids)
    assert [g.new_ids for g in each] == alone
    assert alone[0] != alone[1] != alone[2]  # the conditions differ, so a mix-up of rows would show
    assert not hooks.hooked(tiny_decoder)
    with pytest.raises(ValueError, match="copies"), hooks.intervene_each(tiny_decoder, tables):
        metrics.generate(tiny_decoder, PROMPTS, copies=2, **kw)
    with pytest.raises(ValueError, match="at least one table"), hooks.intervene_each(tiny_decoder, []):
        pass


def test_residual_add_with_one_vector_per_copy(tiny_decoder):
    from lib import metrics

    kw = {"max_new_tokens": 5, "progress": False}
    g = torch.Generator().manual_seed(0)
    vecs = torch.randn(3, tiny_decoder.info.d_model, generator=g) * 4
    vecs[1] = 0
    layer = tiny_decoder.info.n_layers - 1
    prefix = metrics.prompt_prefix(tiny_decoder, PROMPTS)  # after the last block: no cached position sees the vector
    with hooks.residual_add(tiny_decoder, vecs, [layer]):
        each = metrics.generate(tiny_decoder, PROMPTS, copies=3, prefix=prefix, **kw)
    alone = []
    for v in vecs:
        with hooks.residual_add(tiny_decoder, v, [layer]):
            alone.append(metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids)
    assert [x.new_ids for x in each] == alone
    assert alone[1] == metrics.generate(tiny_decoder, PROMPTS, **kw).new_ids and alone[0] != alone[1]
    with pytest.raises(ValueError, match="shape"):
        with hooks.residual_add(tiny_decoder, torch.zeros(2, 3, tiny_decoder.info.d_model)):
            pass


def test_copy_activations_refuses_a_prefilled_cache(tiny_decoder):
    from lib import metrics

    src = _planted_source(tiny_decoder, 0, [1, 2])
    prefix = metrics.prompt_prefix(tiny_decoder, PROMPTS)
    with pytest.raises(RuntimeError, match="prefilled cache"):
        with hooks.copy_activations(src, tiny_decoder, [(0, 1), (0, 2)]):
            metrics.generate(tiny_decoder, PROMPTS, max_new_tokens=3, progress=False, prefix=prefix)
