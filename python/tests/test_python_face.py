"""The binding as a Python user meets it (issue 29 item 2, PYTHON-USER.md rows 28, 30, 35 and
top-10 items 9-10): Pythonic enum names with the C++ names as aliases, repr()s, TypeErrors in
kvevict's voice that name the function, the argument, the type it takes and the type it got,
scorer names, device names, and messages worded for Python. (The signatures in help() and the
stubs: test_stubs.py.)"""

import math
import re

import pytest
import torch

import kvevict
from kvevict import _kvevict

try:
    from kvevict.config import SCORERS
except ImportError:  # before kvevict.config
    from kvevict.install import SCORERS


def expanded(**kw):
    return kvevict.MlaCache(kvevict.MlaCacheOptions(2, 2, qk_dim=4, v_dim=3, **kw), kvevict.EvictionOptions(4))


def latent(**kw):
    return kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(2, 2, kv_lora_rank=4, qk_rope_dim=2, **kw),
                                  kvevict.EvictionOptions(4))


# ---- enums -------------------------------------------------------------------------------------------
ENUMS = [(kvevict.Layout, {"EXPANDED": "kExpanded", "LATENT": "kLatent"}),
         (kvevict.TierScoring, {"PER_HEAD": "kPerHead", "HEAD_MEAN": "kHeadMean"}),
         (kvevict.LseBase, {"E": "kE", "TWO": "k2"}),
         (kvevict.SnapKV.Pooling, {"AVG": "kAvg", "MAX": "kMax"})]


@pytest.mark.parametrize("enum,names", ENUMS, ids=lambda e: getattr(e, "__name__", ""))
def test_enums_have_python_names_cpp_aliases_and_docstrings(enum, names):
    for python, cpp in names.items():
        value = getattr(enum, python)
        assert getattr(enum, cpp) is value or getattr(enum, cpp) == value  # the alias is the same value
        assert value.name == python and repr(value) == f"<{enum.__name__}.{python}: {int(value)}>"
        assert python in enum.__doc__ and cpp in enum.__doc__
    doc = enum.__doc__.split("Members:")[-1]
    for python in names:  # each value has its own line of documentation
        line = next(l for l in doc.splitlines() if l.strip().startswith(python + " :"))
        assert len(line.split(" : ", 1)[1].strip()) > 5, line


def test_defaults_show_the_python_names():
    assert "tier_scoring: kvevict._kvevict.TierScoring = <TierScoring.PER_HEAD: 0>" in \
        kvevict.MlaCacheOptions.__init__.__doc__
    assert "gamma: typing.SupportsFloat | typing.SupportsIndex = 0.9)" in kvevict.DecayedAttention.__init__.__doc__


# ---- repr --------------------------------------------------------------------------------------------
def test_reprs():
    c = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(4, 8, kv_lora_rank=16, qk_rope_dim=8, batch_size=2),
                               kvevict.EvictionOptions(80, n_sink=4, n_recent=16), scorer=kvevict.LatestAttention())
    assert repr(c) == ("MlaLatentCache(layers=4, batch=2, heads=8, kv_lora_rank=16, qk_rope_dim=8, capacity=100, "
                       "dtype=torch.float32, device=cpu, scorer=LatestAttention(), tier_tokens=0)")
    e = kvevict.MlaCache(kvevict.MlaCacheOptions(2, 4, qk_dim=6, v_dim=5, dtype=torch.float64, tier_tokens=32,
                                                 layer_budgets=[8, 16]), kvevict.EvictionOptions(4, n_sink=1, n_recent=2))
    assert repr(e) == ("MlaCache(layers=2, batch=1, heads=4, qk_dim=6, v_dim=5, capacity=[11, 19], "
                       "dtype=torch.float64, device=cpu, scorer=CumulativeAttention(), tier_tokens=32)")
    assert repr(e.options) == ("MlaCacheOptions(num_layers=2, num_heads=4, qk_dim=6, v_dim=5, batch_size=1, "
                               "dtype=torch.float64, device='cpu', layer_budgets=[8, 16], tier_tokens=32, "
                               "tier_page_size=16, tier_scoring=TierScoring.PER_HEAD)")
    assert repr(c.options).startswith("MlaLatentCacheOptions(num_layers=4, num_heads=8, kv_lora_rank=16, ")
    assert repr(c.stats()).startswith("CacheStats(eviction_events=0, tokens_evicted=0, bytes_allocated=")
    assert repr(kvevict.EvictionPolicyOptions(3, 2, batch_size=2, lazy_reduction=True)) == \
        "EvictionPolicyOptions(num_layers=3, num_heads=2, batch_size=2, device='cpu', lazy_reduction=True)"
    assert repr(kvevict.EvictionPolicy(kvevict.EvictionPolicyOptions(3, 2), kvevict.EvictionOptions(8))) == \
        "EvictionPolicy(layers=3, batch=1, heads=2, capacity=28, device=cpu, scorer=CumulativeAttention())"
    assert repr(kvevict.LseOptions(base=kvevict.LseBase.TWO)) == \
        "LseOptions(query_chunk=64, head_chunk=0, chunk_bytes=67108864, base=LseBase.TWO)"
    assert repr(kvevict.Selection(kvevict.EvictionOptions(8, n_sink=2, n_recent=3))) == \
        "Selection(budget=8, n_sink=2, n_recent=3)"
    assert repr(kvevict.MlaMemoryConfig(num_layers=2)).startswith("MlaMemoryConfig(num_layers=2, num_heads=128, ")
    assert repr(kvevict.DecayedAttention()) == "DecayedAttention(gamma=0.9)"
    assert repr(kvevict.DecayedAttention(0.25)) == "DecayedAttention(gamma=0.25)"
    assert repr(kvevict.SnapKV(32, 3, kvevict.SnapKV.Pooling.MAX)) == "SnapKV(window=32, kernel=3, pooling=SnapKV.Pooling.MAX)"
    moves = kvevict.SlotMoves(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 9)
    assert repr(moves) == "SlotMoves(rows=2, moves_per_row=3, slot_bound=9)"


# ---- TypeErrors in kvevict's voice -------------------------------------------------------------------
def type_error(call) -> str:
    with pytest.raises(TypeError) as e:
        call()
    msg = str(e.value)
    assert msg.startswith("kvevict: ") and "incompatible" not in msg and len(msg) < 400, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__ is False
    return msg


def test_type_errors_of_the_report_name_the_argument():
    c, lc = expanded(), latent()
    k, v = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 3)
    assert type_error(lambda: kvevict.EvictionOptions(10.5)) == \
        "kvevict: EvictionOptions: budget must be an int, got float"
    assert type_error(lambda: kvevict.EvictionOptions("64")) == "kvevict: EvictionOptions: budget must be an int, got str"
    assert type_error(lambda: kvevict.MlaCacheOptions(1, 2, dtype="float16")) == \
        "kvevict: MlaCacheOptions: dtype must be a torch.dtype, got str; use torch.float16"
    assert type_error(lambda: c.update(0, None, v)) == "kvevict: MlaCache.update: k_new must be a torch.Tensor, got None"
    assert type_error(lambda: kvevict.attend(torch.randn(1, 2, 1, 4), lc, 0)) == (
        "kvevict: attend: cache must be an MlaCache, got MlaLatentCache; for the latent layout use "
        "attend_absorbed(q_absorbed, q_pe, cache, layer)")
    assert type_error(lambda: kvevict.attend_absorbed(k, k, c, 0)).startswith(
        "kvevict: attend_absorbed: cache must be an MlaLatentCache, got MlaCache; for the expanded layout use attend(")
    assert type_error(lambda: kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2), scorer=3)) == (
        "kvevict: MlaCache: scorer must be a scorer (CumulativeAttention, MeanObservedAttention, LatestAttention, "
        "DecayedAttention, SnapKV) or a scorer name, got int")


def test_type_errors_of_every_form():
    c = expanded()
    k, v = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 3)
    opts = kvevict.MlaCacheOptions(1, 2)
    assert type_error(lambda: c.evict()) == "kvevict: MlaCache.evict: missing argument layer"
    assert type_error(lambda: c.evict(0, 1)) == "kvevict: MlaCache.evict: takes at most 1 positional argument, got 2"
    assert type_error(lambda: c.evict(lay=0)) == "kvevict: MlaCache.evict: has no argument 'lay' (its arguments: layer)"
    assert type_error(lambda: c.update(0, k, v, counts=["a"])) == \
        "kvevict: MlaCache.update: counts must be a list of ints or None, got list of str"
    assert type_error(lambda: kvevict.attend(k, c, 0, scale="a")) == \
        "kvevict: attend: scale must be a float or an int or None, got str"
    # property setters
    with pytest.raises(TypeError, match=r"^kvevict: MlaCacheOptions.dtype must be a torch.dtype, got str; use torch.bfloat16$"):
        opts.dtype = "bfloat16"
    with pytest.raises(TypeError, match=r"^kvevict: EvictionOptions.budget must be an int, got float$"):
        kvevict.EvictionOptions().budget = 1.5
    with pytest.raises(TypeError, match=r"^kvevict: MlaCacheOptions: device must be a torch.device or a str, got int$"):
        kvevict.MlaCacheOptions(1, 2, device=0)
    # overloads: the form that fits best, or every form
    ring = kvevict.LseRing(c)
    assert type_error(lambda: kvevict.LseRing(c, "x")) == "kvevict: LseRing: scale must be a float or an int or None, got str"
    assert type_error(lambda: ring.push(0, k, 3)) == "kvevict: LseRing.push: lse must be a torch.Tensor, got int"
    assert type_error(lambda: ring.push(0, k)) == (
        "kvevict: LseRing.push: takes (layer: int, q: torch.Tensor, lse: torch.Tensor) or (layer: int, q_absorbed: "
        "torch.Tensor, q_pe: torch.Tensor, lse: torch.Tensor), got (int, Tensor)")
    # a converting call is untouched: a float for a float, an int-like tensor for an int
    c.update(0, k, v)
    kvevict.attend(k, c, 0, scale=1)
    assert c.size(torch.tensor(0)) == 1


def every_layer_call(c):
    """Every bound callable of a cache that takes `layer` first (and the module's functions that take
    a cache and a layer), as (where, call with layer='x')."""
    for name, attr in sorted(vars(type(c)).items()):
        doc = getattr(attr, "__doc__", None) or ""
        if name.startswith("_") or isinstance(attr, property) or f"{name}(self: kvevict._kvevict." not in doc:
            continue
        if doc.split("(self: ", 1)[1].split(", ", 1)[-1].startswith("layer:"):
            yield f"{type(c).__name__}.{name}", lambda attr=attr: attr(c, "x")


@pytest.mark.parametrize("make", [expanded, latent])
def test_every_method_taking_a_layer_names_it(make):
    c = make()
    calls = list(every_layer_call(c))
    assert len(calls) >= 20
    for where, call in calls:
        msg = type_error(call)
        assert re.match(rf"kvevict: {where}: layer must be an int( or None)?, got str", msg), msg


def test_pybind11_message_is_kept_for_other_type_errors():
    # kvevict's own TypeErrors (c10::TypeError) pass through as they were
    c = expanded()
    with pytest.raises(TypeError, match=r"^kvevict: k_new must have the cache's dtype"):
        c.update(0, torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 3))


# ---- scorer names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_caches_take_the_installers_scorer_names(name):
    want = SCORERS[name]
    for cache in (kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2), scorer=name),
                  kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 2), scorer=name.upper()),
                  kvevict.EvictionPolicy(kvevict.EvictionPolicyOptions(1, 2), scorer=name)):
        assert type(cache.scorer) is want and repr(cache.scorer) == repr(want())


def test_an_unknown_scorer_name_lists_the_names():
    with pytest.raises(ValueError) as e:
        kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2), scorer="h20")
    assert str(e.value) == ("kvevict: scorer must be a scorer object or one of the names " +
                            ", ".join(f"'{n}'" for n in SCORERS) + ", got 'h20'")


# ---- device names, recall's shape errors, Python wording ---------------------------------------------
def test_a_bad_device_name_is_kvevicts_value_error():
    for make in (lambda: kvevict.MlaCacheOptions(1, 2, device="tpu"),
                 lambda: kvevict.MlaLatentCacheOptions(1, 2, device="tpu"),
                 lambda: kvevict.EvictionPolicyOptions(1, 2, device="tpu")):
        with pytest.raises(ValueError, match=r"^kvevict: \w+Options: device must be a torch.device or a device name "
                                             r"such as 'cpu', 'cuda' or 'cuda:0', got 'tpu'$"):
            make()
    opts = kvevict.MlaCacheOptions(1, 2)
    with pytest.raises(ValueError, match=r"^kvevict: MlaCacheOptions: device must be .* got 'gpu'$"):
        opts.device = "gpu"
    opts.device = torch.device("cpu")
    assert opts.device == torch.device("cpu")


def test_recall_raises_what_its_docstring_says():
    doc = kvevict.MlaCache.recall.__doc__
    assert "RuntimeError without a tier, with an open observation or on a bad query shape" in doc
    assert "ValueError for a bad scale, tokens or rescore" in doc
    c = expanded(tier_tokens=8, tier_page_size=1)
    c.update(0, torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 3))
    with pytest.raises(RuntimeError, match=r"^kvevict: .*query"):  # a shape error, as every other
        c.recall(0, torch.zeros(1, 2, 1, 5), 0.5, 2)
    with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
        c.recall(0, torch.zeros(1, 2, 1, 4), -1.0, 2)
    with pytest.raises(RuntimeError, match=r"no host tier"):
        expanded().recall(0, torch.zeros(1, 2, 1, 4), 0.5, 2)


@pytest.mark.parametrize("make", [expanded, latent])
def test_the_observation_checks_hint_in_python_syntax(make):
    c = make()
    if isinstance(c, kvevict.MlaCache):
        c.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 3))
    else:
        c.update(0, torch.zeros(1, 3, 4), torch.zeros(1, 3, 2))
    probs = torch.full((1, 2, 1, 3), 1 / 3)
    probs[0, 0, 0, 1] = math.nan
    with pytest.raises(RuntimeError) as e:
        c.observe(0, probs)
    assert "check_observations=False" in str(e.value) and "check_observations(false)" not in str(e.value)
