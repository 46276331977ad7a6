#!/usr/bin/env python3
"""The gather-per-step baseline: H2O eviction the way simple ports write it, in PyTorch.

Every decode step, per layer: concatenate the new token's K/V rows onto the cache tensors and a
0 onto the scores, add the head-mean attention probabilities, and when the cache exceeds
capacity, take a top-k over the middle tokens and gather the kept rows into new tensors (so the
whole retained cache is copied every step). Same configuration as `validate_eviction --scores
random`: 4 layers, 4 heads, keys 192 / values 128 wide, budget 64, n_sink 4, n_recent 16, 1000
steps, batch 1, fp32, CPU, one thread, attention probabilities softmax(randn).

Prints `cache_us_per_step: X` (time inside the cache operations: append, score update,
eviction; not the random inputs) and `steps/sec: X` (the whole loop), the lines
scripts/bench.sh reads.
"""
import argparse
import time

import torch


def evict(k, v, score, budget, n_sink, n_recent):
    """Keeps the sinks, the top-`budget` middle tokens by score and the recent window."""
    seq = k.shape[2]
    if seq <= n_sink + budget + n_recent:
        return k, v, score
    middle = score[:, n_sink:seq - n_recent]
    top = torch.topk(middle, budget, dim=-1).indices + n_sink
    keep = torch.cat([torch.arange(n_sink).unsqueeze(0), top.sort(dim=-1).values,
                      torch.arange(seq - n_recent, seq).unsqueeze(0)], dim=1)  # [1, capacity]
    heads, width_k, width_v = k.shape[1], k.shape[3], v.shape[3]
    index_k = keep[:, None, :, None].expand(1, heads, keep.shape[1], width_k)
    index_v = keep[:, None, :, None].expand(1, heads, keep.shape[1], width_v)
    return torch.gather(k, 2, index_k), torch.gather(v, 2, index_v), torch.gather(score, 1, keep)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--n-sink", type=int, default=4)
    p.add_argument("--n-recent", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    keys = [torch.empty(1, a.heads, 0, 192) for _ in range(a.layers)]
    values = [torch.empty(1, a.heads, 0, 128) for _ in range(a.layers)]
    scores = [torch.empty(1, 0) for _ in range(a.layers)]
    cache_seconds = 0.0
    start = time.perf_counter()
    for _ in range(a.steps):
        for layer in range(a.layers):
            k_new, v_new = torch.randn(1, a.heads, 1, 192), torch.randn(1, a.heads, 1, 128)
            probs = torch.softmax(torch.randn(1, a.heads, 1, keys[layer].shape[2] + 1), dim=-1)
            t0 = time.perf_counter()
            k = torch.cat([keys[layer], k_new], dim=2)
            v = torch.cat([values[layer], v_new], dim=2)
            score = torch.cat([scores[layer], torch.zeros(1, 1)], dim=1) + probs.sum(2).mean(1)
            keys[layer], values[layer], scores[layer] = evict(k, v, score, a.budget, a.n_sink, a.n_recent)
            cache_seconds += time.perf_counter() - t0
    elapsed = time.perf_counter() - start
    assert keys[0].shape[2] == a.n_sink + a.budget + a.n_recent
    print(f"cache_us_per_step: {1e6 * cache_seconds / a.steps:.1f}")
    print(f"steps/sec: {a.steps / elapsed:.1f}")


if __name__ == "__main__":
    main()
