"""kvevict from Python: the smoke test (as examples/smoke_test.cpp), then a short generation by
the shipped quality model with eviction installed in one call.

    ~/.cache/kvevict/venv/bin/python examples/python/smoke_test.py   # the venv scripts/setup.sh makes

Exits 1 (printing FAIL) if the eviction pass keeps anything but 2 sinks + 8 heavy hitters + 2
recent tokens, or if the model generates differently at a budget that evicts nothing.
"""

import sys

import torch

import kvevict
from kvevict.models import BOS, Model


def smoke_test() -> bool:
    """A 20-token cache (1 row, 4 heads, DeepSeek-V3 dims), random scores, budget 8, n_sink 2,
    n_recent 2: one eviction pass must keep 2 + 8 + 2 = 12 tokens."""
    torch.manual_seed(0)
    heads, tokens = 4, 20
    eviction = kvevict.EvictionOptions(8, n_sink=2, n_recent=2)
    cache = kvevict.MlaCache(kvevict.MlaCacheOptions(1, heads), eviction)

    # Prefill 20 tokens, give each a random score, evict once.
    cache.update(0, torch.randn(1, heads, tokens, 192), torch.randn(1, heads, tokens, 128))
    cache.add_scores(0, torch.rand(1, tokens))
    cache.evict(0)

    kept = cache.size(0)
    positions = cache.ordered(0).positions[0].tolist()
    sinks = positions[:2] == [0, 1]
    recent = positions[-2:] == [tokens - 2, tokens - 1]
    if kept != 12 or not sinks or not recent:
        print(f"FAIL - kept {kept} tokens (expected 12), sinks kept: {sinks}, recent kept: {recent}")
        return False
    print(f"OK - evicted {tokens} -> {kept} tokens (2 sinks + 8 heavy-hitters + 2 recent)")

    # Usage: one decode step with eviction-aware attention.
    print("\nUsage, one decode step:")
    q = torch.randn(1, heads, 1, 192)
    cache.update(0, torch.randn(1, heads, 1, 192), torch.randn(1, heads, 1, 128))
    out = kvevict.attend(q, cache, 0)  # [1, 4, 1, 128]; observes the probabilities
    evicted = cache.evict(0)
    print(f"  update -> {cache.size(0) + evicted} live tokens, attend -> output {list(out.shape)}, "
          f"evict -> {evicted} evicted, {cache.size(0)} live")
    return True


def decode(tokens) -> str:
    return bytes(t for t in tokens if t < 256).decode("latin-1")


def generation() -> bool:
    """The shipped model (examples/quality/weights.pt) continues a prompt: with the full cache,
    then with eviction installed at a capacity of 48 tokens, in both layouts."""
    model = Model.load()
    prompt = torch.tensor([[BOS] + list(b"The jury said that the city of Atlanta had")])
    print(f"\nGeneration by the quality model ({sum(p.numel() for p in model.parameters()):,} parameters), "
          f"prompt {prompt.size(1)} tokens:")
    kv = kvevict.install(model, budget=4096, n_sink=4, n_recent=512)
    full = kv.generate(prompt, 40)
    kv.remove()
    print(f"  full cache:              {decode(full[0].tolist())!r}")
    ok = True
    for layout in ("expanded", "latent"):
        kv = kvevict.install(model, budget=24, n_sink=4, n_recent=20, scorer="h2o", layout=layout)
        out = kv.generate(prompt, 40)
        print(f"  {layout:8} capacity {kv.cache.capacity():3}:  {decode(out[0].tolist())!r} "
              f"({kv.cache.stats().tokens_evicted} tokens evicted over 4 layers)")
        kv.remove()
        kv = kvevict.install(model, budget=4096, layout=layout)
        ok = ok and torch.equal(kv.generate(prompt, 40), full)
        kv.remove()
    if not ok:
        print("FAIL - a budget that evicts nothing generated differently from the full cache")
    return ok


if __name__ == "__main__":
    sys.exit(0 if smoke_test() and generation() else 1)
