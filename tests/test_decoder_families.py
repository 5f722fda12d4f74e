"""Two decoder families declared outside jaxattn on its public decoder API alone (tests/families/: a
GPT-J-style block, attention and MLP in parallel from one LayerNorm, partial RoPE, untied head with a bias;
a small Gemma-2-like model, sandwich RMSNorms, GeGLU, soft caps, alternating sliding windows, grouped
keys and values, tied soft-capped head). For each: its own code is short, names nothing private of jaxattn
and declares the model protocol (``SPEC``); its forward (logits, every attention map, every hidden state,
at T larger than the window), greedy generation from a short and a long prompt, span scores, gradients,
forwards resumed at each layer and head-ablation tables agree with a float64 NumPy forward written here,
independent of jaxattn."""

import ast
import functools
import io
import tokenize
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from families import gemma2like, gptj
from jaxattn import decoder, interventions, models

TOL = 1e-5
T = 12  # every sequence's length: larger than the window
W = 3  # the Gemma-2-like sliding window
GPTJ = gptj.GPTJConfig(vocab_size=40, n_positions=16, n_embd=32, n_layer=3, n_head=4, n_inner=64, rotary_dim=4)
GEMMA = gemma2like.Gemma2LikeConfig(
    vocab_size=40, max_position_embeddings=16, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=W, attn_logit_softcapping=2.0,
    final_logit_softcapping=8.0, query_pre_attn_scalar=16.0)


# ----------------------------------------------------------------------------------------------------
# The float64 NumPy forwards: plain NumPy, their own norms, rotations and softmax; nothing from jaxattn.
# Each returns (logits [T, V], maps [L, N, T, T], hidden [L + 1, T, D]: every block's input, then the final
# norm's output). ``drop=(l, n)`` removes head n's output of layer l by hand; the other keywords switch a
# feature off (the tests show each one changes the logits, so the comparison would see it missing).
# ----------------------------------------------------------------------------------------------------


def _gelu(x):  # the tanh form (gelu_new, gelu_pytorch_tanh)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _softmax(a):
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _causal_attention(q, k, v, scale, window=None, cap=None):
    """q [T, N, H], k and v [T, K, H] (query head n reads key head n // (N / K)): z [T, N, H], weights [N, T, T]."""
    rows, group = q.shape[0], q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = scale * np.einsum("tnh,snh->nts", q, k)
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    t, s = np.arange(rows)[:, None], np.arange(rows)[None, :]
    seen = (s <= t) & ((t - s < window) if window is not None else True)
    w = _softmax(np.where(seen[None], logits, -np.inf))
    return np.einsum("nts,snh->tnh", w, v), w


def _angles(n, dim, base):  # [T, dim/2]: position t times base^(-2j/dim)
    return np.arange(n, dtype=np.float64)[:, None] * base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)[None, :]


def _drop(z, l, drop):
    if drop is not None and drop[0] == l:
        z = z.copy()
        z[:, drop[1]] = 0.0
    return z


def _layer_norm(x, scale, bias, eps):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale + bias


def gptj_numpy(P, c, ids, *, drop=None, sequential=False, reorder=True):
    """GPT-J's own forward with ITS rotary convention: adjacent pairs (2j, 2j+1) of the first rotary_dim
    features turned (rotate_every_two), on q and k whose features are reordered from the family's halves
    layout ((j, j + rotary_dim/2) pairs) to adjacent pairs: q·k is unchanged by a reordering common to both,
    so the two conventions give one model. ``sequential``: the MLP reads ln_1(x + attn) instead (GPT-2's
    wiring); ``reorder=False``: adjacent pairs on the features as they are (a different model)."""
    tr, b = P["transformer"], P["transformer"]["h"]
    N, H, rd, n, eps = c.n_head, c.head_dim, c.rotary_dim, len(ids), c.layer_norm_epsilon
    pairs = np.stack([np.arange(rd // 2), np.arange(rd // 2) + rd // 2], axis=1).reshape(-1)
    order = np.concatenate([pairs if reorder else np.arange(rd), np.arange(rd, H)])
    ang = _angles(n, rd, c.rope_base)[:, None, :]  # [T, 1, rd/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rotate_every_two(a):  # [T, N, H]
        a = a.copy()
        even, odd = a[..., 0:rd:2].copy(), a[..., 1:rd:2].copy()
        a[..., 0:rd:2], a[..., 1:rd:2] = even * cos - odd * sin, odd * cos + even * sin
        return a

    x, hidden, maps = tr["wte"]["embedding"][ids], [], []
    for l in range(c.n_layer):
        hidden.append(x)
        ln = lambda y: _layer_norm(y, b["ln_1"]["scale"][l], b["ln_1"]["bias"][l], eps)  # noqa: E731
        h = ln(x)
        q, k, v = ((h @ b["attn"][f"{m}_proj"]["kernel"][l]).reshape(n, N, H) for m in "qkv")
        z, w = _causal_attention(rotate_every_two(q[..., order]), rotate_every_two(k[..., order]), v, H ** -0.5)
        a = _drop(z, l, drop).reshape(n, N * H) @ b["attn"]["out_proj"]["kernel"][l]
        mlp = b["mlp"]
        hm = ln(x + a) if sequential else h
        m = _gelu(hm @ mlp["fc_in"]["kernel"][l] + mlp["fc_in"]["bias"][l]) @ mlp["fc_out"]["kernel"][l]
        x = x + a + m + mlp["fc_out"]["bias"][l]
        maps.append(w)
    hf = _layer_norm(x, tr["ln_f"]["scale"], tr["ln_f"]["bias"], eps)
    return hf @ P["lm_head"]["kernel"] + P["lm_head"]["bias"], np.stack(maps), np.stack(hidden + [hf])


def gemma_numpy(P, c, ids, *, drop=None, attn_cap=True, final_cap=True, windows=True, plus_one=True):
    """The Gemma-2-like forward: RMSNorm by (1 + w), sandwich norms, RoPE on halves, GeGLU, even layers
    windowed, soft caps on the attention logits and the tied head's logits. The keywords switch one
    feature off (``plus_one=False``: scale by w)."""
    m, b = P["model"], P["model"]["layers"]
    N, K, H, D, n = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, len(ids)

    def rms(y, w):
        return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + c.rms_norm_eps) * ((1.0 if plus_one else 0.0) + w)

    ang = _angles(n, H, c.rope_theta)[:, None, :]  # [T, 1, H/2]

    def rope(a):  # rotate halves
        a1, a2 = a[..., :H // 2], a[..., H // 2:]
        return np.concatenate([a1 * np.cos(ang) - a2 * np.sin(ang), a2 * np.cos(ang) + a1 * np.sin(ang)], axis=-1)

    x, hidden, maps = m["embed_tokens"]["embedding"][ids] * np.sqrt(D), [], []
    for l in range(c.num_hidden_layers):
        hidden.append(x)
        p = jax.tree.map(lambda a: a[l], b)
        h, att = rms(x, p["input_layernorm"]["weight"]), p["self_attn"]
        q = (h @ att["q_proj"]["kernel"]).reshape(n, N, H)
        k, v = ((h @ att[f"{j}_proj"]["kernel"]).reshape(n, K, H) for j in "kv")
        window = W if windows and l % 2 == 0 else None
        cap = c.attn_logit_softcapping if attn_cap else None
        z, w = _causal_attention(rope(q), rope(k), v, c.query_pre_attn_scalar ** -0.5, window, cap)
        a = _drop(z, l, drop).reshape(n, N * H) @ att["o_proj"]["kernel"]
        x = x + rms(a, p["post_attention_layernorm"]["weight"])
        h, mlp = rms(x, p["pre_feedforward_layernorm"]["weight"]), p["mlp"]
        y = (_gelu(h @ mlp["gate_proj"]["kernel"]) * (h @ mlp["up_proj"]["kernel"])) @ mlp["down_proj"]["kernel"]
        x = x + rms(y, p["post_feedforward_layernorm"]["weight"])
        maps.append(w)
    hf = rms(x, m["norm"]["weight"])
    logits = hf @ m["embed_tokens"]["embedding"].T
    cf = c.final_logit_softcapping
    return (cf * np.tanh(logits / cf) if final_cap else logits), np.stack(maps), np.stack(hidden + [hf])


def _gemma_post_attention(P, c, l, y):  # what the block adds to the stream from the heads' summed output y
    w = P["model"]["layers"]["post_attention_layernorm"]["weight"][l]
    return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + c.rms_norm_eps) * (1.0 + w)


# ----------------------------------------------------------------------------------------------------
# The two families, their params and a sequence
# ----------------------------------------------------------------------------------------------------

FAMILIES = {
    "gptj": dict(module=gptj, config=GPTJ, seed=0, numpy=gptj_numpy, post_attention=lambda P, c, l, y: y,
                 variants={"sequential wiring": dict(sequential=True),
                           "adjacent pairs without the reordering": dict(reorder=False)}),
    "gemma2like": dict(module=gemma2like, config=GEMMA, seed=1, numpy=gemma_numpy, post_attention=_gemma_post_attention,
                       variants={"no attention logit cap": dict(attn_cap=False),
                                 "no final logit cap": dict(final_cap=False),
                                 "no sliding windows": dict(windows=False),
                                 "norms scaled by w, not 1 + w": dict(plus_one=False)}),
}


ASKED = dict(return_hidden_states=True, capture=("resid_pre", "q", "k", "z", "attn_out", "resid_post"))


def _np64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


@functools.lru_cache(maxsize=None)
def _case(name):
    spec = FAMILIES[name]
    module, config = spec["module"], spec["config"]
    params = module.init_params(spec["seed"], config)
    ids = np.random.default_rng(10 + spec["seed"]).integers(0, config.vocab_size, T).astype(np.int32)
    out = module.forward(params, config, ids, **ASKED)
    P = _np64(params)
    ref = functools.partial(spec["numpy"], P, config)
    return types.SimpleNamespace(**spec, name=name, params=params, P=P, ids=ids, out=out, ref=ref, clean=ref(ids),
                                 sizes=module.sizes(config))


@pytest.fixture(params=sorted(FAMILIES))
def fam(request):
    return _case(request.param)


def _np_log_prob(logits, ids, start=0, end=None):
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    end = len(ids) if end is None else end
    return sum(lp[t - 1, ids[t]] for t in range(max(start, 1), end))


# ----------------------------------------------------------------------------------------------------
# The families' own code
# ----------------------------------------------------------------------------------------------------


def _code_lines(path):
    """Lines of ``path`` that hold code or docstrings: blank lines and comments left out."""
    source = path.read_text(encoding="utf-8")
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")}
    return sum(1 for i, line in enumerate(source.splitlines(), 1) if line.strip() and i not in comments)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_is_under_150_lines_and_names_nothing_private(name):
    """Each family module (its config, sizes, init, checks, Family, the functions of the model protocol and
    its declaration) has fewer than 150 lines of code, docstrings included; it imports only public jaxattn
    modules and names, reads no private attribute of them, its Family is a hashable
    ``jaxattn.decoder.Family`` and its ``SPEC`` the declared protocol (``jaxattn.models.spec``)."""
    module = FAMILIES[name]["module"]
    path = Path(module.__file__)
    assert _code_lines(path) < 150
    tree = ast.parse(path.read_text(encoding="utf-8"))
    from_jaxattn = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(m and m.split(".")[0] == "jaxattn" for m in modules):
                assert not any(part.startswith("_") for m in modules for part in m.split(".")), ast.unparse(node)
                assert not any(a.name.startswith("_") for a in node.names), ast.unparse(node)
                from_jaxattn |= {(a.asname or a.name).split(".")[0] for a in node.names}
    assert {"decoder"} <= from_jaxattn
    private = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id in from_jaxattn
               and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert private == []
    assert isinstance(module.FAMILY, decoder.Family) and isinstance(hash(module.FAMILY), int)
    assert models.spec(module) is module.SPEC and module.SPEC.causal is module.CAUSAL is True


# ----------------------------------------------------------------------------------------------------
# Forward, generation, scores
# ----------------------------------------------------------------------------------------------------


def test_forward_matches_numpy_logits_maps_and_hidden_states(fam):
    """At T = 12 (> W = 3): the logits, every layer's attention maps and every hidden state equal the float64
    NumPy forward's within 1e-5; each variant of the NumPy forward with one feature changed (the wiring, the
    rotary convention, a cap, the windows, the norm's 1 + w) moves the logits by far more, so each feature
    is exercised. Gemma-2-like: even layers' maps are zero beyond the window, odd layers' are not."""
    logits, maps, hidden = fam.clean
    np.testing.assert_allclose(fam.out.logits, logits, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(fam.out.attentions, maps, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(fam.out.hidden_states, hidden, rtol=TOL, atol=TOL)
    for variant, kwargs in fam.variants.items():
        assert np.max(np.abs(fam.ref(fam.ids, **kwargs)[0] - fam.out.logits)) > 1e-2, variant
    if fam.name == "gemma2like":
        t, s = np.arange(T)[:, None], np.arange(T)[None, :]
        beyond = np.asarray(fam.out.attentions)[:, :, (t - s >= W)]  # [L, N, pairs]
        assert np.all(beyond[0::2] == 0) and np.all(np.max(beyond[1::2], axis=-1) > 1e-3)


@pytest.mark.parametrize("prompt_len", [5, pytest.param(10, marks=pytest.mark.slow)])  # read by the step (<= 8), or by the forward (make test-slow)
def test_greedy_generation_is_the_numpy_argmax_continuation(fam, prompt_len):
    """Greedy ``generate`` from a 5- and a 10-token prompt to T = 12 (across the window's edge) picks, at every
    step, the argmax of the NumPy forward on the sequence so far (each step's top two logits apart by more than
    1e-3, so the argmax is not a tie), and the logits it returns are that forward's last row within 1e-5."""
    prompt, new = fam.ids[:prompt_len], T - prompt_len
    got, got_logits = fam.module.generate(fam.params, fam.config, prompt, max_new_tokens=new, return_logits=True)
    seq, want_logits = list(prompt), []
    for _ in range(new):
        last = fam.ref(np.array(seq))[0][-1]
        top = np.sort(last)[-2:]
        assert top[1] - top[0] > 1e-3
        seq.append(int(np.argmax(last)))
        want_logits.append(last)
    np.testing.assert_array_equal(got, seq)
    np.testing.assert_allclose(got_logits, np.stack(want_logits), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("start, end", [(0, None), (4, 10)])
def test_log_prob_is_the_numpy_log_softmax_sum(fam, start, end):
    """``log_prob`` of the whole sequence and of a span equals the sum of the NumPy forward's log-softmax at
    the tokens scored (token t from row t - 1)."""
    got = float(fam.module.log_prob(fam.params, fam.config, fam.ids, start=start, end=end))
    want = _np_log_prob(fam.clean[0], fam.ids, start, end)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=1e-4)


# ----------------------------------------------------------------------------------------------------
# Derivatives, resumed forwards, ablations
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow  # make test-slow: the decoder's own gradient checks run in make test (tests/test_decoder.py)
def test_gradient_of_log_prob_is_finite_nonzero_per_layer_and_right(fam):
    """``jax.grad`` of ``log_prob`` with respect to the params is finite, nonzero at every layer of every block
    weight and at every other weight; its inner product with a random tangent equals ``jax.jvp`` (forward
    mode, float32) and a central finite difference of the float64 NumPy log-probability, each within 1e-4."""
    score = lambda p: fam.module.log_prob(p, fam.config, fam.ids)  # noqa: E731
    grad = jax.grad(score)(fam.params)
    blocks = fam.module.FAMILY.blocks(grad)
    for path, g in jax.tree_util.tree_leaves_with_path(grad):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), jax.tree_util.keystr(path)
        assert np.any(g != 0), jax.tree_util.keystr(path)
    for path, g in jax.tree_util.tree_leaves_with_path(blocks):
        per_layer = np.abs(np.asarray(g)).reshape(g.shape[0], -1).max(axis=1)
        assert per_layer.shape == (fam.sizes.layers,) and np.all(per_layer > 0), jax.tree_util.keystr(path)
    rng = np.random.default_rng(3)
    tangent = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), fam.params)
    dot = sum(float(np.vdot(g, u)) for g, u in zip(jax.tree.leaves(grad), jax.tree.leaves(tangent)))
    _, jvp = jax.jvp(score, (fam.params,), (tangent,))
    np.testing.assert_allclose(float(jvp), dot, rtol=1e-4, atol=1e-4)
    eps = 1e-6  # float64: the difference's rounding is ~1e-8 of it; a larger step leaves curvature in (1e-4: 1e-4 off)
    shifted = [jax.tree.map(lambda p, u: p + sign * eps * u, fam.P, _np64(tangent)) for sign in (1, -1)]
    fd = [_np_log_prob(fam.numpy(P, fam.config, fam.ids)[0], fam.ids) for P in shifted]
    np.testing.assert_allclose(dot, (fd[0] - fd[1]) / (2 * eps), rtol=1e-4)


def test_resume_from_each_layer_gives_the_forward(fam):
    """``resume`` from ``resid_pre[l]`` at layer l (every l) gives the forward's logits and last hidden state,
    and its maps (those before l handed over from the forward)."""
    for l in range(fam.sizes.layers):
        got = fam.module.resume(fam.params, fam.config, fam.out.captured["resid_pre"][l], l,
                                attentions=fam.out.attentions)
        np.testing.assert_allclose(got.logits, fam.out.logits, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got.last_hidden_state, fam.out.last_hidden_state, rtol=TOL, atol=TOL)
        np.testing.assert_allclose(got.attentions, fam.out.attentions, rtol=TOL, atol=TOL)


def test_ablation_table_is_each_heads_removal(fam):
    """``interventions.ablation_effects(interventions.bind(module, ...), metric)`` (resumed at each layer
    through the declared ``resume``) equals at every head the metric of a forward with that head's
    ``head_mask`` entry zeroed minus the clean metric, and the NumPy forward with the head's output removed
    by hand; the table is not all zeros."""
    L, N = fam.sizes.layers, fam.sizes.heads
    a, b = int(fam.ids[-1]), (int(fam.ids[-1]) + 1) % fam.sizes.vocab
    metric = lambda out: out.logits[-1, a] - out.logits[-1, b]  # noqa: E731
    bound = interventions.bind(fam.module, fam.params, fam.config, fam.ids)
    assert bound.resume is not None and (bound.n_layers, bound.n_heads) == (L, N)
    table = np.asarray(interventions.ablation_effects(bound, metric))
    assert table.shape == (L, N) and np.max(np.abs(table)) > 1e-2
    clean = float(metric(fam.out))
    np_metric = lambda logits: logits[-1, a] - logits[-1, b]  # noqa: E731
    for l in range(L):
        for n in range(N):
            mask = np.ones((L, N), np.float32)
            mask[l, n] = 0.0
            masked = fam.module.forward(fam.params, fam.config, fam.ids, head_mask=mask, **ASKED)  # one compile
            np.testing.assert_allclose(table[l, n], float(metric(masked)) - clean, atol=TOL)
            by_hand = np_metric(fam.ref(fam.ids, drop=(l, n))[0]) - np_metric(fam.clean[0])
            np.testing.assert_allclose(table[l, n], by_hand, atol=1e-4)


def test_protocol_functions_agree_with_the_forward(fam):
    """The model protocol the interventions read: ``unembed(final_norm(resid_post[-1]))`` is the logits;
    ``attention_input`` of ``resid_pre[l]`` times ``qk_weights``' W_Q and W_K gives the captured q and k at
    position 0 (where RoPE turns nothing); ``head_projections`` of the captured ``z``, summed over heads,
    gives ``attn_out`` (through the post-attention norm for the Gemma-2-like family, in NumPy);
    ``final_norm_linear`` at the last stream is linear in its part (two parts add up to the whole) and differs
    from ``final_norm`` by one row for every position (the norm's bias; zero for RMSNorm)."""
    m, params, config, cap = fam.module, fam.params, fam.config, fam.out.captured
    x = cap["resid_post"][-1]  # [T, D]
    np.testing.assert_allclose(m.unembed(params, config, m.final_norm(params, config, x)), fam.out.logits,
                               rtol=TOL, atol=TOL)
    part = np.random.default_rng(4).standard_normal(x.shape).astype(np.float32)
    whole = np.asarray(m.final_norm_linear(params, config, x, x))
    parts = [m.final_norm_linear(params, config, x, v) for v in (part, x - part)]
    np.testing.assert_allclose(parts[0] + parts[1], whole, rtol=TOL, atol=TOL)
    bias = np.asarray(m.final_norm(params, config, x)) - whole  # [T, D]
    np.testing.assert_allclose(bias, np.broadcast_to(bias[:1], bias.shape), atol=TOL)
    qk, W = m.qk_weights(params, config), np.asarray(m.head_projections(params, config), np.float64)
    assert qk.rotary and qk.b_q is None and W.shape == (fam.sizes.layers, fam.sizes.heads, fam.sizes.head_dim,
                                                        fam.sizes.width)
    for l in range(fam.sizes.layers):
        x0 = np.asarray(m.attention_input(params, config, l, cap["resid_pre"][l]))[0]  # [D]
        np.testing.assert_allclose(np.einsum("d,ndh->nh", x0, qk.w_q[l]), cap["q"][l, 0], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(np.einsum("d,kdh->kh", x0, qk.w_k[l]), cap["k"][l, 0], rtol=TOL, atol=TOL)
        y = np.einsum("tnh,nhd->td", np.asarray(cap["z"][l], np.float64), W[l])
        np.testing.assert_allclose(fam.post_attention(fam.P, config, l, y), cap["attn_out"][l], rtol=TOL, atol=TOL)
