"""kvevict.models (the quality model in PyTorch) against the C++ model (examples/quality/model.hpp,
run by kvevict_reference on the same weights and tokens), and kvevict.install / kvevict.press."""

import pytest
import torch

import kvevict
from conftest import WEIGHTS, reference
from kvevict.models import BOS, Config, DecodeState, Model

TOL = 1e-5  # Python against C++: the same operations in the same order (the bound)
# A cached step against the full forward: the same math in products of other shapes, which
# round differently (examples/quality/README.md: decode and full forward agree within 2e-5).
TOL_SHAPES = 3e-5


@pytest.fixture(scope="module")
def model():
    return Model.load(WEIGHTS)


def text_tokens(text: str, batch: int = 1) -> torch.Tensor:
    row = [BOS] + list(text.encode())
    return torch.tensor([row] * batch, dtype=torch.long)


PROMPT = "The county jury said it did find that many of the registration practices were"


def cpp(mode, tokens, prompt_len=None, layout="expanded", **eviction):
    req = dict(op="model", weights=WEIGHTS, tokens=tokens, mode=mode, layout=layout,
               prompt_len=prompt_len if prompt_len is not None else tokens.size(1), **eviction)
    return reference(req)


def max_abs(a, b):
    return (a - b).abs().max().item()


def test_full_forward_matches_cpp(model):
    tokens = text_tokens(PROMPT, batch=2)
    with torch.no_grad():
        ours = model(tokens)
    theirs = cpp("forward", tokens)["logits"]
    assert ours.shape == theirs.shape == (2, tokens.size(1), 392)
    assert max_abs(ours, theirs) < TOL


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_cached_step_matches_cpp(model, layout):
    """The prompt then 12 decode tokens through an evicting cache (capacity 24 < 90 tokens)."""
    tokens = text_tokens(PROMPT + " not kept up to date")
    P = 60
    ev = dict(budget=12, n_sink=4, n_recent=8)
    opts = model.expanded_options() if layout == "expanded" else model.latent_options()
    cache = (kvevict.MlaCache if layout == "expanded" else kvevict.MlaLatentCache)(opts, kvevict.EvictionOptions(
        ev["budget"], n_sink=ev["n_sink"], n_recent=ev["n_recent"]))
    state = DecodeState()
    with torch.no_grad():
        logits = [model.step(tokens[:, :P], cache, state)]
        for t in range(P, tokens.size(1)):
            logits.append(model.step(tokens[:, t:t + 1], cache, state))
    ours = torch.cat(logits, 1)
    ref = cpp("step", tokens, P, layout, **ev)
    assert max_abs(ours, ref["logits"]) < TOL
    for layer in range(model.c.n_layers):
        assert torch.equal(cache.positions(layer), ref["positions"][layer])
    assert cache.stats().tokens_evicted > 0


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_install_at_full_budget_changes_nothing(model, layout):
    """At a budget above the sequence, install() generates what the plain model generates, with
    the logits of the same cache without eviction bit for bit (and the full forward's within
    rounding)."""
    prompt = text_tokens(PROMPT)
    kv = kvevict.install(model, budget=4096, n_sink=4, n_recent=512, layout=layout)
    try:
        seq, logits = kv.generate(prompt, 24, return_logits=True)
        assert kv.cache.stats().tokens_evicted == 0
    finally:
        kv.remove()
    plain = prompt
    with torch.no_grad():
        for _ in range(24):  # greedy decoding with full attention, no cache
            plain = torch.cat([plain, model(plain)[:, -1].argmax(-1, keepdim=True)], 1)
        full = model(seq[:, :-1])
    assert torch.equal(seq, plain)
    assert max_abs(logits, full) < TOL_SHAPES
    opts = model.expanded_options() if layout == "expanded" else model.latent_options()
    cache = (kvevict.MlaCache if layout == "expanded" else kvevict.MlaLatentCache)(opts)
    state = DecodeState()
    with torch.no_grad():
        steps = [model.step(prompt, cache, state, evict=False)]
        steps += [model.step(seq[:, t:t + 1], cache, state, evict=False) for t in range(prompt.size(1), seq.size(1) - 1)]
    assert torch.equal(logits, torch.cat(steps, 1))


@pytest.mark.parametrize("layout,scorer", [("expanded", "h2o"), ("latent", "h2o"), ("expanded", "tova"),
                                           ("latent", "decay")])
def test_install_keeps_the_tokens_the_cpp_cache_keeps(model, layout, scorer):
    prompt = text_tokens(PROMPT)
    ev = dict(budget=10, n_sink=2, n_recent=6)
    kv = kvevict.install(model, layout=layout, scorer=scorer, **ev)
    try:
        seq, logits = kv.generate(prompt, 20, return_logits=True)
        names = {"h2o": "CumulativeAttention", "tova": "LatestAttention", "decay": "DecayedAttention"}
        ref = cpp("step", seq[:, :-1], prompt.size(1), layout, scorer=names[scorer], gamma=0.9, **ev)
        assert max_abs(logits, ref["logits"]) < TOL
        for layer in range(model.c.n_layers):
            assert torch.equal(kv.cache.positions(layer), ref["positions"][layer])
            assert len(kv.kept_positions(layer)) == 18
    finally:
        kv.remove()


@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("scorer,name,params", [(kvevict.SnapKV(8, 3), "SnapKV", dict(window=8, kernel=3)),
                                                ("h2o", "CumulativeAttention", {})], ids=["snapkv", "h2o"])
def test_press_compresses_the_prompt_as_the_cpp(model, layout, scorer, name, params):
    prompt = text_tokens(PROMPT)
    ev = dict(budget=16, n_sink=2, n_recent=8)
    with kvevict.press(model, layout=layout, scorer=scorer, **ev) as kv:
        seq, logits = kv.generate(prompt, 10, return_logits=True)
        positions = [kv.cache.positions(l) for l in range(model.c.n_layers)]
    assert "forward" not in model.blocks[0].attn.__dict__  # restored on exit
    ref = cpp("compressed", seq[:, :-1], prompt.size(1), layout, scorer=name, **params, **ev)
    assert max_abs(logits, ref["logits"]) < TOL
    for a, b in zip(positions, ref["positions"]):
        assert torch.equal(a, b)
    with torch.no_grad():  # the prompt itself attends in full: its logits are the full forward's
        assert max_abs(logits[:, :prompt.size(1)], model(prompt)) < TOL_SHAPES


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_press_reports_the_prompt_tokens_it_drops(model, layout):
    """PYTHON-USER row 15: after the press, stats() counts the dropped prompt tokens in
    tokens_evicted, and kept_positions are prompt positions (whether a token survived shows)."""
    prompt = text_tokens(PROMPT)
    T = prompt.size(1)
    ev = dict(budget=6, n_sink=2, n_recent=8)  # capacity 16
    with kvevict.press(model, layout=layout, scorer=kvevict.SnapKV(8, 3), **ev) as kv:
        kv.generate(prompt, 1)  # the prompt's forward only
        s = kv.stats()
        assert s["tokens_evicted"] == 4 * (T - 16) and s["eviction_events"] == 4
        assert s["kept"] == [16] * 4 and s["seen"] == T
        for layer in range(4):
            kept = kv.kept_positions(layer)
            assert len(kept) == 16 and kept[:2] == [0, 1] and kept[-8:] == list(range(T - 8, T))
            assert kv.cache.seen_tokens(layer) == T
        kv.generate(prompt, 3)  # decoding continues at position T
        assert kv.kept_positions(0)[-1] == T + 1


def test_install_errors(model):
    with pytest.raises(ValueError, match="layout must be one of"):
        kvevict.install(model, layout="paged")
    with pytest.raises(ValueError, match="scorer must be one of"):
        kvevict.install(model, scorer="lru")
    with pytest.raises(ValueError, match=r"n_recent must be in \[0, 2\^40\], got -1"):
        kvevict.install(model, n_recent=-1)
    assert "forward" not in model.blocks[0].attn.__dict__  # unchanged by the failures
    kv = kvevict.install(model, budget=8)
    try:
        with pytest.raises(ValueError, match="already has eviction installed"):
            kvevict.install(model)
        with pytest.raises(ValueError, match="B = 1 rows"):
            kv.generate(text_tokens("ab", batch=2), 2)
    finally:
        kv.remove()
    with pytest.raises(RuntimeError, match="handle was removed"):
        kv.generate(text_tokens("ab"), 2)
    with pytest.raises(ValueError, match="found no MLA attention module in Linear"):
        kvevict.install(torch.nn.Linear(2, 2))


def test_weights_are_checked():
    with pytest.raises(ValueError, match="tensor embed.weight has shape"):
        Model(Config(dim=64)).load_weights(WEIGHTS)
