"""Eviction on a model in one call: ``kvevict.install`` and the prefill press ``kvevict.press``.

    model = kvevict.models.Model.load()
    kv = kvevict.install(model, budget=64, n_sink=4, n_recent=32, scorer="h2o", layout="latent")
    tokens = kv.generate(prompt, max_new_tokens=32)   # or model(tokens) step by step
    kv.remove()                                      # the model attends in full again

    with kvevict.press(model, budget=64, n_sink=4, n_recent=32, scorer=kvevict.SnapKV(32, 5)) as kv:
        tokens = kv.generate(prompt, max_new_tokens=32)  # the prompt compressed once per layer

``install`` swaps each attention module of the model (every ``kvevict.models.MLA``, in
order: layer l is the l-th) for an ``EvictingAttention`` that appends the chunk's rows to a
kvevict cache (``MlaCache`` for ``layout="expanded"``, ``MlaLatentCache`` for ``"latent"``),
attends through it with ``kvevict.attend`` / ``attend_absorbed`` (which feed the scorer) and
evicts the layer. Each ``model(tokens)`` call then continues the cached sequence: RoPE
positions come from the cache, not from the model's ``arange``. It works on models whose
attention modules are ``kvevict.models.MLA`` (or have its ``project`` / ``expand`` / ``out`` /
``absorbed_weights`` methods and ``c`` config); it is not a patch for arbitrary Hugging Face
models.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Union

import torch
from torch import nn

from . import _kvevict as _k
from .models import MLA

ScorerLike = Union[str, "_k.CumulativeAttention", "_k.MeanObservedAttention", "_k.LatestAttention",
                   "_k.DecayedAttention", "_k.SnapKV"]

#: Scorer names ``install`` and ``press`` accept besides scorer objects.
SCORERS = {
    "h2o": _k.CumulativeAttention,
    "cumulative": _k.CumulativeAttention,
    "mean": _k.MeanObservedAttention,
    "tova": _k.LatestAttention,
    "latest": _k.LatestAttention,
    "decay": _k.DecayedAttention,
    "snapkv": _k.SnapKV,
}
LAYOUTS = ("expanded", "latent")


def make_scorer(scorer: ScorerLike):
    """A scorer object from a name in ``SCORERS`` (default parameters) or a scorer object."""
    if isinstance(scorer, str):
        if scorer.lower() not in SCORERS:
            raise ValueError(f"kvevict: scorer must be one of {sorted(SCORERS)} or a scorer object, got '{scorer}'")
        return SCORERS[scorer.lower()]()
    if not isinstance(scorer, tuple(set(SCORERS.values()))):
        raise TypeError(f"kvevict: scorer must be a name or a kvevict scorer object, got {type(scorer).__name__}")
    return scorer


class EvictingAttention(nn.Module):
    """Layer `layer`'s attention through the installed cache (the module ``install`` puts in
    place of an ``MLA``). ``forward(x, pos, mask)`` takes the ``MLA`` arguments; `pos` and `mask`
    are ignored: positions continue the cached sequence."""

    def __init__(self, attn: nn.Module, handle: "Installed", layer: int):
        super().__init__()
        self.inner = attn
        self.layer = layer
        self._handle = [handle]  # a list: not registered as a submodule

    def forward(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self._handle[0]
        l, cache = self.layer, h.cache
        start = cache.seen_tokens(l) + h.offsets[l]
        T = x.size(1)
        if start == 0:
            h.last[l] = None
        if h.compress and start == 0 and T > 1:  # the press: the prompt compressed once
            out, h.last[l] = self.inner.compressed(x, torch.arange(T, dtype=torch.long), cache, l)
            h.offsets[l] = T - cache.seen_tokens(l)
            return out
        positions = torch.arange(start, start + T, dtype=torch.long)
        out, h.last[l] = self.inner.cached(x, positions, cache, l, h.last[l], h.observe)
        cache.evict(l)
        return out


class Installed:
    """What ``install`` returns: the cache and the per-sequence state of an installed model.

    Attributes: ``model``; ``cache`` (``MlaCache`` or ``MlaLatentCache``, batch rows =
    `batch_size`); ``layout``; ``compress`` (the press: an empty layer's first multi-token
    chunk is compressed by ``compress_prompt`` instead of appended); ``observe``."""

    def __init__(self, model: nn.Module, attns: List[MLA], cache, layout: str, compress: bool, observe: bool):
        self.model = model
        self.cache = cache
        self.layout = layout
        self.compress = compress
        self.observe = observe
        self.last: List[Optional[torch.Tensor]] = [None] * len(attns)
        self.offsets = [0] * len(attns)
        self._swapped = []  # (parent, name, original)
        for layer, (parent, name, attn) in enumerate(attns):
            setattr(parent, name, EvictingAttention(attn, self, layer))
            self._swapped.append((parent, name, attn))
        model._kvevict_installed = self

    @property
    def installed(self) -> bool:
        return bool(self._swapped)

    def reset(self) -> None:
        """Empties the cache for a new sequence (positions restart at 0)."""
        self.cache.reset()
        self.last = [None] * len(self.last)
        self.offsets = [0] * len(self.offsets)

    def remove(self) -> None:
        """Puts the original attention modules back: the model attends in full again."""
        for parent, name, attn in self._swapped:
            setattr(parent, name, attn)
        self._swapped = []
        if getattr(self.model, "_kvevict_installed", None) is self:
            del self.model._kvevict_installed

    def kept_positions(self, layer: int, row: int = 0) -> List[int]:
        """The positions `row` of `layer` holds, ascending (cache positions: after a compressed
        prompt the kept tokens are numbered 0..n-1)."""
        p = self.cache.positions(layer)[row]
        return sorted(int(x) for x in p[p >= 0])

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, return_logits: bool = False):
        """Greedy decoding through the cache: the prompt [B, T] int64 in one chunk (compressed
        under the press), then one token per step. Starts from an empty cache (``reset()``).
        Returns the tokens [B, T + max_new_tokens], and with `return_logits` also the logits of
        every step [B, T + max_new_tokens - 1, vocab] (the last token's are not computed)."""
        if not self.installed:
            raise RuntimeError("kvevict: generate() after remove(); install() again")
        if prompt.dim() != 2 or prompt.size(1) < 1:
            raise ValueError(f"kvevict: prompt must be [B, T] with T >= 1, got {list(prompt.shape)}")
        if prompt.size(0) != self.cache.batch_size:
            raise ValueError(f"kvevict: prompt must have B = {self.cache.batch_size} rows (the cache's batch_size), "
                             f"got {prompt.size(0)}")
        if max_new_tokens < 0:
            raise ValueError(f"kvevict: max_new_tokens must be >= 0, got {max_new_tokens}")
        self.reset()
        tokens = [prompt]
        logits = []
        nxt = prompt
        for i in range(max_new_tokens):
            out = self.model(nxt)
            logits.append(out)
            nxt = out[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
        seq = torch.cat(tokens, 1)
        if return_logits:
            return seq, (torch.cat(logits, 1) if logits else torch.empty(prompt.size(0), 0, 0))
        return seq


def _attention_modules(model: nn.Module):
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, EvictingAttention):
                raise ValueError("kvevict: the model already has eviction installed; remove() it first")
            if isinstance(child, MLA):
                found.append((parent, name, child))
    if not found:
        raise ValueError("kvevict: install() found no kvevict.models.MLA attention module in the model")
    return found


def install(model: nn.Module, budget: int = 4096, n_sink: int = 4, n_recent: int = 512, *,
            scorer: ScorerLike = "h2o", layout: str = "expanded", evict_every: int = 1, batch_size: int = 1,
            layer_budgets: Optional[List[int]] = None, dtype: Optional[torch.dtype] = None,
            observe: bool = True, compress: bool = False) -> Installed:
    """Installs KV-cache eviction on `model` in one call (module swap: every ``MLA`` becomes an
    ``EvictingAttention`` over one kvevict cache) and returns the ``Installed`` handle.

    budget, n_sink, n_recent, evict_every: the ``EvictionOptions`` (capacity = n_sink + budget +
    n_recent tokens per row and layer). scorer: a scorer object or a name in ``SCORERS``
    ("h2o", "mean", "tova", "decay", "snapkv"). layout: "expanded" (``MlaCache``: per-head keys and
    values) or "latent" (``MlaLatentCache``: ckv + kpe, absorbed attention). dtype: of the cache
    (default: the model's parameters'). observe: feed attention to the scorer. compress: the
    press (see ``press``). Raises ValueError on a bad layout, scorer or option (the model is
    unchanged then)."""
    if layout not in LAYOUTS:
        raise ValueError(f"kvevict: layout must be one of {LAYOUTS}, got '{layout}'")
    attns = _attention_modules(model)
    c = attns[0][2].c
    s = make_scorer(scorer)
    eviction = _k.EvictionOptions(budget, n_sink=n_sink, n_recent=n_recent, evict_every=evict_every)
    dt = dtype or next(model.parameters()).dtype
    common = dict(batch_size=batch_size, dtype=dt, layer_budgets=list(layer_budgets or []))
    if layout == "expanded":
        opts = _k.MlaCacheOptions(len(attns), c.n_heads, qk_dim=c.qk_dim, v_dim=c.v_dim, **common)
        cache = _k.MlaCache(opts, eviction, s)
    else:
        opts = _k.MlaLatentCacheOptions(len(attns), c.n_heads, kv_lora_rank=c.kv_lora, qk_rope_dim=c.qk_rope,
                                        qk_nope_dim=c.qk_nope, **common)
        cache = _k.MlaLatentCache(opts, eviction, s)
    return Installed(model, attns, cache, layout, compress, observe)


@contextlib.contextmanager
def press(model: nn.Module, budget: int = 4096, n_sink: int = 4, n_recent: int = 512, *,
          scorer: ScorerLike = "snapkv", layout: str = "expanded", **kwargs) -> Iterator[Installed]:
    """Prefill compression, kvpress-style: inside the ``with``, the first chunk each layer sees
    (the prompt) is attended in full and compressed once to the layer's capacity by
    ``kvevict.compress_prompt`` under `scorer`: SnapKV (the last `window` prompt queries vote,
    then pooling; the default, window 64 and kernel 5: pass ``kvevict.SnapKV(window, kernel)``,
    and keep n_recent >= window) or H2O from the LSE (``"h2o"``: every prompt query's attention,
    recomputed from the log-sum-exp). Later tokens decode through the cache and are evicted
    under the same scorer. On exit the model is restored. Yields the ``Installed`` handle;
    other keyword arguments go to ``install``."""
    handle = install(model, budget, n_sink, n_recent, scorer=scorer, layout=layout, compress=True, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()
