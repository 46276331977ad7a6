"""kvevict.install / kvevict.press on the shipped model, as a new user meets them: one test per
finding of the Python user report (rows named in each test's doc). The oracles are the plain
model (full causal attention, no kvevict), the same call on rows run alone, and the cache's own
counters against kvevict's memory model."""

import copy
import io
import sys
import warnings

import pytest
import torch

import kvevict
from conftest import WEIGHTS
from kvevict.models import BOS, MLA, Model

TOL = 1e-4  # a batched row against the same row alone: products of other shapes round differently


@pytest.fixture(scope="module")
def model():
    return Model.load(WEIGHTS)


def row(text: str):
    return [BOS] + list(text.encode())


A = row("The jury said that the city of Atlanta had been")
B = row("It was a cold day")


def max_abs(a, b):
    return (a - b).abs().max().item()


@pytest.fixture
def plain(model):
    """The plain model's greedy continuation and logits, no kvevict."""
    def run(tokens, n):
        seq = torch.tensor([tokens])
        with torch.no_grad():
            for _ in range(n):
                seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
            return seq, model(seq[:, :-1])
    return run


def test_readme_install_example_evicts(model):
    """Row 4: docs/python.md's example evicts, with numbers a reader can check (capacity 4 + 16 + 8 =
    28 tokens per layer; 14 prompt tokens and 39 generated ones fed back: 25 evicted per layer, 100
    in all)."""
    kv = kvevict.install(model, budget=16, n_sink=4, n_recent=8, scorer="h2o", layout="latent")
    try:
        prompt = torch.tensor([row("The jury said")])
        kv.generate(prompt, max_new_tokens=40)
        s = kv.stats()
        assert s["capacity"] == [28] * 4 and s["kept"] == [28] * 4 and s["seen"] == 14 + 39
        assert s["tokens_evicted"] == 4 * (53 - 28) == 100
        kept = kv.kept_positions(layer=0)
        assert kept[:4] == [0, 1, 2, 3] and kept[-8:] == list(range(45, 53))  # sinks and recent window
    finally:
        kv.remove()


@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("budget", [4096, 8])
@pytest.mark.parametrize("chunk", [0, 5])
def test_left_padded_batch_equals_rows_alone(model, layout, budget, chunk):
    """Row 22: a left-padded batch with its attention_mask gives each row what it gives alone
    (pads never stored, scored or attended; RoPE and the token shift start at the row's first
    real token), at a full and at an evicting budget, in one chunk and in chunks of 5."""
    T = len(A)
    batch = torch.tensor([A, [0] * (T - len(B)) + B])
    mask = torch.tensor([[1] * T, [0] * (T - len(B)) + [1] * len(B)])
    ev = dict(budget=budget, n_sink=2, n_recent=6)
    kv = kvevict.install(model, layout=layout, batch_size=2, prefill_chunk=chunk, **ev)
    try:
        seq, logits = kv.generate(batch, 12, attention_mask=mask, return_logits=True)
        assert all(kv.cache.seen_tokens(0, r) == n + 11 for r, n in enumerate((len(A), len(B))))
    finally:
        kv.remove()
    for r, tokens in enumerate((A, B)):
        alone = kvevict.install(model, layout=layout, prefill_chunk=chunk, **ev)
        try:
            s1, l1 = alone.generate(torch.tensor([tokens]), 12, return_logits=True)
        finally:
            alone.remove()
        pad = T - len(tokens)
        assert torch.equal(seq[r, pad:], s1[0])
        assert max_abs(logits[r, pad:], l1[0]) < TOL


def test_padding_mask_errors(model):
    kv = kvevict.install(model, batch_size=2)
    try:
        tokens = torch.tensor([A[:5], A[:5]])
        with pytest.raises(ValueError, match="left padding"):
            kv.generate(tokens, 2, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))  # right padding
        with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\] = \[2, 5\]"):
            kv.step(tokens, torch.ones(2, 4))
        assert kv.cache.seen_tokens(0) == 0  # nothing appended
    finally:
        kv.remove()
    with kvevict.press(model, budget=4, n_sink=1, n_recent=4, window=4, batch_size=2) as kv:
        with pytest.raises(ValueError, match="press compresses unpadded prompts"):
            kv.generate(tokens, 1, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))


def test_second_forward_says_it_continues(model):
    """Row 20: a bare model(x) on an installed model continues the cached sequence and warns
    once per sequence; kv.step continues without a word; kv.reset() starts afresh."""
    x = torch.tensor([A])
    kv = kvevict.install(model)
    try:
        with warnings.catch_warnings(record=True) as w, torch.no_grad():
            warnings.simplefilter("always")
            first = model(x)
            assert not w
            model(x)
            model(x)
            assert len(w) == 1 and "continues the cached sequence" in str(w[0].message)
            kv.reset()
            again = model(x)
            kv.step(x)
            assert len(w) == 1
        assert torch.equal(first, again)
    finally:
        kv.remove()


def test_generate_continues_a_conversation(model):
    """Row 21: generate(..., reset=False) continues the cached sequence, feeding the previous
    call's last token first: the same tokens as one generate over the whole conversation."""
    kv = kvevict.install(model, budget=4096)
    try:
        s1 = kv.generate(torch.tensor([A]), 6)
        s2 = kv.generate(torch.tensor([B]), 6, reset=False)
        assert torch.equal(s2[:, :len(B)], torch.tensor([B]))
        whole = kv.generate(torch.cat([s1, torch.tensor([B])], 1), 6)
        assert torch.equal(s2[:, -6:], whole[:, -6:])
    finally:
        kv.remove()


def test_snapkv_window_longer_than_recent_warns(model):
    """Row 10: the press warns when the SnapKV window is longer than n_recent."""
    with pytest.warns(UserWarning, match=r"SnapKV window \(32\) is longer than n_recent \(16\)"):
        with kvevict.press(model, budget=20, n_sink=4, n_recent=16, window=32):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with kvevict.press(model, budget=20, n_sink=4, n_recent=16, window=16):
            pass


@pytest.mark.parametrize("scorer", ["snapkv", kvevict.SnapKV(8, 3)], ids=["name", "object"])
def test_snapkv_outside_the_press_is_refused(model, scorer):
    """Row 11: SnapKV scores a prompt; install() without the press refuses it."""
    with pytest.raises(ValueError, match="SnapKV scores a prompt once: use kvevict.press"):
        kvevict.install(model, scorer=scorer)
    assert not hasattr(model, "_kvevict_installed")


def test_dtype_other_than_the_model_is_refused_at_install(model):
    """Row 23: install(dtype=...) other than the model's raises at install, naming dtype."""
    with pytest.raises(ValueError, match=r"dtype must be the model's, torch.float32, got torch.float16"):
        kvevict.install(model, dtype=torch.float16)
    assert not hasattr(model, "_kvevict_installed")
    kvevict.install(model, dtype=torch.float32).remove()


def test_state_dict_deepcopy_and_save(model):
    """Row 24: installing keeps state_dict() keys (loadable into a plain Model); deepcopy and
    torch.save raise a clear TypeError while installed and work after remove()."""
    keys = list(model.state_dict())
    kv = kvevict.install(model, budget=8)
    try:
        assert list(model.state_dict()) == keys
        Model().load_state_dict(model.state_dict())
        for f in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
            with pytest.raises(TypeError, match="cannot be deep-copied or pickled.*remove\\(\\) first"):
                f()
    finally:
        kv.remove()
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())


def test_install_is_a_function_not_a_shadowed_module():
    """Row 36: kvevict.install is the function; its module is private; the scorer table is
    kvevict.SCORERS."""
    assert callable(kvevict.install) and kvevict.install.__module__ == "kvevict._install"
    assert "kvevict.install" not in sys.modules
    assert {"h2o", "tova", "mean", "decay", "snapkv"} <= set(kvevict.SCORERS)


def test_scorer_of_a_wrong_type_is_a_type_error(model):
    """Row 37: the docstring says TypeError for a wrong type, and it is."""
    assert "TypeError" in kvevict.install.__doc__
    with pytest.raises(TypeError, match="scorer must be a name or a kvevict scorer object, got int"):
        kvevict.install(model, scorer=42)


def test_duck_typed_mla_module_installs(model, plain):
    """Row 18: a module with MLA's methods and config, not a subclass, installs (docs/python.md's
    promise), and generates what the plain model generates at a full budget."""
    class Duck(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.c = inner.c

        def project(self, *a):
            return self.inner.project(*a)

        def expand(self, *a):
            return self.inner.expand(*a)

        def out(self, *a):
            return self.inner.out(*a)

        def absorbed_weights(self):
            return self.inner.absorbed_weights()

        def forward(self, x, pos, mask):
            return self.inner(x, pos, mask)

    m = Model.load(WEIGHTS)
    for b in m.blocks:
        b.attn = Duck(b.attn)
    kv = kvevict.install(m, layout="latent")
    try:
        assert len(kv.layers) == 4 and all(isinstance(a, Duck) for a in kv.layers)  # the inner MLA is not taken
        seq = kv.generate(torch.tensor([A]), 8)
    finally:
        kv.remove()
    assert torch.equal(seq, plain(A, 8)[0])


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_tier_and_recall_from_install(model, layout):
    """Row 12: the host tier with recall is one install() away: evicted tokens go to the tier and
    come back (tier_recalled > 0), every layer stays within capacity, and the recalls change which
    tokens are kept against the same cache without a tier."""
    ev = dict(budget=8, n_sink=2, n_recent=6, layout=layout)
    prompt = torch.tensor([A])
    kv = kvevict.install(model, tier_tokens=64, tier_page_size=4, recall_tokens=2, recall_rescore=8, **ev)
    try:
        kv.generate(prompt, 10)
        s = kv.stats()
        kept = [kv.kept_positions(l) for l in range(4)]
        assert s["tier_tokens"] > 0 and s["tier_recalled"] > 0
        assert all(k <= c for k, c in zip(s["kept"], s["capacity"]))
        assert kv.memory().tier_bytes > 0
    finally:
        kv.remove()
    no_tier = kvevict.install(model, **ev)
    try:
        no_tier.generate(prompt, 10)
        assert kept != [no_tier.kept_positions(l) for l in range(4)]
    finally:
        no_tier.remove()


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_prefill_chunk(model, layout, plain):
    """Row 14: prefill_chunk feeds the prompt in chunks (each appended, attended, evicted): at a
    full budget the logits are the plain model's; at a small one the cache holds at most capacity
    + chunk tokens at any time, and capacity after each forward."""
    kv = kvevict.install(model, layout=layout, prefill_chunk=7)
    try:
        seq, logits = kv.generate(torch.tensor([A]), 5, return_logits=True)
    finally:
        kv.remove()
    ref_seq, ref_logits = plain(A, 5)
    assert torch.equal(seq, ref_seq) and max_abs(logits, ref_logits) < 3e-5
    kv = kvevict.install(model, layout=layout, budget=4, n_sink=2, n_recent=4, prefill_chunk=7)
    try:
        kv.step(torch.tensor([A]))
        assert kv.stats()["kept"] == [10] * 4
        assert kv.stats()["tokens_evicted"] == 4 * (len(A) - 10)
    finally:
        kv.remove()


def test_memory_report(model):
    """Row 13: memory() gives the cache's bytes now against a full cache of the tokens seen (the
    memory model's full_cache_bytes), and the ratio."""
    kv = kvevict.install(model, budget=8, n_sink=2, n_recent=6, layout="latent")
    try:
        kv.generate(torch.tensor([A]), 30)
        r = kv.memory()
        c = model.c
        cfg = kvevict.MlaMemoryConfig(num_layers=4, num_heads=c.n_heads, qk_dim=c.qk_dim, v_dim=c.v_dim,
                                      kv_lora_rank=c.kv_lora, qk_rope_dim=c.qk_rope, bytes_per_element=4)
        seen = len(A) + 29
        assert r.columns == seen
        assert r.full_cache_bytes == 4 * seen * (c.kv_lora + c.qk_rope) * 4
        assert r.full_cache_bytes == kvevict.full_cache_bytes(cfg, kvevict.Layout.kLatent, seen)
        assert r.cache_bytes == kv.cache.stats().bytes_allocated and r.ratio > 1
    finally:
        kv.remove()


def test_cache_is_on_the_models_device_and_dtype(model):
    """Row 38: the cache takes the model's device and dtype (CUDA below, where one exists)."""
    m = Model.load(WEIGHTS).double()
    kv = kvevict.install(m, budget=8)
    try:
        assert kv.cache.dtype == torch.float64 and kv.cache.device == torch.device("cpu")
        kv.generate(torch.tensor([A]), 2)
    finally:
        kv.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_install_on_cuda(plain):
    m = Model.load(WEIGHTS).cuda()
    kv = kvevict.install(m, layout="latent")
    try:
        assert kv.cache.device.type == "cuda"
        seq = kv.generate(torch.tensor([A], device="cuda"), 8)
    finally:
        kv.remove()
    assert torch.equal(seq.cpu(), plain(A, 8)[0])


def test_repr(model):
    kv = kvevict.install(model, budget=8, n_sink=2, n_recent=6, layout="latent")
    try:
        assert repr(kv) == ("Installed(layers=4, layout=latent, budget=8, n_sink=2, n_recent=6, capacity=16, "
                            "press=False, tier_tokens=0, installed=True)")
    finally:
        kv.remove()


def test_backward_is_refused_clearly(model):
    """Row 25: backward through an installed model raises kvevict's message, not torch's in-place
    error; the forward itself still works without no_grad."""
    kv = kvevict.install(model, budget=8)
    try:
        out = model(torch.tensor([A]))
        with pytest.raises(RuntimeError, match="kvevict: no backward through an installed model"):
            out.sum().backward()
    finally:
        kv.remove()
    model.zero_grad(set_to_none=True)


def _readme_block(marker: str) -> str:
    import os
    text = open(os.path.join(os.path.dirname(WEIGHTS), "..", "..", "docs", "python.md")).read()
    at = text.index(marker)
    start = text.rindex("```python\n", 0, at) + len("```python\n")
    return text[start:text.index("```", at)]


@pytest.mark.parametrize("marker,expected", [
    ("kv = kvevict.install(model, budget=16", ["'tokens_evicted': 100", "'seen': 53", "[0, 1, 2, 3, "]),
    ("L, H, B, T = 2, 4, 1, 40", ["28 12\n28\n"]),
    ("long_prompt = torch.tensor", ["224 True\n"]),
], ids=["install", "cpp_api", "press"])
def test_readme_python_examples_run_as_printed(marker, expected):
    """Rows 4-8: docs/python.md's Python examples run as written and print what their comments say."""
    import contextlib
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_readme_block(marker), "docs/python.md", "exec"), {"torch": torch, "kvevict": kvevict, "BOS": BOS,
                                                                  "Model": Model, "model": Model.load(WEIGHTS)})
    for e in expected:
        assert e in out.getvalue()


def _alone(tokens_per_step, layout="expanded"):
    """Logits of each step of one row run alone through the same install."""
    m = Model.load(WEIGHTS)
    kv = kvevict.install(m, budget=1000, n_sink=4, n_recent=8, layout=layout)
    try:
        return [kv.step(torch.tensor([t])) for t in tokens_per_step]
    finally:
        kv.remove()


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_padded_step_on_a_non_empty_cache_equals_rows_alone(model, layout):
    """A left-padded step after the prompt (found by a fresh-clone check: the token shift took the
    pad column as the first real token's predecessor), and a step in which one row has no real
    token, give each row what it gives alone."""
    a, b = row("The jury"), row("It was")
    kv = kvevict.install(model, budget=1000, n_sink=4, n_recent=8, batch_size=2, layout=layout)
    try:
        kv.step(torch.tensor([a, [0, 0] + b]), torch.tensor([[1] * 9, [0, 0] + [1] * 7]))
        out = kv.step(torch.tensor([[65, 66, 67], [0, 68, 69]]), torch.tensor([[1, 1, 1], [0, 1, 1]]))
        idle = kv.step(torch.tensor([[70], [0]]), torch.tensor([[1], [0]]))
        last = kv.step(torch.tensor([[71], [72]]))
    finally:
        kv.remove()
    ra = _alone([a, [65, 66, 67], [70], [71]], layout)
    rb = _alone([b, [68, 69], [72]], layout)
    assert max_abs(out[0], ra[1][0]) < TOL and max_abs(idle[0], ra[2][0]) < TOL and max_abs(last[0], ra[3][0]) < TOL
    assert max_abs(out[1, 1:], rb[1][0]) < TOL and max_abs(last[1], rb[2][0]) < TOL


def test_step_after_generate_feeds_its_last_token_first(model, plain):
    """generate() returns a last token that is not in the cache yet: step() feeds it first, so
    generate, step, generate(reset=False) equals the plain model on the visible text; a bare
    model(x) there is refused (it cannot feed it)."""
    kv = kvevict.install(model, budget=1000, n_sink=4, n_recent=8)
    try:
        a = kv.generate(torch.tensor([A]), 3)
        with pytest.raises(ValueError, match="generate\\(\\)'s last token is not in the cache"):
            model(torch.tensor([[ord("Q")]]))
        kv.step(torch.tensor([[ord("Q")]]))
        b = kv.generate(torch.tensor([[ord("R")]]), 4, reset=False)
    finally:
        kv.remove()
    text = torch.cat([a, torch.tensor([[ord("Q"), ord("R")]])], 1)[0].tolist()
    assert torch.equal(b[:, 1:], plain(text, 4)[0][:, -4:])


def test_padded_next_turn_puts_the_last_token_before_each_rows_text(model):
    """generate(reset=False) with a left-padded turn: the previous last token goes just before
    each row's first real token (no hole in the mask); each row as alone."""
    a, b = row("The jury"), row("It was")
    kv = kvevict.install(model, budget=1000, n_sink=4, n_recent=8, batch_size=2)
    try:
        s1 = kv.generate(torch.tensor([a, [0, 0] + b]), 3, attention_mask=torch.tensor([[1] * 9, [0, 0] + [1] * 7]))
        s2 = kv.generate(torch.tensor([[65, 66, 67], [0, 68, 69]]), 3, reset=False,
                         attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))
    finally:
        kv.remove()
    for r, (first, turn) in enumerate(((a, [65, 66, 67]), (b, [68, 69]))):
        alone = kvevict.install(model, budget=1000, n_sink=4, n_recent=8)
        try:
            t1 = alone.generate(torch.tensor([first]), 3)
            t2 = alone.generate(torch.tensor([turn]), 3, reset=False)
        finally:
            alone.remove()
        assert torch.equal(s1[r, -3:], t1[0, -3:]) and torch.equal(s2[r, -3:], t2[0, -3:])


def test_press_snapkv_by_name_takes_window_and_kernel(model):
    with kvevict.press(model, budget=8, n_sink=2, n_recent=8, window=4, kernel=3, scorer="snapkv") as kv:
        assert repr(kv.compress) == "SnapKV(window=4, kernel=3)"


def test_more_bad_input_is_refused_clearly(model):
    """The fresh-clone check's smaller findings: each refused naming the argument, nothing installed
    or changed."""
    for bad, err, msg in [(dict(layer_budgets=[1.7, 2, 3, 4]), TypeError, r"layer_budgets\[0\] must be an int"),
                          (dict(layer_budgets=5), TypeError, "layer_budgets must be a list of ints"),
                          (dict(dtype="float32"), TypeError, "dtype must be a torch.dtype or None, got str")]:
        with pytest.raises(err, match=msg):
            kvevict.install(model, **bad)
        assert not hasattr(model, "_kvevict_installed")
    kv = kvevict.install(model, budget=8, batch_size=2)
    try:
        with pytest.raises(ValueError, match="attention_mask must hold only 0"):
            kv.step(torch.tensor([A[:3], A[:3]]), torch.tensor([[1, 1, 1], [0.5, 1, 1]]))
        with pytest.raises(TypeError, match="tokens must be an integer tensor"):
            kv.generate(torch.tensor([A[:3], A[:3]]).float(), 2)
        assert kv.cache.seen_tokens(0) == 0
        seq, logits = kv.generate(torch.tensor([A[:3], A[:3]]), 0, return_logits=True)
        assert seq.shape == (2, 3) and logits.shape == (2, 3, 392)
    finally:
        kv.remove()
    m = Model.load(WEIGHTS)
    kv = kvevict.install(m, budget=8)
    try:
        m.to(torch.float64)
        with pytest.raises(TypeError, match="cache holds torch.float32, the model now computes in torch.float64"):
            kv.step(torch.tensor([A]))
    finally:
        kv.remove()
