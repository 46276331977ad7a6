"""The binding against the C++ library (kvevict_reference), hand-worked examples and the
selection oracle: kept positions, scores, attention, prompt compression, the caller-owned
policy, errors and zero-copy views."""

import math

import pytest
import torch

import kvevict
from conftest import kept, oracle_keep, reference

SCORERS = [
    ("CumulativeAttention", {}, lambda: kvevict.CumulativeAttention()),
    ("MeanObservedAttention", {}, lambda: kvevict.MeanObservedAttention()),
    ("LatestAttention", {}, lambda: kvevict.LatestAttention()),
    ("DecayedAttention", {"gamma": 0.5}, lambda: kvevict.DecayedAttention(0.5)),
    ("SnapKV", {"window": 3, "kernel": 3}, lambda: kvevict.SnapKV(3, 3)),
]
DIMS = {"expanded": {"qk_dim": 24, "v_dim": 16}, "latent": {"kv_lora_rank": 20, "qk_rope_dim": 8, "qk_nope_dim": 12}}


def make_cache(req, scorer):
    ev = kvevict.EvictionOptions(req["budget"], n_sink=req["n_sink"], n_recent=req["n_recent"],
                                 evict_every=req.get("evict_every", 1))
    common = dict(batch_size=req.get("batch_size", 1), layer_budgets=req.get("layer_budgets", []))
    d = DIMS[req["layout"]]
    if req["layout"] == "expanded":
        return kvevict.MlaCache(kvevict.MlaCacheOptions(req["num_layers"], req["num_heads"], **d, **common), ev, scorer)
    return kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(req["num_layers"], req["num_heads"], **d, **common),
                                  ev, scorer)


def run_trace(req, scorer):
    """What reference.cpp's trace does, through the binding."""
    cache = make_cache(req, scorer)
    out = {"positions": [], "scores": [], "outputs": [], "evicted": []}
    for s in req["steps"]:
        op, layer = s["op"], s.get("layer", 0)
        if op == "update":
            cache.update(layer, *s["rows"], counts=s.get("counts"))
        elif op == "attend":
            q = s["q"]
            if req["layout"] == "expanded":
                out["outputs"].append(kvevict.attend(q[0], cache, layer, s.get("scale")))
            else:
                out["outputs"].append(kvevict.attend_absorbed(q[0], q[1], cache, layer, s.get("scale")))
        elif op == "observe":
            cache.observe(layer, s["probs"])
        elif op == "add_scores":
            cache.add_scores(layer, s["scores"])
        elif op == "evict":
            out["evicted"].append(cache.evict(layer))
        elif op == "truncate":
            cache.truncate(s["row"], s["k"])
        elif op == "finish":
            cache.finish(s["row"])
        elif op == "add_sequence":
            cache.add_sequence()
        elif op == "reset":
            cache.reset(s.get("row"))
        if s.get("record"):
            for l in range(cache.num_layers):
                out["positions"].append(cache.positions(l))
                out["scores"].append(cache.scores(l))
    return out


def rows(layout, B, H, T, g):
    d = DIMS[layout]
    if layout == "expanded":
        return [torch.randn(B, H, T, d["qk_dim"], generator=g), torch.randn(B, H, T, d["v_dim"], generator=g)]
    return [torch.randn(B, T, d["kv_lora_rank"], generator=g), torch.randn(B, T, d["qk_rope_dim"], generator=g)]


def queries(layout, B, H, T, g):
    d = DIMS[layout]
    if layout == "expanded":
        return [torch.randn(B, H, T, d["qk_dim"], generator=g)]
    return [torch.randn(B, H, T, d["kv_lora_rank"], generator=g), torch.randn(B, H, T, d["qk_rope_dim"], generator=g)]


def decode_trace(layout, scorer_name, params, seed=0):
    """Two layers (per-layer budgets), two rows: a ragged prefill, decode steps with attention,
    evict_every 2, a rollback, a row that finishes and a new sequence in its place."""
    g = torch.Generator().manual_seed(seed)
    B, H, L = 2, 3, 2
    steps = []
    for l in range(L):  # ragged prefill: row 0 appends 9 tokens, row 1 appends 5 (left-padded)
        steps += [{"op": "update", "layer": l, "rows": rows(layout, B, H, 9, g), "counts": [9, 5]},
                  {"op": "attend", "layer": l, "q": queries(layout, B, H, 9, g)},
                  {"op": "evict", "layer": l, "record": l == L - 1}]
    for t in range(12):
        for l in range(L):
            steps += [{"op": "update", "layer": l, "rows": rows(layout, B, H, 1, g)},
                      {"op": "attend", "layer": l, "q": queries(layout, B, H, 1, g), "scale": 0.3},
                      {"op": "evict", "layer": l, "record": True}]
        if t == 5:
            steps.append({"op": "truncate", "row": 1, "k": 1, "record": True})
        if t == 8:
            steps += [{"op": "finish", "row": 0}, {"op": "add_sequence", "record": True}]
    return dict(op="trace", layout=layout, scorer=scorer_name, **params, **DIMS[layout], num_layers=L, num_heads=H,
                batch_size=B, budget=3, n_sink=1, n_recent=3, evict_every=2, layer_budgets=[3, 2], steps=steps)


@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("scorer_name,params,scorer", SCORERS, ids=[s[0] for s in SCORERS])
def test_decode_keeps_what_the_cpp_keeps(layout, scorer_name, params, scorer):
    req = decode_trace(layout, scorer_name, params)
    ours, theirs = run_trace(req, scorer()), reference(req)
    assert len(ours["positions"]) == len(theirs["positions"]) > 20
    for a, b in zip(ours["positions"], theirs["positions"]):
        assert torch.equal(a, b)
    for a, b in zip(ours["scores"], theirs["scores"]):
        assert torch.equal(a, b)
    for a, b in zip(ours["outputs"], theirs["outputs"]):
        assert torch.equal(a, b)
    assert ours["evicted"] == list(theirs["evicted"])
    assert sum(ours["evicted"]) > 0


def test_add_scores_keeps_the_oracle_set():
    g = torch.Generator().manual_seed(1)
    for S, n_sink, budget, n_recent in [(30, 2, 8, 3), (17, 0, 5, 1), (12, 4, 1, 4)]:
        cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=8, v_dim=8, batch_size=2),
                                 kvevict.EvictionOptions(budget, n_sink=n_sink, n_recent=n_recent))
        cache.update(0, torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g))
        scores = torch.rand(2, S, generator=g)
        scores[1, 3:9] = 0.25  # ties: the older are evicted first
        cache.add_scores(0, scores)
        cache.evict(0)
        for row in range(2):
            want = oracle_keep(list(range(S)), scores[row].tolist(), n_sink, budget, n_recent)
            assert kept(cache, 0, row) == want


def test_hand_worked_ties_keep_the_newest_candidates():
    # 10 tokens, equal scores, 2 sinks, budget 3, 2 recent: candidates 2..7 tie, the older go first.
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 1, qk_dim=4, v_dim=4),
                             kvevict.EvictionOptions(3, n_sink=2, n_recent=2))
    cache.update(0, torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4))
    cache.add_scores(0, torch.full((1, 10), 0.5))
    assert cache.evict(0) == 3
    assert kept(cache) == [0, 1, 5, 6, 7, 8, 9]
    # the lowest-scored candidates (positions 2..7 here) go first
    cache.reset()
    cache.update(0, torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4))
    cache.add_scores(0, torch.tensor([[0, 0, 5, 1, 4, 3, 2, 9, 0, 0]], dtype=torch.float32))
    cache.evict(0)
    assert kept(cache) == [0, 1, 2, 4, 7, 8, 9]


def test_keep_indices_matches_cpp_and_oracle():
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(3, 40, generator=g)
    scores[2, 10:30] = 1.0
    sel = kvevict.Selection(kvevict.EvictionOptions(10, n_sink=3, n_recent=5))
    keep = sel.keep_indices(scores)
    ref = reference(dict(op="keep_indices", scores=scores, budget=10, n_sink=3, n_recent=5))["keep"]
    assert torch.equal(keep, ref)
    for b in range(3):
        assert keep[b].tolist() == oracle_keep(list(range(40)), scores[b].tolist(), 3, 10, 5)
    assert sel.capacity() == 18
    slots = sel.evict_slots(scores, torch.arange(40).expand(3, 40).contiguous())
    for b in range(3):
        assert sorted(set(range(40)) - set(slots[b].tolist())) == keep[b].tolist()


@pytest.mark.parametrize("layout", ["expanded", "latent"])
@pytest.mark.parametrize("scorer_name,params,scorer", [SCORERS[0], SCORERS[4]], ids=["H2O", "SnapKV"])
def test_compress_prompt_matches_cpp(layout, scorer_name, params, scorer):
    g = torch.Generator().manual_seed(3)
    B, H, T = 2, 2, 30
    scale = 0.2
    d = DIMS[layout]
    if layout == "expanded":
        q, k = torch.randn(B, H, T, d["qk_dim"], generator=g), torch.randn(B, H, T, d["qk_dim"], generator=g)
        v = torch.randn(B, H, T, d["v_dim"], generator=g)
        logits = (q @ k.transpose(-2, -1)).mul(scale)
        tensors = dict(q=q, k=k, v=v)
    else:
        qa, qp = torch.randn(B, H, T, d["kv_lora_rank"], generator=g), torch.randn(B, H, T, d["qk_rope_dim"], generator=g)
        ckv, kpe = torch.randn(B, T, d["kv_lora_rank"], generator=g), torch.randn(B, T, d["qk_rope_dim"], generator=g)
        logits = (qa @ ckv.unsqueeze(1).transpose(-2, -1) + qp @ kpe.unsqueeze(1).transpose(-2, -1)).mul(scale)
        tensors = dict(q_absorbed=qa, q_pe=qp, ckv=ckv, kpe=kpe)
    lse = torch.logsumexp(logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf), -1)
    req = dict(op="compress", layout=layout, scorer=scorer_name, **params, **d, num_layers=1, num_heads=H,
               batch_size=B, budget=6, n_sink=2, n_recent=4, scale=scale, lse=lse, **tensors)
    cache = make_cache(req, scorer())
    if layout == "expanded":
        keep = kvevict.compress_prompt(cache, 0, q, k, v, lse, scale)
    else:
        keep = kvevict.compress_prompt_absorbed(cache, 0, qa, qp, ckv, kpe, lse, scale)
    ref = reference(req)
    assert keep.shape == (B, 12)
    assert torch.equal(keep, ref["keep"])
    assert torch.equal(cache.positions(0), ref["positions"])
    assert torch.equal(cache.scores(0), ref["scores"])
    # the kept tokens at their prompt positions, the whole prompt seen, the dropped ones evicted
    assert torch.equal(cache.positions(0), keep)
    assert cache.seen_tokens(0) == T and cache.stats().tokens_evicted == B * (T - 12)
    # the same scores through prompt_scores and Selection.keep_indices
    if layout == "expanded":
        scores = kvevict.prompt_scores(q, k, lse, scale, scorer())
    else:
        scores = kvevict.prompt_scores_absorbed(qa, qp, ckv, kpe, lse, scale, scorer())
    assert torch.equal(kvevict.Selection(cache.eviction(0)).keep_indices(scores), keep)


def test_attend_matches_a_plain_softmax_attention():
    g = torch.Generator().manual_seed(4)
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=8, v_dim=6), kvevict.EvictionOptions(4, n_sink=1, n_recent=2))
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 6, generator=g)
    cache.update(0, k, v)
    cache.add_scores(0, torch.rand(1, 12, generator=g))
    cache.evict(0)
    pos = cache.positions(0)[0]
    q = torch.randn(1, 2, 1, 8, generator=g)
    cache.update(0, torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 6, generator=g))
    out, probs = kvevict.attend(q, cache, 0, 0.5, return_probs=True)
    keys, values = cache.keys(0), cache.values(0)
    want = torch.softmax(q @ keys.transpose(-2, -1) * 0.5, -1) @ values
    assert torch.allclose(out, want, atol=1e-6)
    assert probs.shape == (1, 2, 1, 8) and torch.allclose(probs.sum(-1), torch.ones(1, 2, 1))
    assert set(pos.tolist()) | {12} == set(cache.positions(0)[0].tolist())


def test_prefill_chunked_at_full_capacity_is_full_attention():
    g = torch.Generator().manual_seed(5)
    T = 20
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=8, v_dim=8), kvevict.EvictionOptions(T, n_sink=0, n_recent=0))
    out = kvevict.prefill_chunked(cache, 0, q, k, v, 6, 0.3, return_output=True)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    want = torch.softmax((q @ k.transpose(-2, -1) * 0.3).masked_fill(causal, -math.inf), -1) @ v
    assert torch.allclose(out, want, atol=1e-5)
    small = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=8, v_dim=8), kvevict.EvictionOptions(4, n_sink=1, n_recent=2))
    assert kvevict.prefill_chunked(small, 0, q, k, v, 5) is None
    assert small.size(0) == 7 and small.seen_tokens(0) == T
    assert kept(small)[0] == 0 and kept(small)[-2:] == [T - 2, T - 1]


def test_observe_lse_gives_the_scores_of_the_probabilities():
    g = torch.Generator().manual_seed(6)
    caches = [kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=8, v_dim=8), kvevict.EvictionOptions(4)) for _ in range(2)]
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    q = torch.randn(1, 2, 3, 8, generator=g)
    for c in caches:
        c.update(0, k, v)
    _, probs = kvevict.attend(q, caches[0], 0, 0.4, return_probs=True)  # observes
    causal = caches[1].positions(0).view(1, 1, 1, 10) > caches[1].query_positions(0, 3).view(1, 1, 3, 1)
    lse = torch.logsumexp((q @ k.transpose(-2, -1) * 0.4).masked_fill(causal, -math.inf), -1)
    kvevict.observe_lse(q, caches[1], 0, lse, 0.4)
    assert torch.allclose(caches[0].scores(0), caches[1].scores(0), atol=1e-6)
    with pytest.raises(RuntimeError, match="lse"):
        kvevict.observe_lse(q, caches[1], 0, lse - 1.0, 0.4)  # logits above their lse


def test_lse_ring_buffers_evict_every_steps():
    g = torch.Generator().manual_seed(7)
    cache = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 2, kv_lora_rank=8, qk_rope_dim=4, qk_nope_dim=4),
                                   kvevict.EvictionOptions(4, n_sink=1, n_recent=2, evict_every=3))
    ring = kvevict.LseRing(cache, 0.5)
    assert ring.ring_size() == 3
    with pytest.warns(DeprecationWarning):
        assert ring.capacity() == 3
    for t in range(10):
        cache.update(0, torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 4, generator=g))
        qa, qp = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 4, generator=g)
        logits = (qa @ cache.ckv(0).unsqueeze(1).transpose(-2, -1) + qp @ cache.kpe(0).unsqueeze(1).transpose(-2, -1)) * 0.5
        ring.push(0, qa, qp, torch.logsumexp(logits, -1))
        assert 0 <= ring.buffered(0) < 3  # a full ring scores itself
        due = cache.due(0)
        ring.evict(0)
        if due:  # a due pass scores the buffered queries first
            assert ring.buffered(0) == 0
            with pytest.warns(DeprecationWarning):
                assert ring.pending(0) == 0
    assert cache.size(0) <= cache.capacity() + 2
    with pytest.raises(TypeError, match="MlaLatentCache"):
        ring.push(0, qa, torch.zeros(1, 2, 1))
    for _ in range(2):  # an update without a push: the ring names the layer and row
        cache.update(0, torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 4, generator=g))
    with pytest.raises(RuntimeError, match="LseRing.push: layer 0 row 0 has"):
        ring.push(0, qa, qp, torch.zeros(1, 2, 1))


def test_policy_drives_caller_owned_buffers_like_the_cache():
    """EvictionPolicy + write_rows + apply_moves on a [B, S, H, D] buffer (token_dim 1) keep the
    tokens, and the rows, that MlaCache keeps on the same inputs."""
    g = torch.Generator().manual_seed(8)
    B, H, D = 2, 2, 4
    ev = kvevict.EvictionOptions(5, n_sink=1, n_recent=2)
    policy = kvevict.EvictionPolicy(kvevict.EvictionPolicyOptions(1, H, batch_size=B), ev)
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, H, qk_dim=D, v_dim=D, batch_size=B), ev)
    policy.reserve(32)
    buffer = torch.zeros(B, policy.slots(0), H, D)
    ptr = buffer.data_ptr()
    for t, (T, counts) in enumerate([(6, [6, 4]), (1, [1, 1]), (3, [3, 0]), (1, [1, 1]), (4, [2, 4]), (1, [1, 1])]):
        new = torch.randn(B, H, T, D, generator=g)
        mapping = policy.append(0, counts, T)
        assert mapping.shape == (B, T) and mapping.dtype == torch.int64
        kvevict.write_rows(buffer, 1, new.transpose(1, 2).contiguous(), mapping)
        cache.update(0, new, new, counts=counts)
        scores = torch.rand(B, policy.size(0), generator=g)
        policy.add_scores(0, scores)
        cache.add_scores(0, scores)
        moves = policy.evict(0)
        kvevict.apply_moves(moves, buffer, 1)
        cache.evict(0)
        assert torch.equal(policy.positions(0), cache.positions(0))
        for b in range(B):
            n = policy.size(0, b)
            assert torch.equal(buffer[b, :n].transpose(0, 1), cache.keys(0)[b, :, :n])
    assert buffer.data_ptr() == ptr  # written and moved in place
    moves = policy.truncate(0, 1)
    assert len(moves) == 1 and isinstance(moves[0], kvevict.SlotMoves)


def test_views_share_the_cache_buffers():
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=4, v_dim=4), kvevict.EvictionOptions(2, n_sink=1, n_recent=1))
    k, v = cache.update(0, torch.arange(40.0).view(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    assert k.data_ptr() == cache.keys(0).data_ptr() and v.data_ptr() == cache.values(0).data_ptr()
    lat = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 2, kv_lora_rank=4, qk_rope_dim=2))
    ckv, kpe = lat.update(0, torch.ones(1, 3, 4), torch.ones(1, 3, 2))
    assert ckv.data_ptr() == lat.ckv(0).data_ptr() and kpe.data_ptr() == lat.kpe(0).data_ptr()
    # an eviction moves rows inside the same memory: the old view sees them
    cache.add_scores(0, torch.tensor([[0.0, 0.1, 0.9, 0.2, 0.0]]))
    cache.evict(0)
    assert kept(cache) == [0, 2, 3, 4]
    slot_of_4 = cache.positions(0)[0].tolist().index(4)
    assert torch.equal(k[0, 0, slot_of_4], torch.arange(16.0, 20.0))
    # a tensor passed in is the caller's own: apply_moves and write_rows write into it
    buf = torch.arange(6.0).view(1, 6)
    kvevict.apply_moves(kvevict.SlotMoves(torch.tensor([[5]]), torch.tensor([[0]])), buf, 1)
    assert buf.tolist() == [[5.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


def test_errors_name_the_argument_and_change_nothing():
    with pytest.raises(ValueError, match="kvevict: EvictionOptions: budget must be in"):
        kvevict.MlaCache(kvevict.MlaCacheOptions(1, 1), kvevict.EvictionOptions(-1))
    with pytest.raises(ValueError, match="num_layers must be in"):
        kvevict.MlaCache(kvevict.MlaCacheOptions(0, 1))
    with pytest.raises(ValueError, match="layer 1: capacity"):
        kvevict.MlaCache(kvevict.MlaCacheOptions(2, 1, layer_budgets=[1, 0]), kvevict.EvictionOptions(1, n_sink=0, n_recent=0))
    with pytest.raises(ValueError, match="gamma"):
        kvevict.DecayedAttention(1.5)
    with pytest.raises(ValueError, match="kernel must be odd"):
        kvevict.SnapKV(4, 2)
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(2, 2, qk_dim=4, v_dim=4), kvevict.EvictionOptions(2, n_sink=1, n_recent=1))
    cache.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    before = cache.positions(0)
    with pytest.raises(IndexError, match="layer must be in \\[0, 2\\), got 7"):
        cache.update(7, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(TypeError, match="k_new must have the cache's dtype Float, got Double"):
        cache.update(0, torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="v_new must be \\[B, H, T, v_dim\\]"):
        cache.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 5))
    with pytest.raises(ValueError, match="counts\\[0\\] must be in \\[0, T = 1\\], got 2"):
        cache.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), counts=[2])
    with pytest.raises(RuntimeError, match="attention probs must be in \\[0, 1\\]"):
        cache.observe(0, torch.full((1, 2, 1, 3), 2.0))
    with pytest.raises(IndexError):
        cache.finish(3)
    assert torch.equal(cache.positions(0), before) and cache.seen_tokens(0) == 3
    with pytest.raises(TypeError, match="^kvevict: MlaCacheOptions: device must be a torch.device or a str, got int$"):
        kvevict.MlaCacheOptions(1, 1, device=3)
    with pytest.raises(TypeError):  # not a tensor: pybind11's own argument check
        cache.update(0, "k", "v")
    with pytest.raises(TypeError, match="scorer"):
        kvevict.install(kvevict.models.Model(), scorer=3)


def test_lifecycle_and_rollback():
    cache = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 1, kv_lora_rank=4, qk_rope_dim=2, batch_size=2),
                                   kvevict.EvictionOptions(2, n_sink=1, n_recent=2))
    cache.finish(1)
    assert not cache.active(1) and cache.add_sequence() == 1
    with pytest.raises(RuntimeError, match="all 2 rows hold a sequence"):
        cache.add_sequence()
    cache.update(0, torch.randn(2, 4, 4), torch.randn(2, 4, 2), counts=[4, 2])
    assert [cache.size(0, 0), cache.size(0, 1)] == [4, 2]
    cache.truncate(0, 2)
    assert cache.seen_tokens(0, 0) == 2 and kept(cache, 0, 0) == [0, 1]
    with pytest.raises(ValueError):
        cache.truncate(0, 5)
    cache.reset(1)
    assert cache.size(0, 1) == 0
    cache.reserve(64)
    assert cache.slots(0) == 65  # room for 64 tokens and the trash slot
    cache.reset()
    assert cache.size(0) == 0 and cache.stats().tokens_evicted == 0


@pytest.mark.parametrize("layout", ["expanded", "latent"])
def test_update_and_compress_prompt_when_every_row_is_free_raise(layout):
    # PYTHON-USER row 31: finish(0), then update() without add_sequence() dropped the tokens silently
    ev = kvevict.EvictionOptions(2, n_sink=1, n_recent=2)
    g = torch.Generator().manual_seed(8)
    T, H = 10, 2
    if layout == "expanded":
        cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, H, qk_dim=4, v_dim=3), ev)
        q, k, v = (torch.randn(1, H, T, d, generator=g) for d in (4, 4, 3))
        lse = torch.logsumexp((q @ k.transpose(-2, -1)).mul(0.5).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                                               -math.inf), -1)
        update = lambda: cache.update(0, k, v)  # noqa: E731
        press = lambda: kvevict.compress_prompt(cache, 0, q, k, v, lse, 0.5)  # noqa: E731
    else:
        cache = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, H, kv_lora_rank=4, qk_rope_dim=2), ev)
        qa, qp = torch.randn(1, H, T, 4, generator=g), torch.randn(1, H, T, 2, generator=g)
        ckv, kpe = torch.randn(1, T, 4, generator=g), torch.randn(1, T, 2, generator=g)
        logits = qa @ ckv.unsqueeze(1).transpose(-2, -1) + qp @ kpe.unsqueeze(1).transpose(-2, -1)
        lse = torch.logsumexp(logits.mul(0.5).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf), -1)
        update = lambda: cache.update(0, ckv, kpe)  # noqa: E731
        press = lambda: kvevict.compress_prompt_absorbed(cache, 0, qa, qp, ckv, kpe, lse, 0.5)  # noqa: E731
    update()
    cache.finish(0)
    slots = cache.slots(0)
    with pytest.raises(RuntimeError, match=r"update: no row holds a sequence \(row 0 is free: finish\(\)ed\).*"
                                           r"add_sequence\(\) first"):
        update()
    with pytest.raises(RuntimeError, match=r"no row of cache holds a sequence \(row 0 is free.*add_sequence\(\) first"):
        press()
    assert cache.size(0) == 0 and cache.seen_tokens(0) == 0 and cache.slots(0) == slots
    assert cache.stats().tokens_evicted == 0
    assert cache.add_sequence() == 0
    keep = press()  # now it works: the kept tokens at their prompt positions
    assert keep.shape == (1, 5) and kept(cache, 0, 0) == keep[0].tolist()
    assert cache.seen_tokens(0) == T and cache.stats().tokens_evicted == T - 5


def test_memory_model_hand_worked():
    c = kvevict.MlaMemoryConfig()  # DeepSeek-V3, 2 bytes per element
    assert kvevict.bytes_per_token_per_layer(c, kvevict.Layout.kExpanded) == 128 * (192 + 128) * 2
    assert kvevict.bytes_per_token(c, kvevict.Layout.kExpanded) == 4_997_120
    assert kvevict.bytes_per_token(c, kvevict.Layout.kLatent) == 61 * 576 * 2 == 70_272
    assert kvevict.full_cache_bytes(c, kvevict.Layout.kLatent, 1000) == 70_272_000
    assert kvevict.capped_cache_bytes(c, kvevict.Layout.kLatent, 10_000, 4_612) == 4_612 * 70_272
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        kvevict.capped_cache_bytes(c, kvevict.Layout.kLatent, 10, 0)
    with pytest.raises(ValueError, match="overflows int64"):
        kvevict.full_cache_bytes(c, kvevict.Layout.kExpanded, 2**62)
    # Host tier: 10,000 tokens at capacity 4,612 leave 5,388 in the tier, 1,152 + 12 + 4 bytes each,
    # plus 625 pages (16 positions each) x 8 x 576 bytes of digests, per layer.
    assert kvevict.tier_bytes(c, kvevict.Layout.kLatent, 10_000, 4_612, 32_768) == \
        61 * (5_388 * 1_168 + 625 * 8 * 576) == 559_564_224
    assert kvevict.tier_bytes(c, kvevict.Layout.kLatent, 10_000, 4_612, 0) == 0
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        kvevict.tier_bytes(c, kvevict.Layout.kLatent, 10, 4, 8, page_size=0)


def test_snapkv_pool_hand_worked():
    ranks = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    avg = kvevict.SnapKV(4, 3).pool(ranks)
    assert torch.allclose(avg, torch.tensor([[1.0, 2.0, 3.0, 4.0, 3.0]]))  # zero padding counts
    mx = kvevict.SnapKV(4, 3, kvevict.SnapKV.Pooling.kMax).pool(ranks)
    assert mx.tolist() == [[2.0, 3.0, 4.0, 5.0, 5.0]]


def test_tier_and_recall_hand_worked():
    # As the C++ case "recall by hand": one head, 2-wide keys, pages of 2, 2 heavy hitters.
    # Positions 2..5 go to the tier as pages {2, 3} (keys (1, 0), (0, 1)) and {4, 5} ((2, -1),
    # (3, -2)); q = (1, 0) bounds them by 1 and 3, so page {4, 5} comes back in place of the
    # heavy hitters 0 and 1, which go to the tier with their scores.
    opts = kvevict.MlaCacheOptions(1, 1, qk_dim=2, v_dim=1, tier_tokens=10, tier_page_size=2)
    assert (opts.tier_tokens, opts.tier_page_size) == (10, 2)
    cache = kvevict.MlaCache(opts, kvevict.EvictionOptions(2, n_sink=0, n_recent=0))
    keys = torch.tensor([5., 5., 5., 5., 1., 0., 0., 1., 2., -1., 3., -2.]).view(1, 1, 6, 2)
    cache.update(0, keys, torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1))
    cache.add_scores(0, torch.tensor([[9., 8., 0., 0., 0., 0.]]))
    cache.evict(0)
    assert cache.tier_tokens == 10
    assert cache.tier_positions(0, 0).tolist() == [2, 3, 4, 5]
    cache.update(0, torch.zeros(1, 1, 1, 2), torch.full((1, 1, 1, 1), 6.))  # victims: below the window before it
    assert cache.recall(0, torch.tensor([1., 0.]).view(1, 1, 1, 2), 1.0, 2).tolist() == [2]
    assert sorted(cache.positions(0)[0].tolist()) == [4, 5, 6]
    assert cache.tier_positions(0, 0).tolist() == [0, 1, 2, 3]
    assert cache.tier_scores(0, 0).tolist() == [9., 8., 0., 0.]
    k, v = cache.tier_rows(0, 0)
    assert torch.equal(k[0], keys[0, 0, :4])
    assert v[0, :, 0].tolist() == [0., 1., 2., 3.]
    st = cache.stats()
    assert (st.tier_tokens, st.tier_recalled, st.tier_device_bytes) == (4, 2, 0)  # the host path: no device copy
    # Two-level: one token, a pool of 4. The tier is 0 ((5, 5)), 1 ((5, 5)), 2 ((1, 0)), 3 ((0, 1));
    # q = (0, 1) bounds page {0, 1} by 5 and page {2, 3} by 1: the pool is all four, exact
    # logits 5, 5, 0, 1; position 0 (the older of the two best) comes back, in place of position
    # 4 (score 9, as 5; the older goes first).
    assert cache.recall(0, torch.tensor([0., 1.]).view(1, 1, 1, 2), 1.0, 1, rescore=4).tolist() == [1]
    assert sorted(cache.positions(0)[0].tolist()) == [0, 5, 6]
    with pytest.raises(ValueError, match="rescore must be in"):
        cache.recall(0, torch.zeros(1, 1, 1, 2), 1.0, 1, rescore=-1)
    with pytest.raises(RuntimeError, match="no host tier"):
        kvevict.MlaCache(kvevict.MlaCacheOptions(1, 1, qk_dim=2, v_dim=1)).recall(
            0, torch.zeros(1, 1, 1, 2), 1.0, 2)
    latent = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 1, kv_lora_rank=2, qk_rope_dim=1, tier_tokens=4, tier_page_size=1),
                                    kvevict.EvictionOptions(1, n_sink=0, n_recent=0))
    latent.update(0, torch.randn(1, 3, 2), torch.randn(1, 3, 1))
    latent.evict_now(0)
    assert latent.tier_size(0, 0) == 2
    latent.update(0, torch.randn(1, 1, 2), torch.randn(1, 1, 1))
    assert latent.recall_absorbed(0, torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 1), 1.0, 16).tolist() == [1]


def test_tier_scoring_head_mean_hand_worked():
    # As the C++ case "recall by hand: per head, ...": two heads, pages of 1, scale 1. Head 0's
    # logits on the tier tokens (positions 2, 3, 4) are 10, 1, 1 and head 1's -12, 2, 1.5. Per
    # head, position 2 scores 0.99975 (head 0's sharp attention); by the heads' mean logit
    # (-1, 1.5, 1.25) position 3 is best.
    want = {kvevict.TierScoring.kPerHead: 2, kvevict.TierScoring.kHeadMean: 3}
    for scoring, position in want.items():
        opts = kvevict.MlaLatentCacheOptions(1, 2, kv_lora_rank=1, qk_rope_dim=1, tier_tokens=10, tier_page_size=1,
                                             tier_scoring=scoring)
        assert opts.tier_scoring == scoring
        cache = kvevict.MlaLatentCache(opts, kvevict.EvictionOptions(2, n_sink=0, n_recent=0))
        cache.update(0, torch.tensor([0., 0., 10., 1., 1.]).view(1, 5, 1), torch.tensor([0., 0., -12., 2., 1.5]).view(1, 5, 1))
        cache.add_scores(0, torch.tensor([[9., 8., 0., 0., 0.]]))
        cache.evict(0)
        cache.update(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
        q_absorbed, q_pe = torch.tensor([1., 0.]).view(1, 2, 1, 1), torch.tensor([0., 1.]).view(1, 2, 1, 1)
        assert cache.recall_absorbed(0, q_absorbed, q_pe, 1.0, 1).tolist() == [1]
        assert sorted(cache.positions(0)[0].tolist()) == [0, position, 5]
    expanded = kvevict.MlaCacheOptions(1, 2, qk_dim=1, v_dim=1)
    expanded.tier_scoring = kvevict.TierScoring.kHeadMean
    assert expanded.tier_scoring == kvevict.TierScoring.kHeadMean


def test_observe_discard_leaves_the_scores_as_they_were():
    cache = kvevict.MlaLatentCache(kvevict.MlaLatentCacheOptions(1, 2, kv_lora_rank=4, qk_rope_dim=2),
                                   kvevict.EvictionOptions(8, n_sink=1, n_recent=1))
    cache.update(0, torch.randn(1, 3, 4), torch.randn(1, 3, 2))
    cache.add_scores(0, torch.tensor([[1., 2., 3.]]))
    cache.observe_begin(0, 1)
    cache.observe_add(0, torch.full((1, 1, 1, 3), 0.25), 0, 0)  # head 0 of 2: half the observation
    cache.observe_discard(0)
    assert cache.scores(0).tolist() == [[1., 2., 3.]]
    with pytest.raises(RuntimeError, match="no observation is open"):
        cache.observe_add(0, torch.full((1, 1, 1, 3), 0.25), 0, 1)
    with pytest.raises(RuntimeError, match="no observation is open"):
        cache.observe_end(0)
    assert cache.scores(0).tolist() == [[1., 2., 3.]]


def test_the_tiers_compiled_kernels_are_registered_and_pick_a_hand_worked_example():
    # The extension carries the tier's CPU kernels as PyTorch custom ops (torch.ops.kvevict.*).
    assert kvevict.kernels_available("cpu")
    assert kvevict.kernels_enabled()
    # One row, pages of 2: page 0 holds positions 0, 1; page 1 holds 2, 3; page 2 holds 5.
    # Store slots 0..4 and the trash slot 5; insertion numbers = slot numbers.
    position = torch.tensor([[0, 1, 2, 3, 5, -1]])
    seq = torch.tensor([[0, 1, 2, 3, 4, 0]])
    members = torch.tensor([[2, 2, 1, 0]])
    scores = torch.tensor([[0.5, 0.9, 0.7]], dtype=torch.float64)
    # Limit 3: page 1 (best, 2 tokens) fits, page 0 (2 tokens) does not, page 2 (1 token) does.
    slots, count = torch.ops.kvevict.pick_pages(scores, members, position, seq, torch.tensor([3]), 4, 2)
    assert slots.tolist() == [[3, 2, 4, 5]]  # page by page, a page's newest first; the trash slot past the count
    assert count.tolist() == [3]
    with pytest.raises(RuntimeError, match="page_size must be > 0, got 0"):
        torch.ops.kvevict.pick_pages(scores, members, position, seq, torch.tensor([3]), 4, 0)
    kvevict.set_kernels_enabled(False)
    try:
        assert not kvevict.kernels_enabled()
    finally:
        kvevict.set_kernels_enabled(True)


def test_save_layer_and_restore_layer_undo_steps_whole():
    """A saved layer, then steps that append, score, evict and recall, then the save restored: the
    layer holds what it held (positions, scores, rows, tier); the save is used once; a save of
    another kind or layer is refused, changing nothing."""
    torch.manual_seed(2)
    opts = kvevict.MlaLatentCacheOptions(2, 2, kv_lora_rank=8, qk_rope_dim=4, qk_nope_dim=4, tier_tokens=8,
                                         tier_page_size=2)
    cache = kvevict.MlaLatentCache(opts, kvevict.EvictionOptions(2, n_sink=1, n_recent=2))

    def step():
        cache.update(0, torch.randn(1, 1, 8), torch.randn(1, 1, 4))
        qa, qp = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 4)
        cache.recall_absorbed(0, qa, qp, 0.5, 1)
        kvevict.attend_absorbed(qa, qp, cache, 0, 0.5)
        cache.evict(0)

    def state():
        n = cache.size(0)
        return (cache.positions(0), cache.scores(0), cache.ckv(0)[:, :n].clone(), cache.tier_positions(0, 0),
                cache.tier_rows(0, 0)[0], cache.seen_tokens(0), cache.stats(0).tokens_evicted)

    for _ in range(12):
        step()
    before = state()
    save = cache.save_layer(0)
    assert save.layer == 0 and repr(save) == "LayerSave(layer=0)"
    for _ in range(5):
        step()
    assert cache.seen_tokens(0) == before[5] + 5
    with pytest.raises(RuntimeError, match="the save is of layer 0, not of layer 1"):
        cache.restore_layer(1, save)
    cache.restore_layer(0, save)
    assert save.layer == -1
    after = state()
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after))
    with pytest.raises(RuntimeError, match="restored already"):
        cache.restore_layer(0, save)
    expanded = kvevict.MlaCache(kvevict.MlaCacheOptions(2, 2, qk_dim=6, v_dim=4, tier_tokens=8, tier_page_size=2),
                                kvevict.EvictionOptions(2, n_sink=1, n_recent=2))  # the same capacity: buffers differ
    with pytest.raises(RuntimeError, match="buffer 0 is .*: it was made from another cache"):
        cache.restore_layer(0, expanded.save_layer(0))
    policy = kvevict.EvictionPolicy(kvevict.EvictionPolicyOptions(1, 2), kvevict.EvictionOptions(2, n_sink=1, n_recent=1))
    with pytest.raises(TypeError, match="another kind of cache or policy"):
        cache.restore_layer(0, policy.save_layer(0))
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, state()))
    policy.append(0, [3], 3)
    policy.add_scores(0, torch.tensor([[0.5, 0.1, 0.9]]))
    saved = policy.save_layer(0)
    policy.append(0, [1], 1)
    policy.add_scores(0, torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    policy.evict(0)
    policy.restore_layer(0, saved)
    assert policy.positions(0).tolist() == [[0, 1, 2]]
    assert torch.equal(policy.scores(0), torch.tensor([[0.5, 0.1, 0.9]]))


def test_recall_checks_the_query_as_it_is_scored_in_fp32():
    """A float64 query finite in fp64 but not in fp32 (1e300) is refused with checks on, as
    recall_absorbed refuses it: recall scores the query in fp32."""
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, 2, qk_dim=4, v_dim=2, tier_tokens=8, tier_page_size=2),
                             kvevict.EvictionOptions(2, n_sink=1, n_recent=1))
    cache.update(0, torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 2))
    cache.evict_now(0)
    before = (cache.positions(0), cache.tier_positions(0, 0))
    q = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    q[0, 1, 0, 2] = 1e300
    with pytest.raises(ValueError, match="recall: the queries of row 0 must be finite"):
        cache.recall(0, q, 0.5, 2)
    assert torch.equal(before[0], cache.positions(0)) and torch.equal(before[1], cache.tier_positions(0, 0))
