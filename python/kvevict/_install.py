"""Eviction on the shipped model (``kvevict.models``) in one call: ``kvevict.install`` and the
prefill press ``kvevict.press``. For transformers' DeepSeek-V2/V3 models use ``kvevict.hf``.

    model = kvevict.models.Model.load()
    kv = kvevict.install(model, budget=64, n_sink=4, n_recent=32, scorer="h2o", layout="latent")
    tokens = kv.generate(prompt, max_new_tokens=32)   # or kv.step(chunk) step by step
    kv.remove()                                      # the model attends in full again

    with kvevict.press(model, budget=64, n_sink=4, n_recent=32, window=16) as kv:
        tokens = kv.generate(prompt, max_new_tokens=32)  # the prompt compressed once per layer

``install`` gives each attention module of the model (every ``kvevict.models.MLA``, or a module
with its ``project`` / ``expand`` / ``out`` / ``absorbed_weights`` methods and ``c`` config; layer l
is the l-th in ``model.modules()`` order) an instance-level ``forward`` that projects the chunk
(``MLA.project``, ``MLA.rows``) and hands the rows to the runtime (``_runtime.Runtime``, shared
with ``kvevict.hf``): one kvevict cache on the model's device and dtype (``MlaLatentCache`` for
``layout="latent"``, the default, ``MlaCache`` for ``"expanded"``), appended, attended through
``kvevict.attend_absorbed`` / ``attend`` (which feed the scorer) and evicted per chunk. This
module adds only what the shipped model needs: its positions and token shift, ``step`` /
``generate`` and their checks. Parameters, buffers and ``state_dict()`` keys are untouched;
``copy.deepcopy`` and pickling (``torch.save(model)``) raise a TypeError while installed.

The installed model is stateful: a forward continues the cached sequence, with RoPE positions
taken from the cache. ``Installed.step`` and ``generate`` say so explicitly; a bare
``model(tokens)`` that continues a sequence warns once per sequence (``Installed.reset()``
starts a new one).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from ._runtime import Geometry, MemoryReport, Patches, Runtime, Uncopyable, left_padding_counts, press_scorer
from .config import LAYOUTS, SCORERS, EvictionConfig, ScorerLike, make_scorer
from .models import MLA

__all__ = ["Installed", "install", "press", "make_scorer", "SCORERS", "LAYOUTS"]

_METHODS = ("project", "expand", "out", "absorbed_weights")


_COPY_REFUSAL = ("kvevict: a model with eviction installed cannot be deep-copied or pickled (torch.save(model)); "
                 "kv.remove() first (state_dict() works while installed)")


class _LayerHook(Uncopyable):
    """What an installed attention module's ``forward`` holds: the handle and the layer. Refuses
    to be copied or pickled (the cache is a C++ object)."""

    __slots__ = ("handle", "layer")
    _copy_refusal = _COPY_REFUSAL

    def __init__(self, handle: "Installed", layer: int):
        self.handle, self.layer = handle, layer


class _NoBackward(torch.autograd.Function):
    """The identity, whose backward raises: the cache moves rows in place, so there is no
    gradient through an installed attention (torch's own error would name SoftmaxBackward0)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("kvevict: no backward through an installed model (the cache moves its rows in place); "
                           "train or fine-tune with the model's own attention (kv.remove() first), and run the "
                           "installed model under torch.no_grad()")


def _installed_forward(hook: _LayerHook, x: torch.Tensor, pos: Optional[torch.Tensor] = None,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An installed module's ``forward(x, pos, mask)``: `pos` and `mask` are ignored (positions
    continue the cached sequence; the cache masks)."""
    out = hook.handle._attend(hook.layer, x)
    return _NoBackward.apply(out) if out.requires_grad else out


class Installed(Uncopyable):
    """What ``install`` returns: the cache and the per-sequence state of an installed model.

    Attributes: ``model``; ``cache`` (``MlaLatentCache`` or ``MlaCache``, ``batch_size`` rows,
    on the model's device and dtype); ``config`` (``EvictionConfig``); ``compress`` (the press's
    scorer, or None); ``layers`` (the attention modules, layer order)."""

    _copy_refusal = _COPY_REFUSAL

    def __init__(self, model: nn.Module, attns: List[nn.Module], runtime: Runtime, batch_size: int):
        self.model = model
        self._runtime = runtime
        self.cache = runtime.make_cache(batch_size)
        self.config = runtime.config
        self.compress = runtime.press
        self.layers = list(attns)
        n = len(attns)
        self._last: List[Optional[torch.Tensor]] = [None] * n
        self._counts: Optional[List[int]] = None  # the current forward's real tokens per row (left padding)
        self._explicit = False  # inside step() / generate(): continuing is what was asked for
        self._warned = False
        self._pending: Optional[torch.Tensor] = None  # generate()'s last token, not yet fed [B, 1]
        self._patches = Patches()
        for layer, attn in enumerate(attns):
            self._patches.set(attn, "forward", functools.partial(_installed_forward, _LayerHook(self, layer)))
        self._patches.set(model, "_kvevict_installed", self)

    # -- the handle --------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self.layers)

    @property
    def layout(self) -> str:
        return self.config.layout

    def reset(self) -> None:
        """Empties the cache for a new sequence (positions restart at 0)."""
        self.cache.reset()
        self._last = [None] * len(self._last)
        self._pending = None
        self._warned = False

    def remove(self) -> None:
        """Takes the installed forwards off: the model attends in full again. Idempotent."""
        self._patches.remove()
        self.layers = []

    def kept_positions(self, layer: int, row: int = 0) -> List[int]:
        """The token positions `row` of `layer` holds, ascending."""
        p = self.cache.positions(layer)[row]
        return sorted(int(x) for x in p[p >= 0])

    def stats(self) -> Dict[str, Any]:
        """Counters of the current sequence: seen (tokens taken in per row, row 0), kept (per
        layer, the longest row's cached tokens), capacity (per row and layer), and, summed over
        layers and rows, eviction_events, tokens_evicted, tier_tokens, tier_recalled."""
        return {"seen": self.cache.seen_tokens(0, 0), **self._runtime.stats(self.cache)}

    def memory(self) -> MemoryReport:
        """Bytes now (the cache's buffers and the tier's host memory) against what a full cache of
        this layout would hold for the tokens seen (all rows)."""
        if not self.installed:
            raise RuntimeError("kvevict: memory() after remove(); install() again")
        kv = self.cache
        return self._runtime.memory(kv, max(kv.seen_tokens(0, b) for b in range(kv.batch_size)), self.layout)

    def __repr__(self) -> str:
        cfg = self.config
        return (f"Installed(layers={len(self._last)}, layout={cfg.layout}, budget={cfg.budget}, n_sink={cfg.n_sink}, "
                f"n_recent={cfg.n_recent}, capacity={cfg.capacity}, press={self.compress is not None}, "
                f"tier_tokens={cfg.tier_tokens}, installed={self.installed})")

    # -- running -----------------------------------------------------------------------------------
    def _require(self) -> None:
        if not self.installed:
            raise RuntimeError("kvevict: the handle was removed; install() again")

    def _check_tokens(self, tokens: torch.Tensor, where: str) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.size(1) < 1:
            got = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"kvevict: {where}: tokens must be [B, T] int64 with T >= 1, got {got}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"kvevict: {where}: tokens must be an integer tensor (token ids), got {tokens.dtype}")
        if tokens.size(0) != self.cache.batch_size:
            raise ValueError(f"kvevict: {where}: tokens must have B = {self.cache.batch_size} rows (the cache's "
                             f"batch_size; install(..., batch_size=B) for another), got {tokens.size(0)}")

    def _with_pending(self, tokens: torch.Tensor, counts: Optional[List[int]]):
        """`tokens` with generate()'s last token (not yet in the cache) put just before each row's
        first real token: ([B, T + 1] tokens, their counts)."""
        B, T = tokens.shape
        real = [T] * B if counts is None else counts
        out = torch.cat([tokens.new_zeros(B, 1), tokens], 1)
        col = torch.tensor([T - c for c in real], device=tokens.device).unsqueeze(1)
        out.scatter_(1, col, self._pending.to(tokens.dtype))
        return out, (None if counts is None else [c + 1 for c in real])

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Continues the cached sequence with `tokens` [B, T] int64 -> logits [B, T, vocab]. After
        ``generate``, its last token (returned but not yet in the cache) is fed first, just before
        each row's first real token. attention_mask [B, T] 0/1: left padding (each row's real
        tokens its last columns; a row may have none); pads are never stored, scored or attended,
        their logits are meaningless. Raises ValueError / TypeError on a bad shape, type or mask
        (nothing changes then)."""
        self._require()
        self._check_tokens(tokens, "step")
        counts = left_padding_counts(attention_mask, tokens.size(0), tokens.size(1), "step")
        pending = self._pending is not None
        if pending:
            tokens, counts = self._with_pending(tokens, counts)
        self._explicit, self._counts = True, counts
        try:
            out = self.model(tokens)
        finally:
            self._explicit, self._counts = False, None
        self._pending = None
        return out[:, 1:] if pending else out

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, attention_mask: Optional[torch.Tensor] = None,
                 reset: bool = True, return_logits: bool = False):
        """Greedy decoding through the cache: the prompt [B, T] int64 (compressed under the press;
        in chunks of ``prefill_chunk``), then one token per step.

        attention_mask: [B, T] 0/1, left padding (see ``step``). reset: start a new sequence (the
        default); False continues the cached one (the previous call's last token is fed first:
        a conversation's next turn). Returns the tokens [B, T + max_new_tokens] (the prompt and
        the new tokens), and with `return_logits` also the logits of every step [B, T +
        max_new_tokens - 1, vocab] (the last token's are not computed; [B, T, vocab], the
        prompt's, when max_new_tokens is 0)."""
        self._require()
        self._check_tokens(prompt, "generate")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"kvevict: generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        left_padding_counts(attention_mask, prompt.size(0), prompt.size(1), "generate")  # checked before any change
        if reset:
            self.reset()
        tokens = [prompt]
        out = self.step(prompt, attention_mask)  # feeds the previous call's last token first (reset=False)
        logits = [out]
        nxt = None
        for i in range(max_new_tokens):
            if i:
                out = self.step(nxt)
                logits.append(out)
            nxt = out[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
        self._pending = nxt
        seq = torch.cat(tokens, 1)
        return (seq, torch.cat(logits, 1)) if return_logits else seq

    # -- the installed attention -------------------------------------------------------------------
    def _attend(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        attn, kv = self.layers[layer], self.cache
        B, T = x.size(0), x.size(1)
        if B != kv.batch_size:
            raise ValueError(f"kvevict: the installed cache holds B = {kv.batch_size} rows (install(..., "
                             f"batch_size=B)), the input has {B}")
        if x.dtype != kv.dtype:
            raise TypeError(f"kvevict: the installed cache holds {kv.dtype}, the model now computes in {x.dtype} (cast "
                            "after install?): kv.remove(), then install() again on the cast model")
        counts = self._counts
        if layer == 0 and not self._explicit and self._pending is not None:
            raise ValueError("kvevict: model(tokens) after generate(): generate()'s last token is not in the cache yet; "
                             "continue with kv.step(tokens) or kv.generate(..., reset=False), which feed it first, or "
                             "kv.reset() for a new sequence")
        if layer == 0 and not self._explicit and kv.seen_tokens(0) > 0 and not self._warned:
            self._warned = True
            warnings.warn(f"kvevict: model(tokens) continues the cached sequence ({kv.seen_tokens(0)} tokens seen): "
                          "the installed model keeps its cache between calls. Call kv.reset() before an unrelated "
                          "sequence; kv.step(tokens) continues without this warning.", UserWarning, stacklevel=4)
        if kv.seen_tokens(layer) == 0:
            self._last[layer] = None
        real = [T] * B if counts is None else counts
        seen = [kv.seen_tokens(layer, b) for b in range(B)]
        if counts is None and len(set(seen)) == 1:
            pos = torch.arange(seen[0], seen[0] + T, dtype=torch.long, device=x.device)
        else:
            first = torch.tensor([s - (T - c) for s, c in zip(seen, real)], dtype=torch.long, device=x.device)
            pos = (first.unsqueeze(1) + torch.arange(T, device=x.device)).clamp_min(0)  # pads: clamped, unused
        if counts is not None:
            # Pads take the row's last attention input (zeros at a sequence's start), so the token
            # shift gives each row's first real token its own predecessor, and a row with no real
            # token here hands the same `last` on.
            cols = torch.arange(T, device=x.device).unsqueeze(0)
            valid = cols >= torch.tensor([T - c for c in real], device=x.device).unsqueeze(1)
            prev = self._last[layer] if self._last[layer] is not None else x.new_zeros(B, 1, x.size(-1))
            x = torch.where(valid.unsqueeze(-1), x, prev.expand(B, T, x.size(-1)))
        # With the press, a layer's first forward starts at position 0 with no `last` (the cache
        # is empty): compress_prompt leaves seen_tokens(layer) at T, its kept tokens at their
        # prompt positions, so the next token's RoPE position is seen_tokens, as without it.
        p, self._last[layer] = attn.project(x, pos, self._last[layer])
        latent = self._runtime.latent
        o = self._runtime.run_columns(kv, layer, MLA.rows(attn, p, latent), attn.c.scale, counts, where="install()")
        return MLA.output(attn, o, latent)


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"kvevict: install: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_kvevict_installed", None) is not None:
        raise ValueError("kvevict: install: the model already has eviction installed; remove() it first")
    found: List[nn.Module] = []

    def walk(m: nn.Module) -> None:  # modules() order; an attention module's own children are not searched
        if isinstance(m, MLA) or (all(callable(getattr(m, n, None)) for n in _METHODS) and hasattr(m, "c")):
            found.append(m)
            return
        for child in m.children():
            walk(child)

    walk(model)
    if not found:
        raise ValueError(f"kvevict: install() found no MLA attention module in {type(model).__name__} (a "
                         "kvevict.models.MLA, or a module with its project / expand / out / absorbed_weights methods "
                         "and c config); for transformers' DeepSeek models use kvevict.hf.install_kv_eviction")
    return found


def install(model: nn.Module, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink,
            n_recent: int = EvictionConfig.n_recent, *, batch_size: int = 1, dtype: Optional[torch.dtype] = None,
            **options) -> Installed:
    """Installs KV-cache eviction on `model` (the shipped ``kvevict.models.Model`` or a model of
    such MLA modules) in one call and returns the ``Installed`` handle. H2O (Zhang et al. 2023,
    Sec. 3): per row and layer the cache keeps n_sink first tokens, `budget` heavy hitters and
    n_recent newest tokens: capacity = n_sink + budget + n_recent tokens (``layer_budgets``: one
    budget per layer). A sequence shorter than that evicts nothing.

    options: the other fields of ``EvictionConfig``, the one list of the options and their
    defaults, shared with ``kvevict.hf.install_kv_eviction``: scorer ("h2o", accumulated attention;
    "mean", "tova", "decay", or a scorer object; "snapkv" is the press's: ``kvevict.press``),
    layout ("latent", the default: ``MlaLatentCache``, ckv + kpe, absorbed attention; "expanded":
    ``MlaCache``, per-head keys and values), evict_every, layer_budgets, observe, the host tier
    (tier_tokens > 0: that many evicted tokens per row and layer, and each forward recalls up to
    recall_tokens of them before attending: pages of tier_page_size tokens scored by Quest's
    bounds, Tang et al. 2024, Sec. 3.2; recall_rescore: two-level recall; tier_scoring; its host
    memory is ``memory().tier_bytes``) and prefill_chunk (> 0: a forward of more tokens is
    appended, attended and evicted in chunks of that many, bounded prompt memory).
    batch_size: rows of every forward. dtype: must be the model's (the cache holds what the model
    computes), or None.

    The cache is on the model's device, in its dtype. Raises ValueError (TypeError for a wrong
    type or an unknown option) naming the argument on a bad option, a module with no MLA
    attention or an installed model; the model is unchanged then."""
    return _install(model, EvictionConfig.of("install", budget, n_sink, n_recent, options), batch_size, dtype)


def _install(model: nn.Module, config: EvictionConfig, batch_size: int, dtype: Optional[torch.dtype],
             press: Optional[Any] = None) -> Installed:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"kvevict: install: batch_size must be an int >= 1, got {batch_size!r}")
    attns = _attention_modules(model)
    c = attns[0].c
    param = next(attns[0].parameters(), None)
    if param is None:
        param = next(model.parameters())
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"kvevict: install: dtype must be a torch.dtype or None, got {type(dtype).__name__} ({dtype!r})")
    if dtype is not None and dtype != param.dtype:
        raise ValueError(f"kvevict: install: dtype must be the model's, {param.dtype}, got {dtype}: the cache holds "
                         f"what the model computes. Cast the model first (model.to({dtype})) and leave dtype unset")
    geometry = Geometry(num_layers=len(attns), num_heads=c.n_heads, kv_lora_rank=c.kv_lora, qk_rope_dim=c.qk_rope,
                        qk_nope_dim=c.qk_nope, v_dim=c.v_dim, dtype=param.dtype, device=param.device,
                        total_heads=c.n_heads)
    return Installed(model, attns, Runtime(config, geometry, press), batch_size)


@contextlib.contextmanager
def press(model: nn.Module, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink,
          n_recent: int = EvictionConfig.n_recent, *, window: int = 32, kernel: int = 5,
          scorer: Optional[ScorerLike] = None, batch_size: int = 1, dtype: Optional[torch.dtype] = None,
          **options) -> Iterator[Installed]:
    """Prefill compression, kvpress-style: inside the ``with``, the first chunk each layer sees
    (the prompt) is attended in full and compressed once to the layer's capacity by
    ``kvevict.compress_prompt`` under SnapKV (Li et al. 2024, Sec. 4: the last `window` prompt
    queries vote, then max-pooling over `kernel`), or under `scorer` ("h2o": every prompt query's
    attention, recomputed from the log-sum-exp; or a scorer object, ``kvevict.SnapKV(w, k)``
    included). Later tokens decode through the cache and are evicted under the same scorer
    (SnapKV at decode: each new token's attention is its vote). Unpadded prompts only. On exit
    the model is restored. Yields the ``Installed`` handle; other keyword arguments are
    ``install``'s (``EvictionConfig`` fields, batch_size, dtype).

    A SnapKV window longer than n_recent warns (UserWarning): the window's queries then vote for
    tokens the recent window does not protect (measured on the shipped model's passkey at a 10%
    budget: 8/32 answer tokens with window 64 > n_recent 37, 24/32 with window 32)."""
    compress = press_scorer(window, kernel, scorer, n_recent)
    handle = _install(model, EvictionConfig.of("press", budget, n_sink, n_recent, options), batch_size, dtype,
                      compress)
    try:
        yield handle
    finally:
        handle.remove()
