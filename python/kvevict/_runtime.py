"""The one Python runtime under both installers: ``kvevict.install`` / ``kvevict.press`` (the
shipped quality model, ``_install.py``) and ``kvevict.hf`` (transformers' DeepSeek-V2/V3). An
adapter maps its model's projections onto the rows below and calls this module for everything
else; nothing here knows a model class or imports transformers.

- ``Runtime``: one install's eviction (an ``EvictionConfig``, checked when it was made, the model's
  ``Geometry``, the scorer and the press's scorer): ``make_cache`` (the factory: options -> an
  ``MlaLatentCache`` or ``MlaCache``, one per device and dtype behind ``LayerGroups``),
  ``run_columns`` (one forward's columns through a layer: the press, or the chunked update,
  recall, attend and evict), ``stats`` and ``memory``.
- ``Latent`` / ``Expanded``: a forward's rows in either layout (q parts and latent or per-head rows).
- ``attend_chunk`` (update, recall, attend: one chunk) and ``press_prompt`` (the press's math).
- ``left_padding_counts`` (a chunk's 2-D mask -> per-row counts), ``chunk_counts``.
- ``Patches`` (what an install set on a model, and its removal), ``Uncopyable``, ``press_scorer``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import _kvevict as _k
from .config import EvictionConfig, ScorerLike, make_scorer

__all__ = ["Expanded", "Geometry", "LayerGroups", "Latent", "MemoryReport", "Patches", "Runtime", "Uncopyable",
           "attend_chunk", "chunk_counts", "left_padding_counts", "press_prompt", "press_scorer"]


# ---- installed state ----------------------------------------------------------------------------------
class Uncopyable:
    """Installed state that deep copies and pickles must not take (it holds a C++ cache): both
    raise TypeError(``_copy_refusal``), which each installer words for its own handle."""

    _copy_refusal = "kvevict: a model with eviction installed cannot be deep-copied or pickled; remove() it first"

    def _refuse(self, *args):
        raise TypeError(self._copy_refusal)

    __deepcopy__ = _refuse
    __reduce__ = _refuse
    __reduce_ex__ = _refuse


# ---- the model's dimensions -------------------------------------------------------------------------
@dataclasses.dataclass
class Geometry:
    """An MLA model's dimensions, as its adapter reads them, and where layer 0 computes."""

    num_layers: int
    num_heads: int  # this rank's heads (all of them without tensor parallelism)
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    total_heads: int = 0  # every rank's heads (the scores' divisor); num_heads without tensor parallelism
    tp: Optional[Any] = None  # tensor parallelism: an object whose reduce(layer, sums) sums over the ranks; or None


# ---- one forward's rows ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Latent:
    """One forward's rows for an ``MlaLatentCache`` (absorbed attention, DeepSeek-V2 Sec. 2.1.2):
    q_a [B, H, T, r] (q_nope @ W_UK), q_b [B, H, T, rope] (q_pe, RoPE applied), ckv [B, T, r]
    (c_kv, normed) and kpe [B, T, rope] (k_pe, RoPE applied); the cache's dtype and device."""

    q_a: torch.Tensor
    q_b: torch.Tensor
    ckv: torch.Tensor
    kpe: torch.Tensor

    @property
    def columns(self) -> int:
        return self.ckv.size(1)

    @property
    def out_dim(self) -> int:
        """The attention output's last dimension (r: W_UV is the adapter's)."""
        return self.ckv.size(-1)

    def cols(self, s: int, e: int) -> "Latent":
        """Columns [s, e) (views)."""
        return Latent(self.q_a[:, :, s:e], self.q_b[:, :, s:e], self.ckv[:, s:e], self.kpe[:, s:e])


@dataclasses.dataclass
class Expanded:
    """One forward's rows for an ``MlaCache``: q [B, H, T, qk] (RoPE applied), k [B, H, T, qk]
    (the per-head keys, RoPE applied) and v [B, H, T, v]; the cache's dtype and device."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def columns(self) -> int:
        return self.k.size(2)

    @property
    def out_dim(self) -> int:
        return self.v.size(-1)

    def cols(self, s: int, e: int) -> "Expanded":
        return Expanded(self.q[:, :, s:e], self.k[:, :, s:e], self.v[:, :, s:e])


Rows = Union[Latent, Expanded]


# ---- the loop ---------------------------------------------------------------------------------------------
def chunk_counts(T: int, counts: Optional[List[int]], s: int, e: int) -> Optional[List[int]]:
    """Real tokens of each row in columns [s, e) of a left-padded chunk of T columns."""
    if counts is None:
        return None
    return [max(0, e - max(s, T - c)) for c in counts]


def attend_chunk(kv, layer: int, rows: Rows, scale: float, counts: Optional[List[int]] = None, observe: bool = True,
                 recall_tokens: int = 0, recall_rescore: int = 0) -> torch.Tensor:
    """`rows` appended to `layer` of `kv` (``update``, with `counts`: row b's tokens are its last
    counts[b] columns; None: every column), up to `recall_tokens` evicted tokens per row recalled
    from the tier (``recall`` / ``recall_absorbed`` with `recall_rescore`; 0: no recall), then
    attended (``attend_absorbed`` / ``attend``, which feed the scorer unless `observe` is False).
    Does not evict. Returns [B, H, T, r] (latent, before W_UV) or [B, H, T, v]."""
    if isinstance(rows, Latent):
        kv.update(layer, rows.ckv, rows.kpe, counts)
        q_a, q_b = rows.q_a.contiguous(), rows.q_b.contiguous()
        if recall_tokens:
            kv.recall_absorbed(layer, q_a, q_b, scale, recall_tokens, recall_rescore)
        return _k.attend_absorbed(q_a, q_b, kv, layer, scale, observe=observe)
    kv.update(layer, rows.k, rows.v, counts)
    q = rows.q.contiguous()
    if recall_tokens:
        kv.recall(layer, q, scale, recall_tokens, recall_rescore)
    return _k.attend(q, kv, layer, scale, observe=observe)


def press_prompt(kv, layer: int, rows: Rows, scale: float) -> torch.Tensor:
    """The press: full causal attention over a whole prompt `rows` (unpadded), and `layer` of the
    empty `kv` filled by one-shot compression from the prompt's LSE (``compress_prompt`` /
    ``compress_prompt_absorbed`` under the cache's scorer: SnapKV, Li et al. 2024, Sec. 4, or
    H2O). The logits are computed in at least fp32. Returns [B, H, T, r] or [B, H, T, v]."""
    if isinstance(rows, Latent):
        logits = (torch.matmul(rows.q_a, rows.ckv.unsqueeze(1).transpose(-2, -1)) +
                  torch.matmul(rows.q_b, rows.kpe.unsqueeze(1).transpose(-2, -1)))
    else:
        logits = torch.matmul(rows.q, rows.k.transpose(-2, -1))
    T = rows.columns
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=logits.device).triu(1)
    logits = logits.masked_fill(causal, -math.inf)
    lse = torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1)
    if isinstance(rows, Latent):
        _k.compress_prompt_absorbed(kv, layer, rows.q_a.contiguous(), rows.q_b.contiguous(), rows.ckv.contiguous(),
                                    rows.kpe.contiguous(), lse, scale)
        return torch.matmul(p.to(rows.ckv.dtype), rows.ckv.unsqueeze(1))
    _k.compress_prompt(kv, layer, rows.q.contiguous(), rows.k.contiguous(), rows.v.contiguous(), lse, scale)
    return torch.matmul(p.to(rows.v.dtype), rows.v)


def press_scorer(window: int, kernel: int, scorer: Optional[ScorerLike], n_recent: int):
    """The press's scorer: ``SnapKV(window, kernel)`` for None or "snapkv", else `scorer` (a name
    or a scorer object). A SnapKV window longer than `n_recent` warns (UserWarning, at the line
    of the ``with`` around an adapter's ``press()``): the window's queries then vote for tokens
    the recent window does not protect (measured on the shipped model's passkey at a 10% budget:
    8/32 answer tokens with window 64 > n_recent 37, 24/32 with window 32)."""
    if scorer is None or (isinstance(scorer, str) and scorer.lower() == "snapkv"):
        compress = _k.SnapKV(window, kernel)  # the name "snapkv" takes window and kernel too
    else:
        compress = make_scorer(scorer)
    if isinstance(compress, _k.SnapKV) and compress.window > n_recent:
        # 1 here, 2 the adapter's press() generator, 3 contextlib's __enter__, 4 the caller's with
        warnings.warn(f"kvevict: press: the SnapKV window ({compress.window}) is longer than n_recent ({n_recent}): "
                      "the window's queries vote for tokens the recent window does not protect, which loses answers; "
                      "use window <= n_recent", UserWarning, stacklevel=4)
    return compress


# ---- the mask -------------------------------------------------------------------------------------------------
def left_padding_counts(mask: Optional[torch.Tensor], B: int, T: int, where: str,
                        hint: str = "") -> Optional[List[int]]:
    """Real tokens per row from a chunk's 2-D 0/1 attention mask [B, T] whose ones are each row's
    last columns (left padding); None when every column is real (or `mask` is None). Raises
    ValueError naming `where` on another shape, a value other than 0 and 1, or a hole / right
    padding (naming the row; `hint` ends that message)."""
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (B, T):
        raise ValueError(f"kvevict: {where}: attention_mask must be [B, T] = [{B}, {T}], got {list(mask.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"kvevict: {where}: attention_mask must hold only 0 (pad) and 1 (token)")
    m = mask.to(torch.bool)
    counts = m.sum(1)
    cols = torch.arange(T, device=m.device).unsqueeze(0)
    bad = (m != (cols >= (T - counts).unsqueeze(1))).any(1)
    if bool(bad.any()):
        raise ValueError(f"kvevict: {where}: attention_mask must be left padding: in the new {T} columns, row "
                         f"{int(bad.nonzero()[0, 0])} has a masked column after a real token; kvevict appends each "
                         "row's real tokens as the chunk's last columns, pads only before them (pad on the left, "
                         "tokenizer.padding_side = 'left')" + hint)
    counts = [int(c) for c in counts.tolist()]
    return None if all(c == T for c in counts) else counts


# ---- caches -----------------------------------------------------------------------------------------------------
class _SummedStats:
    """``CacheStats`` summed over a LayerGroups' caches (the same fields)."""

    _FIELDS = ("eviction_events", "tokens_evicted", "bytes_allocated", "tier_tokens", "tier_bytes",
               "tier_device_bytes", "tier_recalled")

    def __init__(self, stats):
        for f in self._FIELDS:
            setattr(self, f, sum(getattr(s, f) for s in stats))

    def __repr__(self) -> str:
        return "CacheStats(" + ", ".join(f"{f}={getattr(self, f)}" for f in self._FIELDS) + ")"


class LayerGroups:
    """The kvevict caches of a model whose attention layers differ in device or dtype (a model split
    over GPUs with ``device_map``, a layer kept in another dtype): one ``MlaLatentCache`` (or
    ``MlaCache``) per device and dtype, each holding its layers in order, on that device, in that
    dtype. ``KVEvictCache.kv`` is one of these for such a model; a model on one device and dtype
    gets the kvevict cache itself.

    Reads and writes take the model's layer index, as a single cache's do: ``size(layer, row)``,
    ``positions(layer)``, ``ckv(layer)``, ``seen_tokens(layer, row)``, ... go to the cache holding
    that layer; ``stats()`` sums over the caches (``stats(layer)``: that layer's); ``truncate``,
    ``reset``, ``reserve``, ``finish`` and ``add_sequence`` act on every cache; ``batch_size`` and
    ``active(row)`` are the same in all. ``layer(l)`` gives (the cache, l's index in it);
    ``groups()`` gives [(cache, [model layers])]."""

    #: methods whose first argument is a layer (those of MlaLatentCache and MlaCache)
    _PER_LAYER = frozenset(("update", "ckv", "kpe", "keys", "values", "ordered", "recall", "recall_absorbed",
                            "eviction", "size", "seen_tokens", "slots", "positions", "scores", "query_positions",
                            "observe", "add_scores", "flush", "observe_begin", "observe_add", "observe_end",
                            "observe_discard", "due", "evict", "evict_now", "tier_size", "tier_positions",
                            "tier_scores", "tier_rows"))

    def __init__(self, caches: List[Any], layers: List[List[int]]):
        self.caches = caches
        self._layers = layers
        self._where = {l: (i, j) for i, ls in enumerate(layers) for j, l in enumerate(ls)}

    def layer(self, layer: int) -> Tuple[Any, int]:
        """(the kvevict cache holding the model's `layer`, the layer's index in it)."""
        if layer not in self._where:
            raise IndexError(f"kvevict: layer must be in [0, {len(self._where)}), got {layer!r}")
        i, j = self._where[layer]
        return self.caches[i], j

    def groups(self) -> List[Tuple[Any, List[int]]]:
        return list(zip(self.caches, self._layers))

    @property
    def batch_size(self) -> int:
        return self.caches[0].batch_size

    def active(self, row: int) -> bool:
        return self.caches[0].active(row)

    def capacity(self, layer: Optional[int] = None) -> int:
        if layer is None:
            return max(c.capacity() for c in self.caches)
        c, j = self.layer(layer)
        return c.capacity(j)

    def stats(self, layer: Optional[int] = None):
        if layer is not None:
            c, j = self.layer(layer)
            return c.stats(j)
        return _SummedStats([c.stats() for c in self.caches])

    def truncate(self, row: int, k: int) -> None:
        for c in self.caches:
            c.truncate(row, k)

    def reset(self, row: Optional[int] = None) -> None:
        for c in self.caches:
            c.reset() if row is None else c.reset(row)

    def reserve(self, tokens: int) -> None:
        for c in self.caches:
            c.reserve(tokens)

    def finish(self, row: int) -> None:
        for c in self.caches:
            c.finish(row)

    def add_sequence(self) -> int:
        rows = [c.add_sequence() for c in self.caches]
        return rows[0]

    def __getattr__(self, name: str):
        if name in LayerGroups._PER_LAYER:
            def per_layer(layer, *args, **kwargs):
                c, j = self.layer(layer)
                return getattr(c, name)(j, *args, **kwargs)
            per_layer.__name__ = name
            return per_layer
        raise AttributeError(f"kvevict: LayerGroups has no {name!r}: the layers' caches differ in device or dtype; "
                             "read one through .caches or .layer(l)")

    def __repr__(self) -> str:
        return "LayerGroups(" + ", ".join(f"{c.device} {str(c.dtype).replace('torch.', '')}: layers {ls}"
                                          for c, ls in self.groups()) + ")"


@dataclasses.dataclass
class MemoryReport:
    """Bytes, all layers, all rows. ``cache_bytes``: the kvevict cache's device buffers now
    (slots for capacity + evict_every per row and layer, the trash slot included).
    ``full_cache_bytes``: what a full cache of ``full_layout`` would hold for the same
    ``columns`` (``kvevict.hf``: transformers' own ``DynamicCache`` in this transformers version's
    layout, pads included, as it stores them; ``kvevict.install``: the installed layout, for the
    longest row's tokens). ``tier_bytes``: host memory of the tier (rows and digests)."""

    cache_bytes: int
    full_cache_bytes: int
    full_layout: str
    tier_bytes: int
    columns: int

    @property
    def ratio(self) -> float:
        """full_cache_bytes / cache_bytes."""
        return self.full_cache_bytes / self.cache_bytes if self.cache_bytes else float("inf")


class Runtime(Uncopyable):
    """One install's eviction, what both adapters hold: ``config`` (an ``EvictionConfig``, checked
    and its ``EvictionOptions`` built when it was made), the model's ``geometry``, ``scorer`` (the
    caches' scorer: the press's when there is one, else the config's) and ``press`` (the press's
    scorer, or None). Raises ValueError when ``layer_budgets`` does not give one budget per layer.
    Not copied or pickled (TypeError: it holds C++ objects)."""

    def __init__(self, config: EvictionConfig, geometry: Geometry, press: Optional[Any] = None):
        if config.layer_budgets is not None and len(config.layer_budgets) != geometry.num_layers:
            raise ValueError(f"kvevict: layer_budgets must have one budget per layer ({geometry.num_layers}), "
                             f"got {len(config.layer_budgets)}")
        self.config = config
        self.geometry = geometry
        self.press = press
        self.scorer = press if press is not None else make_scorer(config.scorer)

    @property
    def latent(self) -> bool:
        return self.config.layout == "latent"

    # -- the cache factory -------------------------------------------------------------------------
    def make_cache(self, batch: int, placements: Optional[List[Tuple[torch.device, torch.dtype]]] = None):
        """The kvevict cache of a new sequence of `batch` rows: layer l on placements[l] (device,
        dtype; default: every layer on the geometry's). One ``MlaLatentCache`` (or ``MlaCache``)
        when all layers agree, else one per (device, dtype), each holding its layers in order,
        behind a ``LayerGroups``. The geometry's device and dtype become layer 0's."""
        g = self.geometry
        if placements is None:
            placements = [(g.device, g.dtype)] * g.num_layers
        keys = list(dict.fromkeys(placements))
        layers = [[l for l, p in enumerate(placements) if p == k] for k in keys]
        self.geometry = dataclasses.replace(g, device=placements[0][0], dtype=placements[0][1])
        caches = [self._make_one(batch, ls, *k) for ls, k in zip(layers, keys)]
        return caches[0] if len(caches) == 1 else LayerGroups(caches, layers)

    def _make_one(self, batch: int, layers: List[int], device: torch.device, dtype: torch.dtype):
        """A kvevict cache for the model's `layers` (ascending), on `device` in `dtype`."""
        cfg, g = self.config, self.geometry
        budgets = [cfg.layer_budgets[l] for l in layers] if cfg.layer_budgets else []
        common = dict(batch_size=batch, dtype=dtype, device=device, layer_budgets=budgets,
                      tier_tokens=cfg.tier_tokens, tier_page_size=cfg.tier_page_size,
                      tier_scoring=_k.TierScoring.kHeadMean if cfg.tier_scoring == "head_mean" else
                      _k.TierScoring.kPerHead)
        if self.latent:
            opts = _k.MlaLatentCacheOptions(len(layers), g.num_heads, kv_lora_rank=g.kv_lora_rank,
                                            qk_rope_dim=g.qk_rope_dim, qk_nope_dim=g.qk_nope_dim, **common)
        else:
            opts = _k.MlaCacheOptions(len(layers), g.num_heads, qk_dim=g.qk_nope_dim + g.qk_rope_dim, v_dim=g.v_dim,
                                      **common)
        if g.tp is not None:  # this rank's heads; scores summed over the ranks, averaged over every head
            opts.total_heads = g.total_heads
            opts.reduce_contributions = g.tp.reduce
        return (_k.MlaLatentCache if self.latent else _k.MlaCache)(opts, self.config.eviction_options, self.scorer)

    # -- the loop ------------------------------------------------------------------------------------
    def run_columns(self, kv, layer: int, rows: Rows, scale: float, counts: Optional[List[int]] = None,
                    where: str = "install()") -> torch.Tensor:
        """Runs one forward's T columns (`rows`, either layout) through `layer` of `kv` and returns
        the attention output [B, H, T, r] (latent, before W_UV) or [B, H, T, v]; columns that are
        padding in every row give zeros. counts: left padding, row b's real tokens are its last
        counts[b] columns (None: every column).

        With the press, the first forward of a layer (more than one real column, no padding:
        otherwise ValueError naming `where`, the adapter's install call) is attended in full and
        the layer compressed once (``press_prompt``). Otherwise the columns go in chunks of
        ``prefill_chunk`` (0: one chunk), each appended, recalled from the tier (``recall_tokens``
        with a tier), attended and evicted (``attend_chunk``, then ``evict``)."""
        cfg = self.config
        T = rows.columns
        lead = T - max(counts) if counts is not None else 0  # leading columns that are pads in every row
        n = T - lead
        if self.press is not None and n > 1 and kv.seen_tokens(layer) == 0:
            if counts is not None:
                raise ValueError("kvevict: the press compresses unpadded prompts: this batch has left padding (real "
                                 f"tokens per row {counts}); run the rows one by one, or {where} without the press")
            return press_prompt(kv, layer, rows, scale)
        body = rows.cols(lead, T) if lead else rows
        chunk = cfg.prefill_chunk if cfg.prefill_chunk and n > cfg.prefill_chunk else n
        recall = cfg.recall_tokens if cfg.tier_tokens else 0
        q = rows.q_a if isinstance(rows, Latent) else rows.q
        outs = [q.new_zeros(q.size(0), q.size(1), lead, rows.out_dim)] if lead else []
        for s in range(0, n, max(chunk, 1)):
            e = min(n, s + chunk)
            outs.append(attend_chunk(kv, layer, body.cols(s, e), scale, chunk_counts(n, counts, s, e), cfg.observe,
                                     recall, cfg.recall_rescore))
            kv.evict(layer)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    def run_drafts(self, kv, layer: int, rows: Rows, scale: float) -> torch.Tensor:
        """Speculative decoding's drafts (`rows`, one unpadded row) through `layer`, each alone after
        the ones before it, as greedy decoding runs them, on a saved copy of the layer
        (``save_layer``), which is then restored (``restore_layer``), also when a step raises: returns
        their attention output; the layer is as it was. ``replay`` runs the accepted ones again."""
        saved = kv.save_layer(layer)
        try:
            return self.replay(kv, layer, rows, scale, rows.columns)
        finally:
            kv.restore_layer(layer, saved)

    def replay(self, kv, layer: int, rows: Rows, scale: float, n: int) -> torch.Tensor:
        """The first `n` columns of `rows` through `layer`, one at a time: append, recall (with a
        tier), attend (observing), pass. Returns their attention output."""
        cfg = self.config
        recall = cfg.recall_tokens if cfg.tier_tokens else 0
        outs = []
        for j in range(n):
            outs.append(attend_chunk(kv, layer, rows.cols(j, j + 1), scale, None, cfg.observe, recall, cfg.recall_rescore))
            kv.evict(layer)
        if not outs:
            q = rows.q_a if isinstance(rows, Latent) else rows.q
            return q.new_zeros(q.size(0), q.size(1), 0, rows.out_dim)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 2)

    # -- reading -------------------------------------------------------------------------------------
    def stats(self, kv) -> Dict[str, Any]:
        """kept (per layer: the longest row's cached tokens), capacity (per row and layer), and,
        summed over layers and rows, eviction_events, tokens_evicted, tier_tokens, tier_recalled."""
        n, s = self.geometry.num_layers, kv.stats()
        return {"kept": [kv.size(l) for l in range(n)], "capacity": [kv.capacity(l) for l in range(n)],
                "eviction_events": s.eviction_events, "tokens_evicted": s.tokens_evicted,
                "tier_tokens": s.tier_tokens, "tier_recalled": s.tier_recalled}

    def memory(self, kv, columns: int, full_layout: str) -> MemoryReport:
        """`kv`'s bytes now (buffers, and the tier's host memory) against a full cache of
        `full_layout` ("latent" or "expanded") holding `columns` tokens per row, all rows, each
        layer in its own cache's dtype."""
        g, s = self.geometry, kv.stats()
        lay = _k.Layout.kLatent if full_layout == "latent" else _k.Layout.kExpanded
        groups = kv.groups() if isinstance(kv, LayerGroups) else [(kv, list(range(g.num_layers)))]
        full = 0
        for cache, layers in groups:
            cfg = _k.MlaMemoryConfig(num_layers=len(layers), num_heads=g.num_heads,
                                     qk_dim=g.qk_nope_dim + g.qk_rope_dim, v_dim=g.v_dim, kv_lora_rank=g.kv_lora_rank,
                                     qk_rope_dim=g.qk_rope_dim, bytes_per_element=torch.finfo(cache.dtype).bits // 8)
            full += _k.full_cache_bytes(cfg, lay, columns) * kv.batch_size
        return MemoryReport(cache_bytes=s.bytes_allocated, full_cache_bytes=full, full_layout=full_layout,
                            tier_bytes=s.tier_bytes, columns=columns)


# ---- installing and removing ---------------------------------------------------------------------------
_NONE = object()  # an attribute the instance did not have


class Patches:
    """What an install set on a model and its modules, and its removal: instance attributes
    (``set``: an attention module's ``forward``, the model's generation methods, the handle's
    mark) and hooks (``hook``). ``remove()`` removes the hooks and puts every attribute back as
    the instance had it (deleting it where the instance had none), newest first; idempotent."""

    def __init__(self):
        self._saved: List[Tuple[Any, str, Any]] = []  # (object, name, the instance's value or _NONE)
        self._hooks: List[Any] = []

    def __bool__(self) -> bool:
        return bool(self._saved or self._hooks)

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _NONE)))
        obj.__dict__[name] = value

    def hook(self, handle: Any) -> None:
        self._hooks.append(handle)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        for obj, name, old in reversed(self._saved):
            if old is _NONE:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old
        self._saved, self._hooks = [], []
