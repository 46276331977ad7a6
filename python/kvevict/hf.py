"""kvevict inside Hugging Face transformers' DeepSeek-V2/V3 models: one call, then ``generate()``.

    from kvevict.hf import install_kv_eviction
    handle = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    handle.positions(layer=0)   # [B, S] kept positions, ascending, -1 past a row's length
    handle.memory()             # cache bytes now against what transformers' own cache would hold
    handle.remove()             # the model is as it was

What ``install_kv_eviction`` does, and nothing else:

- Each DeepSeek attention module (``DeepseekV3Attention``, ``DeepseekV2Attention`` or a
  subclass) gets an instance-level ``forward``: with a ``KVEvictCache`` it projects q and the
  latent (c_kv after ``kv_a_layernorm``, k_pe after RoPE) with the module's own layers and
  RoPE, appends the latent to a kvevict cache, attends through ``kvevict.attend_absorbed``
  (W_UK folded into the query, W_UV applied after; DeepSeek-V2, Sec. 2.1.2; nothing is
  re-expanded through ``kv_b_proj``), feeds that attention to the scorer and evicts. With any
  other cache (or none) it runs the module's own forward: silently when the caller passed no
  cache, with a ``KVEvictWarning`` at every forward (or ``generate()``) that passed one. Parameters, buffers and
  ``state_dict()`` keys are untouched.
- ``generate()`` gets a fresh ``KVEvictCache`` where it would have made a ``DynamicCache``. A
  cache returned by ``generate()`` (``return_dict_in_generate=True``) continues a
  conversation when passed back as ``past_key_values``.
- Continuous batching (``generate_batch``, ``init_continuous_batching``,
  ``continuous_batching_context_manager``) is refused on the installed model before any work: it
  runs through transformers' own ``PagedAttentionCache``, which kvevict does not evict from.
- A model loaded with transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``
  under ``torchrun``): each rank's cache holds the heads its sharded ``kv_b_proj`` holds (read
  from the weights, not the config) and its scores are summed over the weights' process group
  (``torch.distributed.all_reduce``, one per layer and forward) before they are applied, so every
  rank keeps the same tokens. ``install_kv_eviction`` is then a collective: every rank calls it
  with the same settings (checked).
- A forward pre-hook on the decoder reads the 2-D ``attention_mask`` once per forward: each
  row's real tokens must be the last columns of the chunk (left padding); they become the
  per-row counts kvevict appends, so pads are never stored, scored or attended.

Positions come from transformers (``position_ids`` from the mask, i.e. tokens seen, not
tokens kept): ``get_seq_length()`` is the number of columns the cache has taken in.

The cache factory, the chunk loop (``Runtime.run_columns``: the press, or update, recall,
attend and evict per chunk), the mask parsing, stats, memory and removal are the runtime's
(``_runtime.py``), shared with ``kvevict.install``; this module maps transformers onto them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

try:
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError as e:  # pragma: no cover - the [hf] extra
    raise ImportError("kvevict.hf needs transformers: pip install 'kvevict[hf]'") from e

from ._runtime import (Expanded, Geometry, Latent, LayerGroups, MemoryReport, Patches, Runtime, Uncopyable,
                       left_padding_counts, press_scorer)
from .config import EvictionConfig, ScorerLike

__all__ = ["EvictionConfig", "KVEvictCache", "KVEviction", "KVEvictWarning", "LayerGroups", "MemoryReport",
           "install_kv_eviction",
           "reset_eviction_scores", "press"]

#: transformers >= 5.15: ``crop(n)`` takes a negative count of tokens to drop (before: a length to
#: keep), and DeepSeek attention caches the compressed latent (c_kv, k_pe) instead of the expanded
#: per-head keys and values. One release changed both; ``memory()`` reads the layout from this too.
_CROP_COUNTS = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters


class KVEvictWarning(UserWarning):
    """A call on an installed model that runs without eviction (a cache kvevict did not make,
    ``use_cache=False`` in ``generate()``) or without what it asked for (``output_attentions``).
    Said at every such call: one warning per forward, or per ``generate()`` for all its forwards.
    An ``"always"`` filter for this category is appended to the warning filters at import, so that
    Python's default filter does not show it once per line only; any filter of yours comes first
    (``warnings.filterwarnings("ignore", category=KVEvictWarning)`` silences it)."""


warnings.filterwarnings("always", category=KVEvictWarning, append=True)

#: Frames in these folders are the machinery between the user's call and a warning.
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["transformers"])) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _warn(message: str) -> None:
    """A ``KVEvictWarning`` pointing at the user's line: the first frame outside torch, transformers and kvevict."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, KVEvictWarning, stacklevel=level + 1)


try:
    from transformers.generation.utils import GenerationMixin as _GenerationMixin
    _GENERATE_CODE = inspect.unwrap(_GenerationMixin.generate).__code__
except (ImportError, AttributeError):  # pragma: no cover
    _GENERATE_CODE = None


def _in_generate() -> bool:
    """Whether transformers' ``generate()`` is on this thread's stack (it warns once for all its forwards).
    Read only on the way to a warning, never on the steady path."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _GENERATE_CODE:
            return True
        frame = frame.f_back
    return False


def _deepseek_attention_classes() -> Dict[type, str]:
    """{attention class: "v2" | "v3"} for the DeepSeek attention classes this transformers has."""
    found = {}
    for name, family in (("deepseek_v3", "v3"), ("deepseek_v2", "v2")):
        try:
            mod = __import__(f"transformers.models.{name}.modeling_{name}", fromlist=["x"])
        except ImportError:
            continue
        cls = getattr(mod, f"Deepseek{family.upper()}Attention", None)
        if cls is not None:
            found[cls] = family
    return found


def _family(module: nn.Module) -> Optional[Tuple[str, Any]]:
    """("v2" | "v3", the modeling module of its DeepSeek base class) or None."""
    for cls, family in _deepseek_attention_classes().items():
        if isinstance(module, cls):
            return family, sys.modules[cls.__module__]
    return None


# ---- the model's geometry ---------------------------------------------------------------------------
@dataclasses.dataclass
class _TensorParallel:
    """transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")``), as read from the
    attention's sharded weights: the process group of their device mesh, this rank and the group's size."""
    group: Any
    rank: int
    size: int

    def reduce(self, layer: int, sums: torch.Tensor) -> None:
        """The kvevict caches' ``reduce_contributions``: sums this rank's head sums (fixed point, fp64) with
        the other ranks' in place, so that every rank applies the scores of every head."""
        torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=self.group)


def _check_attention(module: nn.Module, layer: int) -> None:
    missing = [n for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj") if not hasattr(module, n)]
    if missing or not isinstance(getattr(module, "kv_b_proj", None), nn.Linear):
        raise ValueError(f"kvevict: layer {layer}'s {type(module).__name__} lacks DeepSeek MLA's "
                         f"{missing or ['kv_b_proj as nn.Linear']}: not supported")


# ---- the transformers Cache -------------------------------------------------------------------------
class KVEvictCache(Cache):
    """A ``transformers.Cache`` whose rows live in a kvevict cache (``MlaLatentCache`` or
    ``MlaCache``, built at the first forward with that forward's batch size, each layer on its
    attention's device and in its dtype: one kvevict cache per device and dtype, behind a
    ``LayerGroups`` when the layers differ).

    Protocol, as ``generate()`` uses it:
    - ``get_seq_length()``: columns taken in so far (pads included, as ``DynamicCache``);
      positions continue from there, not from the tokens kept.
    - ``get_mask_sizes()``: the columns' mask size, as ``DynamicCache`` (the installed attention
      does not read transformers' mask: it masks by kvevict's per-row positions).
    - ``crop(n)``: drops the newest columns. After a verify forward of assisted, prompt-lookup or
      speculative decoding, the drafts were run one by one on a saved copy of each layer and the
      layer restored: crop then runs the accepted drafts again, so the cache is greedy's, exactly
      (scores and evictions included). Other columns: each row's ``truncate`` by the real tokens
      among them, which raises, changing nothing, when one of them was already evicted.
    - ``reorder_cache``, ``batch_repeat_interleave``, ``batch_select_indices``: beams and batch
      surgery are not supported; they raise ``NotImplementedError``.
    - ``update()``: not used by the installed attention; raises.
    """

    def __init__(self, handle: "KVEviction"):
        super().__init__(layers=[])
        self._handle = handle
        self._kv = None  # the kvevict cache
        self._columns = 0
        self._chunks: List[Tuple[int, Optional[List[int]]]] = []  # per forward: (T, counts or None)
        self._real: List[int] = []  # real tokens taken in per row (pads excluded)
        self._step: Optional[Tuple[int, Optional[List[int]]]] = None  # the forward in progress
        self._layers_done = 0
        self._broken: Optional[str] = None
        self._verify = 0  # the forward in progress: its last columns that are drafts (speculative decoding)
        self._drafts: Dict[int, Tuple[Any, ...]] = {}  # per layer: what runs an accepted draft again
        self._drafts_k = 0  # drafts of the latest verify forward not yet settled by crop()
        self._thread = None  # the thread that ran the latest forward: the one a read may settle drafts on

    # -- what transformers asks -------------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:  # noqa: D401 - transformers' property
        return False

    @property
    def is_initialized(self) -> bool:
        return self._kv is not None

    @property
    def is_sliding(self) -> List[bool]:
        return [False] * self._handle.geometry.num_layers

    @property
    def is_linear(self) -> List[bool]:
        return [False] * self._handle.geometry.num_layers

    @property
    def max_batch_size(self) -> int:
        return self._kv.batch_size if self._kv is not None else 0

    @property
    def max_cache_len(self) -> int:
        return -1

    def __len__(self) -> int:
        return self._handle.geometry.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> Tuple[int, int]:
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self._columns + q, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise RuntimeError(f"kvevict: KVEvictCache.update() was called for layer {layer_idx}: this cache is driven by "
                           "the attention install_kv_eviction() installs, and the module calling update() is not "
                           "one of the model's installed DeepSeek attention modules")

    def reset(self) -> None:
        """Empties the cache: the next forward starts a new sequence at position 0."""
        if self._kv is not None:
            self._kv.reset()
        self._columns = 0
        self._chunks = []
        self._real = [0] * len(self._real)
        self._step = None
        self._layers_done = 0
        self._broken = None
        self._verify = 0
        self._drafts, self._drafts_k = {}, 0

    def crop(self, n: int) -> None:
        """Drops the newest columns: ``crop(-k)`` drops k; ``crop(m)`` with m >= 0 keeps the first m
        (transformers < 5.15; from 5.15 ``crop(0)`` drops nothing and a positive n raises, as ``DynamicCache``)."""
        n = int(n)
        if n < 0:
            drop = min(-n, self._columns)
        elif _CROP_COUNTS:
            if n > 0:
                raise ValueError(f"kvevict: crop({n}): this transformers crops with a negative count of tokens to "
                                 "drop (crop(-k)), as DynamicCache; a positive value is refused")
            drop = 0
        else:
            drop = max(0, self._columns - n)
        if self._drafts_k:  # a verify forward's drafts: the rejected ones are the newest columns
            d = min(drop, self._drafts_k)
            self._settle(self._drafts_k - d)
            self._forget(d, *self._plan_drop(d))
            drop -= d
        if drop == 0 or self._kv is None:
            return
        per_row, cut, partial = self._plan_drop(drop)
        B = self._kv.batch_size
        # Each row's truncate checks its own row and changes nothing when it raises; check every
        # row first, so that a row that cannot roll back leaves the rows before it unchanged too.
        for r in range(B):
            if per_row[r] == 0 or not self._kv.active(r):
                continue
            for layer in range(self._handle.geometry.num_layers):
                seen = self._kv.seen_tokens(layer, r)
                held = set(self._kv.positions(layer)[r].tolist())
                if self._handle.config.tier_tokens:
                    held.update(self._kv.tier_positions(layer, r).tolist())
                lost = [p for p in range(seen - per_row[r], seen) if p not in held]
                if lost:
                    raise RuntimeError(f"kvevict: crop({n}) would roll back row {r}'s positions {seen - per_row[r]}.."
                                       f"{seen - 1}, but layer {layer} already evicted {lost[:8]}: only the drafts of "
                                       "the latest assisted/speculative verify forward can be cropped past the recent "
                                       "window. The cache is unchanged")
        for r in range(B):
            if per_row[r] > 0 and self._kv.active(r):
                self._kv.truncate(r, per_row[r])  # all layers
        self._forget(drop, per_row, cut, partial)

    def _plan_drop(self, drop: int):
        """(real tokens per row among the newest `drop` columns, the first chunk touched, what is left
        of a chunk cut half-way or None)."""
        B = len(self._real)
        per_row = [0] * B
        left = drop
        cut = len(self._chunks)
        partial = None
        for i in range(len(self._chunks) - 1, -1, -1):
            if left == 0:
                break
            T, counts = self._chunks[i]
            m = min(left, T)
            for r in range(B):
                c = T if counts is None else counts[r]
                per_row[r] += min(m, c)  # a row's real tokens are the chunk's last columns
            left -= m
            if m == T:
                cut = i
            else:
                partial = (i, T - m, None if counts is None else [max(0, c - m) for c in counts])
                cut = i
        return per_row, cut, partial

    def _forget(self, drop: int, per_row: List[int], cut: int, partial) -> None:
        """The newest `drop` columns leave the bookkeeping (_plan_drop()'s plan)."""
        if drop == 0:
            return
        self._real = [n - k for n, k in zip(self._real, per_row)]
        del self._chunks[cut:]
        if partial is not None:
            self._chunks.append((partial[1], partial[2]))
        self._columns -= drop

    def _settle(self, accepted: int) -> None:
        """The latest verify forward's first `accepted` drafts run again on each restored layer: the
        layer is then as if greedy decoding had run them, one by one."""
        drafts, self._drafts, self._drafts_k = self._drafts, {}, 0
        try:
            for kv, lk, scale, rows in drafts.values():
                self._handle._runtime.replay(kv, lk, rows, scale, accepted)
        except BaseException as e:
            self._broken = f"running the accepted drafts again failed ({type(e).__name__}: {e})"
            raise

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvevict: beam search is not supported with eviction installed "
                                  "(each row keeps its own tokens); use num_beams=1")

    def batch_repeat_interleave(self, repeats: int):
        if self._kv is None:
            return  # nothing stored yet: the first forward builds the cache at the expanded batch
        raise NotImplementedError("kvevict: expanding a non-empty KVEvictCache (num_return_sequences > 1 or beams "
                                  "when continuing) is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("kvevict: selecting batch rows of a KVEvictCache is not supported")

    def __repr__(self) -> str:
        if self._kv is None:
            return f"KVEvictCache(layout={self._handle.config.layout}, empty)"
        g = self._handle.geometry
        sizes = [self._kv.size(0, r) for r in range(self._kv.batch_size)]
        tier = self._kv.stats().tier_tokens if self._handle.config.tier_tokens else None
        return (f"KVEvictCache(layers={g.num_layers}, layout={self._handle.config.layout}, batch={self._kv.batch_size}, "
                f"columns={self._columns}, capacity={self._kv.capacity(0)}, kept[layer 0]={sizes}"
                + (f", tier={tier}" if tier is not None else "") + ")")

    # -- kvevict -------------------------------------------------------------------------------
    @property
    def kv(self):
        """The kvevict cache (``MlaLatentCache`` or ``MlaCache``), or None before the first forward. For a
        model whose attention layers differ in device or dtype: a ``LayerGroups`` (one kvevict cache per
        device and dtype, read by the model's layer index).

        Read outside ``generate()`` after a verify forward of assisted decoding that no ``crop()``
        followed (transformers < 5.15 crops only when a draft was rejected), it first runs the drafts
        again, all accepted; inside ``generate()``, or from a thread other than the one that ran the
        forwards, it shows the layers as they were before the drafts (a cache is not thread-safe:
        read it from another thread only between generations)."""
        if self._drafts_k and self._step is None and threading.get_ident() == self._thread and not _in_generate():
            self._settle(self._drafts_k)
        return self._kv

    def _layer(self, layer: int):
        """(the kvevict cache holding the model's `layer`, the layer's index in it)."""
        if isinstance(self._kv, LayerGroups):
            return self._kv.layer(layer)
        return self._kv, layer

    def _begin(self, T: int, batch: int, mask: Optional[torch.Tensor]) -> None:
        """A forward of T columns starts (the decoder's pre-hook)."""
        if self._step is not None:  # the previous forward raised half-way: layers disagree now
            self._broken = (f"a forward stopped after {self._layers_done} of {self._handle.geometry.num_layers} "
                            "attention layers")
        if self._broken:
            raise RuntimeError(f"kvevict: this KVEvictCache is unusable: {self._broken}; start a new one "
                               "(generate() without past_key_values, or handle.new_cache())")
        if self._drafts_k:  # no crop() after the latest verify forward: every draft was accepted
            self._settle(self._drafts_k)
        self._thread = threading.get_ident()
        drafts, self._handle._draft_k = self._handle._draft_k, 0
        counts = None
        if mask is not None:
            if mask.dim() != 2:
                raise ValueError(f"kvevict: attention_mask must be 2-D [batch, columns] with eviction installed, "
                                 f"got {list(mask.shape)}")
            if mask.size(0) != batch or mask.size(1) != self._columns + T:
                raise ValueError(f"kvevict: attention_mask must be [batch, past + new columns] = [{batch}, "
                                 f"{self._columns + T}], got {list(mask.shape)}")
            counts = left_padding_counts(mask[:, -T:], batch, T, "forward",
                                         hint=". A pad token inside an unpadded prompt makes transformers infer such "
                                              "a mask: pass attention_mask explicitly")
            if self._columns:
                past = mask[:, : self._columns].to(torch.bool).sum(-1).tolist()
                if past != self._real:
                    r = next(i for i, (a, b) in enumerate(zip(past, self._real)) if a != b)
                    raise ValueError(f"kvevict: attention_mask marks {past[r]} of row {r}'s first {self._columns} "
                                     f"columns as real, but the cache took in {self._real[r]} of them: a mask "
                                     "cannot hide tokens already stored (e.g. pads generated after EOS, masked "
                                     "afterwards); keep the mask of earlier columns as it was")
        if self._kv is None:
            self._kv = self._handle._make_kv(batch)
            self._real = [0] * batch
        elif self._kv.batch_size != batch:
            raise ValueError(f"kvevict: this cache holds batch {self._kv.batch_size}, the forward has batch {batch}")
        self._step = (T, counts)
        self._layers_done = 0
        # A verify forward of speculative decoding (one row, unpadded): its last `drafts` columns
        # run one by one on a saved copy of each layer (see KVEviction._attend).
        self._verify = drafts if 0 < drafts < T and batch == 1 and (counts is None or counts[0] > drafts) else 0

    def _end(self) -> None:
        """The forward finished (the decoder's forward hook)."""
        if self._step is None:
            return
        T, counts = self._step
        if self._layers_done != self._handle.geometry.num_layers:
            self._broken = (f"a forward ran {self._layers_done} of {self._handle.geometry.num_layers} "
                            "attention layers through it")
            raise RuntimeError(f"kvevict: {self._broken}")
        self._chunks.append((T, counts))
        self._columns += T
        self._drafts_k, self._verify = self._verify, 0
        self._real = [n + (T if counts is None else c) for n, c in zip(self._real, counts or [T] * len(self._real))]
        self._step = None


# ---- the installed attention --------------------------------------------------------------------------
def _is_dtensor(w: Any) -> bool:
    """Whether `w` is a DTensor (a weight transformers' tensor parallelism sharded or replicated)."""
    return hasattr(w, "placements") and hasattr(w, "device_mesh") and hasattr(w, "to_local")


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a weight tensor parallelism made a DTensor (``to_local()``, no copy); else `w`."""
    return w.to_local() if _is_dtensor(w) else w


def _absorbed_weights(module: nn.Module, g: Geometry) -> Tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, r] and W_UV [H, v, r] of this rank's H heads: views of kv_b_proj.weight (its local
    shard under tensor parallelism), no copy."""
    w = _local(module.kv_b_proj.weight).view(g.num_heads, g.qk_nope_dim + g.v_dim, g.kv_lora_rank)
    return w[:, : g.qk_nope_dim], w[:, g.qk_nope_dim:]


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, a] @ w [H, a, b] -> [B, H, T, b], heads as the batch of one bmm: the weight
    views are read in place (a broadcasting matmul over B > 1 copies them per row)."""
    B, H, T, a = x.shape
    y = torch.bmm(x.transpose(0, 1).reshape(H, B * T, a), w)
    return y.view(H, B, T, w.size(-1)).transpose(0, 1)


def _project(module: nn.Module, family: str, rope_mod, hidden: torch.Tensor, position_embeddings, g: Geometry):
    """q_nope [B, H, T, nope], q_pe [B, H, T, rope] (RoPE applied), ckv [B, T, r] (normed),
    kpe [B, T, rope] (RoPE applied): the module's own layers, in its own order."""
    B, T = hidden.shape[:2]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden)))
    q = q.view(B, T, -1, g.qk_nope_dim + g.qk_rope_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [g.qk_nope_dim, g.qk_rope_dim], dim=-1)
    ckv, kpe = torch.split(module.kv_a_proj_with_mqa(hidden), [g.kv_lora_rank, g.qk_rope_dim], dim=-1)
    ckv = module.kv_a_layernorm(ckv)
    kpe = kpe.view(B, 1, T, g.qk_rope_dim)
    if family == "v2":
        q_pe, kpe = rope_mod.apply_rotary_emb(q_pe, kpe, position_embeddings.to(q_pe.device))
    else:
        cos, sin = position_embeddings
        if getattr(module.config, "rope_interleave", False):
            q_pe, kpe = rope_mod.apply_rotary_pos_emb_interleave(q_pe, kpe, cos, sin)
        else:
            q_pe, kpe = rope_mod.apply_rotary_pos_emb(q_pe, kpe, cos, sin)
    return q_nope, q_pe, ckv, kpe.view(B, T, g.qk_rope_dim)


class _LayerState(Uncopyable, dict):
    """What install_kv_eviction keeps on an attention module; refuses to be copied or pickled."""

    _copy_refusal = ("kvevict: a model with eviction installed cannot be deep-copied or pickled; "
                     "handle.remove() first (state_dict() and save_pretrained() work while installed)")


def _installed_forward(module: nn.Module, *args, **kwargs):
    """The forward install_kv_eviction puts on a DeepSeek attention module (see the module doc)."""
    state = module.__dict__["_kvevict"]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    handle = state["handle"]() if state["handle"] is not None else None
    if not isinstance(cache, KVEvictCache) or handle is None or cache._handle is not handle:
        # Inside a decoder forward the pre-hook has already said it (or the user passed no cache: the model
        # made its own, silently); an attention module called by itself says it at every call.
        if cache is not None and handle is not None and handle._forward is None:
            _warn(f"kvevict: layer {state['layer']}'s attention got a {_no_eviction(cache)}")
        return state["forward"](*args, **kwargs)
    hidden = args[0] if args else kwargs["hidden_states"]
    position_embeddings = kwargs.get("position_embeddings")
    if position_embeddings is None and len(args) > 1 and state["family"] == "v3":
        position_embeddings = args[1]
    if cache._step is None:
        raise RuntimeError("kvevict: the attention ran outside a forward of the installed model's decoder "
                           "(the cache's columns are counted per decoder forward)")
    return handle._attend(module, state, cache, hidden, position_embeddings)


#: transformers' continuous batching (``ContinuousMixin``): its three entry points, each of which the
#: next calls (``generate_batch`` -> ``continuous_batching_context_manager`` -> ``init_continuous_batching``;
#: ``generate(cache_implementation="paged")`` -> ``generate_batch``). They run the model through their own
#: ``PagedAttentionCache``, which kvevict cannot evict from; install replaces each on the model with a refusal.
_CONTINUOUS_BATCHING = ("generate_batch", "continuous_batching_context_manager", "init_continuous_batching")

_NO_CONTINUOUS_BATCHING = ("transformers' continuous batching (generate_batch, init_continuous_batching, "
                           "continuous_batching_context_manager, cache_implementation='paged') is not supported with "
                           "eviction installed: it runs through its own PagedAttentionCache, without eviction. Call "
                           "model.generate(...) per request instead (a left-padded batch of requests works too), or "
                           "handle.remove() first to batch without eviction")


def _refuse_continuous_batching(name: str, *args, **kwargs):
    """What an installed model's ``generate_batch`` / ``init_continuous_batching`` /
    ``continuous_batching_context_manager`` is: a refusal before any work."""
    raise NotImplementedError(f"kvevict: {name}(): {_NO_CONTINUOUS_BATCHING}")


def _is_paged(cache: Any) -> bool:
    """Whether `cache` is continuous batching's PagedAttentionCache (by name: older transformers lack it)."""
    return any(c.__name__ == "PagedAttentionCache" for c in type(cache).__mro__)


def _no_eviction(cache: Any) -> str:
    """The end of a warning: what a forward with `cache` does instead of evicting."""
    name = type(cache).__name__
    what = ("a KVEvictCache of another model or install" if isinstance(cache, KVEvictCache)
            else f"a {name}, not a KVEvictCache")
    return (f"{what}: it runs the model's own attention, without eviction (generate() makes a KVEvictCache "
            "itself; for your own loop use handle.new_cache(); pass no cache for a plain forward)")


_NO_ATTENTIONS = ("output_attentions=True: the installed attention returns no attention weights (the attentions "
                  "come back as empty tuples; kvevict's attention feeds them to the scorer instead); "
                  "handle.remove() first to get transformers' weights, or leave output_attentions off")


class KVEviction(Uncopyable):
    """The handle ``install_kv_eviction`` returns (not copied or pickled: it holds C++ caches).

    Attributes: ``model``; ``config`` (``EvictionConfig``); ``geometry`` (the model's MLA
    dimensions, and layer 0's dtype and device: each layer's cache takes its own layer's);
    ``cache`` (the ``KVEvictCache`` of the latest sequence, or None). Methods: ``remove()``,
    ``new_cache()``, ``reset()``, ``positions(layer)``, ``stats()``, ``memory()``. The caches, the
    chunk loop, the press, stats and memory are the runtime's (``_runtime.Runtime``, shared with
    ``kvevict.install``); this handle maps transformers onto it."""

    _copy_refusal = _LayerState._copy_refusal

    def __init__(self, model: nn.Module, attns: List[Tuple[int, nn.Module]], decoder: nn.Module, runtime: Runtime):
        self.model = model
        self.config = runtime.config
        self._runtime = runtime
        self._compress = runtime.press  # the press: a SnapKV / H2O scorer that compresses the prompt once
        self._attns = attns
        self._decoder = decoder
        self._cache: Optional[KVEvictCache] = None  # the latest sequence's (held: stats() after generate())
        self._patches = Patches()  # what install set on the model and its modules; remove() undoes it
        self._forward: Optional[str] = None  # the decoder forward in progress: "ours", "plain", "other" or None
        self._draft_k = 0  # drafts the candidate generator just made: the next forward verifies them
        ref = weakref.ref(self)
        for layer, m in attns:
            fam = _family(m)
            self._patches.set(m, "_kvevict", _LayerState(handle=ref, layer=layer, family=fam[0], rope=fam[1],
                                                         forward=m.forward))
            self._patches.set(m, "forward", functools.partial(_installed_forward, m))
        self._patches.hook(decoder.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self._patches.hook(decoder.register_forward_hook(self._post_hook, with_kwargs=True))
        self._saved: Dict[str, Any] = {}  # the model's instance attributes install replaced: name -> old (None: none)
        self._patch("_prepare_cache_for_generation", self._prepare_cache_for_generation)
        if hasattr(type(model), "_get_candidate_generator"):
            self._patch("_get_candidate_generator", self._get_candidate_generator)
        for name in _CONTINUOUS_BATCHING:
            if hasattr(type(model), name):
                self._patch(name, functools.partial(_refuse_continuous_batching, name))
        self._patches.set(model, "_kvevict_handle", self)

    def _patch(self, name: str, value: Any) -> None:
        self._saved[name] = self.model.__dict__.get(name)
        self._patches.set(self.model, name, value)

    @property
    def geometry(self) -> Geometry:
        return self._runtime.geometry

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def remove(self) -> None:
        """Puts the model back as it was (its own attention forward, its own caches). Idempotent."""
        self._patches.remove()
        self._saved = {}
        self._cache = None

    def new_cache(self) -> KVEvictCache:
        """A fresh, empty cache for this model (what ``generate()`` gets by itself); pass it as
        ``past_key_values`` to drive your own forward loop."""
        self._require_installed()
        c = KVEvictCache(self)
        self._cache = c
        return c

    @property
    def cache(self) -> Optional[KVEvictCache]:
        return self._cache

    def reset(self) -> None:
        """Empties the latest cache (``reset_eviction_scores``): scores, rows and positions."""
        c = self.cache
        if c is not None:
            c.reset()

    def _require_installed(self):
        if not self.installed:
            raise RuntimeError("kvevict: the eviction was removed from this model; install_kv_eviction() again")

    def _require_cache(self) -> KVEvictCache:
        c = self.cache
        if c is None or c.kv is None:
            raise RuntimeError("kvevict: no sequence yet: run generate() (or a forward with handle.new_cache()) first")
        return c

    # -- reading ---------------------------------------------------------------------------------
    def positions(self, layer: int) -> torch.Tensor:
        """[B, S] int64 on the cache's device: the positions layer `layer` keeps per row, ascending,
        -1 past a row's length (S = the longest row). Positions count a row's real tokens from
        its first (pads have none)."""
        kv = self._require_cache().kv
        n = self.geometry.num_layers
        if not isinstance(layer, int) or not 0 <= layer < n:
            raise IndexError(f"kvevict: layer must be in [0, {n}), got {layer!r}")
        p = kv.positions(layer)
        big = torch.iinfo(torch.int64).max
        s = torch.where(p < 0, torch.full_like(p, big), p).sort(dim=-1).values
        return torch.where(s == big, torch.full_like(s, -1), s)

    def stats(self) -> Dict[str, Any]:
        """Counters of the latest sequence: columns (taken in, pads included), kept (per layer: the
        longest row's cached tokens), capacity (per row and layer), and, summed over layers and rows,
        eviction_events, tokens_evicted, tier_tokens, tier_recalled."""
        c = self._require_cache()
        return {"columns": c._columns, **self._runtime.stats(c.kv)}

    def memory(self) -> MemoryReport:
        """Cache bytes now, against what transformers' ``DynamicCache`` would hold for the same columns."""
        c = self._require_cache()
        return self._runtime.memory(c.kv, c._columns, "latent" if _CROP_COUNTS else "expanded")

    def __repr__(self) -> str:
        cfg = self.config
        return (f"KVEviction(layers={self.geometry.num_layers}, layout={cfg.layout}, budget={cfg.budget}, "
                f"n_sink={cfg.n_sink}, n_recent={cfg.n_recent}, tier_tokens={cfg.tier_tokens}, "
                f"installed={self.installed}, cache={self.cache!r})")

    # -- hooks -----------------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        if getattr(generation_config, "num_beams", 1) > 1:
            raise ValueError(f"kvevict: beam search (num_beams={generation_config.num_beams}) is not supported with "
                             "eviction installed; use num_beams=1, or handle.remove() first")
        impl = getattr(generation_config, "cache_implementation", None)
        if impl not in (None, "dynamic"):
            raise ValueError(f"kvevict: cache_implementation={impl!r} is not supported with eviction installed "
                             "(kvevict's cache is the cache); leave it unset")
        given = {k: model_kwargs.get(k) for k in ("cache", "past_key_values")}
        for key, c in given.items():
            if c is not None and not (isinstance(c, KVEvictCache) and c._handle is self):
                _warn(f"kvevict: generate()'s {key} is {_no_eviction(c)}")
        if getattr(generation_config, "use_cache", True) is False:
            _warn("kvevict: generate(use_cache=False) keeps no cache, so it evicts nothing: every step runs the "
                  "model's own attention over the whole sequence; leave use_cache on")
        if getattr(generation_config, "assistant_early_exit", None) is not None:
            raise ValueError("kvevict: assistant_early_exit is not supported with eviction installed: its drafts run a "
                             "forward through the model's first layers only, which kvevict's per-layer caches cannot "
                             "take in; use prompt_lookup_num_tokens or an assistant_model (both exact under eviction)")
        if getattr(generation_config, "output_attentions", False):
            _warn(f"kvevict: generate(): {_NO_ATTENTIONS}")
        orig = (self._saved.get("_prepare_cache_for_generation")
                or type(self.model)._prepare_cache_for_generation.__get__(self.model))
        r = orig(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            c = model_kwargs.get(key)
            if given[key] is None and type(c) is DynamicCache:
                model_kwargs[key] = self.new_cache()
            elif isinstance(c, KVEvictCache):
                self._cache = c
        return r

    def _get_candidate_generator(self, *args, **kwargs):
        """transformers' own, its ``get_candidates`` wrapped to say how many drafts the next forward (the
        verify forward) ends with: that forward runs them one by one on saved layers, and crop() runs the
        accepted ones again, so assisted, prompt-lookup and speculative decoding keep greedy's cache."""
        orig = (self._saved.get("_get_candidate_generator")
                or type(self.model)._get_candidate_generator.__get__(self.model))
        generator = orig(*args, **kwargs)
        get_candidates = generator.get_candidates
        handle = weakref.ref(self)

        def counted(input_ids, *a, **kw):
            ids, logits = get_candidates(input_ids, *a, **kw)
            h = handle()
            if h is not None:
                h._draft_k = int(ids.shape[-1]) - int(input_ids.shape[-1])
            return ids, logits

        generator.get_candidates = counted
        return generator

    def _pre_hook(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and _is_paged(cache):  # a continuous-batching manager built without the entry points
            raise NotImplementedError(f"kvevict: this forward got a {type(cache).__name__}: {_NO_CONTINUOUS_BATCHING}")
        if not isinstance(cache, KVEvictCache) or cache._handle is not self:
            # No cache: the model's own forward (it may make a DynamicCache for itself), silently.
            self._forward = "plain" if cache is None else "other"
            if cache is not None and not _in_generate():  # generate() said it once for all its forwards
                _warn(f"kvevict: this forward got {_no_eviction(cache)}")
            return None
        self._forward = "ours"
        if kwargs.get("output_attentions", getattr(module.config, "output_attentions", False)) and not _in_generate():
            _warn(f"kvevict: {_NO_ATTENTIONS}")
        x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError("kvevict: the decoder got neither input_ids nor inputs_embeds")
        self._cache = cache
        cache._begin(int(x.shape[1]), int(x.shape[0]), kwargs.get("attention_mask"))
        return None

    def _post_hook(self, module, args, kwargs, output):
        self._forward = None
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVEvictCache) and cache._handle is self:
            cache._end()
        return None

    # -- the cache ----------------------------------------------------------------------------
    def _make_kv(self, batch: int):
        """The kvevict cache of a new sequence (``Runtime.make_cache``): each layer on its attention's
        device and in its dtype, read now (the model may have moved since install). One cache when all
        layers agree (the usual model); otherwise one per (device, dtype), behind a ``LayerGroups``."""
        placements = [(m.kv_a_proj_with_mqa.weight.device, m.kv_a_proj_with_mqa.weight.dtype) for _, m in self._attns]
        return self._runtime.make_cache(batch, placements)

    def _attend(self, module: nn.Module, state: dict, cache: KVEvictCache, hidden: torch.Tensor,
                position_embeddings) -> Tuple[torch.Tensor, None]:
        g = self.geometry
        layer = state["layer"]
        kv, lk = cache._layer(layer)  # the cache holding this layer (its device and dtype), and its index there
        T, counts = cache._step
        B = hidden.size(0)
        q_nope, q_pe, ckv, kpe = _project(module, state["family"], state["rope"], hidden, position_embeddings, g)
        if ckv.dtype != kv.dtype or ckv.device != kv.device:
            raise RuntimeError(f"kvevict: layer {layer} runs in {ckv.dtype} on {ckv.device}, but this cache was made "
                               f"for {kv.dtype} on {kv.device}: the model moved after the cache was "
                               "made; start a new sequence (generate() without a cache, or handle.new_cache())")
        latent = self._runtime.latent
        if latent:
            w_uk, w_uv = _absorbed_weights(module, g)
            rows = Latent(_per_head(q_nope, w_uk), q_pe, ckv, kpe)  # q_a [B, H, T, r]
        else:
            kvx = module.kv_b_proj(ckv).view(B, T, g.num_heads, g.qk_nope_dim + g.v_dim).transpose(1, 2)
            k_nope, v = torch.split(kvx, [g.qk_nope_dim, g.v_dim], dim=-1)
            k = torch.cat([k_nope, kpe.unsqueeze(1).expand(B, g.num_heads, T, g.qk_rope_dim)], -1)
            rows = Expanded(torch.cat([q_nope, q_pe], -1), k, v)
        scale = float(module.scaling)
        # Speculative decoding's verify forward: its last `drafts` columns are drafts, each run as
        # greedy would run it, alone after the ones before it, on a saved copy of the layer, which is
        # then restored; crop() runs the accepted drafts again (KVEvictCache._settle).
        drafts = cache._verify
        C = T - drafts  # the columns before the drafts: the prompt, or the latest accepted token
        # The columns through this layer's cache: the press, or per chunk update, recall, attend, evict.
        out = self._runtime.run_columns(kv, lk, rows.cols(0, C) if drafts else rows, scale,
                                        [counts[0] - drafts] if drafts and counts else counts,  # left pads: before C
                                        where="install_kv_eviction()")
        if drafts:
            out = torch.cat([out, self._runtime.run_drafts(kv, lk, rows.cols(C, T), scale)], 2)
            cache._drafts[layer] = (kv, lk, scale, rows.cols(C, T))
        if latent:
            out = _per_head(out, w_uv.transpose(1, 2))  # [B, H, T, v]
        out = out.transpose(1, 2).reshape(B, T, g.num_heads * g.v_dim)
        cache._layers_done += 1
        return module.o_proj(out), None


# ---- install -------------------------------------------------------------------------------------------
def _find(model: nn.Module):
    """(decoder module holding the layers, [(layer index, attention module)])."""
    if model.__dict__.get("_kvevict_handle") is not None:
        raise ValueError("kvevict: the model already has eviction installed; handle.remove() it first")
    attns, unsupported = [], []
    decoder = None
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            if _family(m) is None:
                unsupported.append(type(m).__name__)
            else:
                attns.append(m)
        if decoder is None and isinstance(getattr(m, "layers", None), nn.ModuleList) and hasattr(m, "embed_tokens"):
            decoder = m
    if unsupported or not attns:
        names = sorted(set(unsupported)) or [type(model).__name__ + " (no self_attn modules)"]
        raise ValueError(f"kvevict: install_kv_eviction supports DeepSeek-V2/V3 attention (DeepseekV3Attention, "
                         f"DeepseekV2Attention and their subclasses); this model has {', '.join(names)}")
    if decoder is None:
        raise ValueError(f"kvevict: found no decoder (a module with embed_tokens and layers) in {type(model).__name__}")
    out = []
    for i, m in enumerate(attns):
        layer = getattr(m, "layer_idx", i)
        if layer != i:
            raise ValueError(f"kvevict: attention module {i} has layer_idx {layer}; expected the layers in order")
        _check_attention(m, i)
        out.append((i, m))
    return decoder, out


def _heads_of(module: nn.Module, layer: int, g: Geometry) -> Tuple[int, Optional[_TensorParallel]]:
    """(this rank's heads, the tensor-parallel group or None) of one attention, read from its weights:
    kv_b_proj (and q_proj / q_b_proj) column-sharded over the heads (``"colwise"``: DTensor, Shard(0)),
    o_proj row-sharded (``"rowwise"``: Shard(1), its output summed over the ranks), the latent's
    projection replicated. Raises ValueError naming the module, the expected and the actual layout."""
    name = f"layer {layer}'s self_attn"
    q = module.q_proj if getattr(module, "q_lora_rank", None) is None else module.q_b_proj
    q_name = "q_proj" if getattr(module, "q_lora_rank", None) is None else "q_b_proj"
    weights = {"kv_b_proj": module.kv_b_proj.weight, q_name: q.weight, "o_proj": module.o_proj.weight,
               "kv_a_proj_with_mqa": module.kv_a_proj_with_mqa.weight}
    sharded = {n: w for n, w in weights.items() if _is_dtensor(w)}
    if not sharded:
        return g.total_heads, None
    want = {"kv_b_proj": 0, q_name: 0, "o_proj": 1}  # the dim sharded
    got = {n: ", ".join(repr(p) for p in w.placements) if n in sharded else "not a DTensor" for n, w in weights.items()}
    bad = [n for n, d in want.items() if n not in sharded or len(sharded[n].placements) != 1
           or not sharded[n].placements[0].is_shard(dim=d)]
    if "kv_a_proj_with_mqa" in sharded and any(not p.is_replicate() for p in sharded["kv_a_proj_with_mqa"].placements):
        bad.append("kv_a_proj_with_mqa")
    if bad:
        raise ValueError(f"kvevict: {name} is tensor-parallel in a layout kvevict does not support: expected "
                         "kv_b_proj and the query projection sharded over the heads (colwise, Shard(dim=0)), o_proj "
                         "rowwise (Shard(dim=1)) and the latent (kv_a_proj_with_mqa) replicated, as DeepSeek's "
                         f"base_model_tp_plan; got {got}")
    mesh = sharded["kv_b_proj"].device_mesh
    if mesh.ndim != 1 or any(w.device_mesh != mesh for n, w in sharded.items()):
        raise ValueError(f"kvevict: {name}'s sharded weights must share one 1-D device mesh (transformers' tensor-"
                         f"parallel mesh), got {[(n, w.device_mesh) for n, w in sharded.items()]}")
    kv_rows = int(_local(module.kv_b_proj.weight).shape[0])
    q_rows = int(_local(q.weight).shape[0])
    per_kv, per_q = g.qk_nope_dim + g.v_dim, g.qk_nope_dim + g.qk_rope_dim
    if kv_rows % per_kv or q_rows % per_q or kv_rows // per_kv != q_rows // per_q or kv_rows == 0:
        raise ValueError(f"kvevict: {name}: this rank's shards must hold whole heads, the same in kv_b_proj and "
                         f"{q_name}: kv_b_proj has {kv_rows} rows (heads of {per_kv}: qk_nope_head_dim + v_head_dim), "
                         f"{q_name} {q_rows} rows (heads of {per_q}: qk_nope_head_dim + qk_rope_head_dim); "
                         f"the model's {g.total_heads} heads must divide evenly by the tensor-parallel size "
                         f"{mesh.size()}")
    group = mesh.get_group()
    return kv_rows // per_kv, _TensorParallel(group=group, rank=torch.distributed.get_rank(group),
                                              size=torch.distributed.get_world_size(group))


def _geometry(attns) -> Geometry:
    m = attns[0][1]
    w = m.kv_a_proj_with_mqa.weight
    g = Geometry(num_layers=len(attns), num_heads=int(m.num_heads), kv_lora_rank=int(m.kv_lora_rank),
                  qk_rope_dim=int(m.qk_rope_head_dim), qk_nope_dim=int(m.qk_nope_head_dim),
                  v_dim=int(m.v_head_dim), dtype=w.dtype, device=w.device, total_heads=int(m.num_heads))
    per_layer = [_heads_of(a, layer, g) for layer, a in attns]
    heads, tp = per_layer[0]

    def where(t):
        return f"a group of {t.size}" if t else "no tensor parallelism"

    for layer, (h, t) in enumerate(per_layer):
        if h != heads or (t is None) != (tp is None) or (t is not None and t.group != tp.group):
            raise ValueError(f"kvevict: every layer must hold the same heads in the same tensor-parallel group: layer "
                             f"0 holds {heads} of {g.total_heads} heads ({where(tp)}), layer {layer} {h} ({where(t)})")
    if tp is not None and heads * tp.size != g.total_heads:
        raise ValueError(f"kvevict: each of the {tp.size} tensor-parallel ranks must hold num_attention_heads / "
                         f"{tp.size} = {g.total_heads / tp.size:g} heads; this rank (rank {tp.rank}) holds {heads}")
    return dataclasses.replace(g, num_heads=heads, tp=tp)


def _check_ranks_agree(tp: _TensorParallel, config: EvictionConfig, geometry: Geometry) -> None:
    """Under tensor parallelism every rank must install the same eviction (a collective: one all-gather of the
    settings), or the ranks would keep different tokens; raises ValueError on every rank naming the first
    setting that differs."""
    fields = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}
    fields.update(num_heads=str(geometry.num_heads), num_layers=str(geometry.num_layers))
    everyone: List[Any] = [None] * tp.size
    torch.distributed.all_gather_object(everyone, fields, group=tp.group)
    for name in fields:
        values = [e[name] for e in everyone]
        if len(set(values)) > 1:
            raise ValueError(f"kvevict: install_kv_eviction under tensor parallelism: {name} differs across the "
                             f"{tp.size} ranks ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}); every "
                             "rank must install the same settings")


def install_kv_eviction(model: nn.Module, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink,
                        n_recent: int = EvictionConfig.n_recent, **options) -> KVEviction:
    """Installs H2O-style KV-cache eviction on a transformers DeepSeek-V2/V3 model (the seed's call)
    and returns the handle (``KVEviction``). ``model.generate(...)`` then runs through a kvevict
    cache, each layer's on that layer's device and in its dtype, that keeps, per layer and row, the first `n_sink`
    tokens, the `budget` heavy hitters (attention accumulated across heads) and the newest
    `n_recent` tokens.

    options: the other fields of ``EvictionConfig`` (scorer, evict_every, layer_budgets, layout,
    tier_tokens, tier_page_size, recall_tokens, recall_rescore, tier_scoring, prefill_chunk,
    observe), the one list of the options and their defaults, shared with ``kvevict.install``. Raises ValueError / TypeError naming a bad option, or an unsupported model (naming
    its attention class); the model is unchanged then.

    Under transformers' tensor parallelism (``tp_plan="auto"``, DeepSeek's plan) every rank calls it
    with the same settings: it all-gathers them and raises ValueError on every rank when one differs."""
    return _install(model, EvictionConfig.of("install_kv_eviction", budget, n_sink, n_recent, options))


def _install(model: nn.Module, config: EvictionConfig, compress=None) -> KVEviction:
    decoder, attns = _find(model)
    geometry = _geometry(attns)
    runtime = Runtime(config, geometry, compress)  # checks layer_budgets against the layers
    if geometry.tp is not None:
        if compress is not None:
            raise NotImplementedError(f"kvevict: press() on a tensor-parallel model (tp_size {geometry.tp.size}) is "
                                      "not supported: its prompt compression scores each rank's heads alone; use "
                                      "install_kv_eviction(), whose scores are summed over the ranks")
        _check_ranks_agree(geometry.tp, config, geometry)
    return KVEviction(model, attns, decoder, runtime)


def reset_eviction_scores(model: nn.Module) -> None:
    """Empties the installed model's latest cache (scores, rows, positions): its next forward
    starts a new sequence. ``generate()`` without ``past_key_values`` starts one anyway."""
    h = model.__dict__.get("_kvevict_handle")
    if h is None:
        raise ValueError("kvevict: reset_eviction_scores: this model has no eviction installed")
    h.reset()


@contextlib.contextmanager
def press(model: nn.Module, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink,
          n_recent: int = EvictionConfig.n_recent, *, window: int = 32, kernel: int = 5,
          scorer: Optional[ScorerLike] = None, **options) -> Iterator[KVEviction]:
    """Prompt compression, kvpress-style: inside the ``with``, the first forward of a sequence (the
    prompt) attends in full and each layer is compressed once to its capacity by
    ``kvevict.compress_prompt`` under SnapKV (Li et al. 2024, Sec. 4: the last `window` prompt
    queries vote, heads averaged, 1-D pooling over `kernel`), or under `scorer` ("h2o": every
    prompt query's attention, from the LSE). Decoding continues through the cache under the same scorer.
    Unpadded prompts only (batches of equal length). A SnapKV window longer than `n_recent`
    warns: the window's own tokens then compete with the prompt's. On exit the model is
    restored. Yields the handle; other keyword arguments are ``EvictionConfig`` fields."""
    compress = press_scorer(window, kernel, scorer, n_recent)  # and the warning
    handle = _install(model, EvictionConfig.of("press", budget, n_sink, n_recent, options), compress)
    try:
        yield handle
    finally:
        handle.remove()
