"""The options' ``reduce_contributions`` from Python (python/src/bindings.cpp): a callable that sums the
scores over tensor-parallel ranks, emulated here in one process. Two caches each hold 2 of 4 heads
(``total_heads=4``), each driven by its own thread; each one's reducer adds the other's sums (an
all-reduce of two "ranks", exchanged through a barrier). Their scores and kept positions must equal
one cache holding all 4 heads, bit for bit (the sums are exact fixed point). Then the errors: a
non-callable, a callable that returns something, one that raises, one that reshapes the sums."""

import functools
import threading

import pytest
import torch

import kvevict

H, HALF, R, ROPE, T = 4, 2, 8, 4, 12


def _opts(heads, **kw):
    return kvevict.MlaLatentCacheOptions(1, heads, kv_lora_rank=R, qk_rope_dim=ROPE, qk_nope_dim=4, **kw)


def _run(cache, q_a, q_b, ckv, kpe):
    """A prompt of T tokens, then 3 single-token steps, each attended (observed) then evicted."""
    cache.update(0, ckv[:, :T], kpe[:, :T])
    kvevict.attend_absorbed(q_a[:, :, :T].contiguous(), q_b[:, :, :T].contiguous(), cache, 0)
    cache.evict(0)
    for t in range(T, T + 3):
        cache.update(0, ckv[:, t:t + 1], kpe[:, t:t + 1])
        kvevict.attend_absorbed(q_a[:, :, t:t + 1].contiguous(), q_b[:, :, t:t + 1].contiguous(), cache, 0)
        cache.evict(0)
    return cache


@pytest.mark.parametrize("scorer", [kvevict.CumulativeAttention(), kvevict.MeanObservedAttention(),
                                    kvevict.LatestAttention()])
def test_two_halves_with_summed_contributions_equal_all_heads(scorer):
    g = torch.Generator().manual_seed(3)
    n = T + 3
    q_a, q_b = torch.randn(1, H, n, R, generator=g) * 3, torch.randn(1, H, n, ROPE, generator=g) * 3
    ckv, kpe = torch.randn(1, n, R, generator=g), torch.randn(1, n, ROPE, generator=g)
    ev = kvevict.EvictionOptions(3, n_sink=1, n_recent=2)
    full = _run(kvevict.MlaLatentCache(_opts(H), ev, scorer), q_a, q_b, ckv, kpe)

    halves = [(q_a[:, :HALF], q_b[:, :HALF]), (q_a[:, HALF:], q_b[:, HALF:])]
    barrier, posted, calls = threading.Barrier(2, timeout=30), [None, None], [0, 0]

    def all_reduce(i, layer, sums):  # what torch.distributed.all_reduce(sums) does between two ranks
        posted[i] = sums.clone()
        barrier.wait()
        sums.add_(posted[1 - i])
        calls[i] += 1
        barrier.wait()

    caches, errors = [None, None], []

    def rank(i):
        try:
            o = _opts(HALF, total_heads=H)
            o.reduce_contributions = functools.partial(all_reduce, i)
            assert callable(o.reduce_contributions) and "reduce_contributions=<set>" in repr(o)
            caches[i] = _run(kvevict.MlaLatentCache(o, ev, scorer), *halves[i], ckv, kpe)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert calls == [4, 4]  # one reduction per observation: the prompt, then 3 steps
    for c in caches:
        assert torch.equal(c.positions(0), full.positions(0))
        assert torch.equal(c.scores(0), full.scores(0))
    # without the reduction a half ranks by its own heads
    alone = _run(kvevict.MlaLatentCache(_opts(HALF, total_heads=H), ev, scorer), *halves[0], ckv, kpe)
    assert not torch.equal(alone.scores(0), full.scores(0))


def test_reduce_contributions_errors():
    o = _opts(HALF, total_heads=H)
    assert o.reduce_contributions is None
    with pytest.raises(TypeError, match=r"MlaLatentCacheOptions.reduce_contributions must be a callable .* got int"):
        o.reduce_contributions = 3
    ev = kvevict.EvictionOptions(3, n_sink=1, n_recent=2)
    q_a, q_b = torch.randn(1, HALF, 4, R), torch.randn(1, HALF, 4, ROPE)

    def attend_with(fn):
        o.reduce_contributions = fn
        c = kvevict.MlaLatentCache(o, ev)
        c.update(0, torch.randn(1, 4, R), torch.randn(1, 4, ROPE))
        kvevict.attend_absorbed(q_a, q_b, c, 0)

    with pytest.raises(TypeError, match=r"must reduce `sums` in place and return None or sums itself .* got Work"):
        class Work:
            pass
        attend_with(lambda layer, sums: Work())
    with pytest.raises(KeyError, match="peer gone"):
        attend_with(lambda layer, sums: (_ for _ in ()).throw(KeyError("peer gone")))
    with pytest.raises(ValueError, match=r"must keep sums' shape \[1, \d+\] and dtype Double"):
        attend_with(lambda layer, sums: sums.resize_(2))
    o.reduce_contributions = None
    assert o.reduce_contributions is None and "reduce_contributions" not in repr(o)
    p = kvevict.EvictionPolicyOptions(1, HALF, total_heads=H)
    p.reduce_contributions = print
    assert p.reduce_contributions is print
