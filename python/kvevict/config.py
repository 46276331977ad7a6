"""What both installers share: the scorer names, ``EvictionConfig`` (the options, checked),
``MemoryReport`` and the chunk arithmetic of left-padded batches. No transformers import here:
``kvevict.install`` (the shipped model) and ``kvevict.hf`` (transformers' DeepSeek models) both
build on it."""

from __future__ import annotations

import dataclasses
from typing import List, Literal, Optional, Union

import torch

from . import _kvevict as _k

ScorerLike = Union[str, "_k.CumulativeAttention", "_k.MeanObservedAttention", "_k.LatestAttention",
                   "_k.DecayedAttention", "_k.SnapKV"]

#: Scorer names the installers accept besides scorer objects ("snapkv": the press only).
SCORERS = {
    "h2o": _k.CumulativeAttention,
    "cumulative": _k.CumulativeAttention,
    "mean": _k.MeanObservedAttention,
    "tova": _k.LatestAttention,
    "latest": _k.LatestAttention,
    "decay": _k.DecayedAttention,
    "snapkv": _k.SnapKV,
}


class Uncopyable:
    """Installed state that deep copies and pickles must not take (it holds a C++ cache): both
    raise TypeError(``_copy_refusal``), which each installer words for its own handle."""

    _copy_refusal = "kvevict: a model with eviction installed cannot be deep-copied or pickled; remove() it first"

    def _refuse(self, *args):
        raise TypeError(self._copy_refusal)

    __deepcopy__ = _refuse
    __reduce__ = _refuse
    __reduce_ex__ = _refuse


def make_scorer(scorer: ScorerLike):
    """A scorer object from a name in ``SCORERS`` (default parameters) or a scorer object.
    Raises ValueError on an unknown name, TypeError on another type."""
    if isinstance(scorer, str):
        if scorer.lower() not in SCORERS:
            raise ValueError(f"kvevict: scorer must be one of {sorted(SCORERS)} or a scorer object, got '{scorer}'")
        return SCORERS[scorer.lower()]()
    if not isinstance(scorer, tuple(set(SCORERS.values()))):
        raise TypeError(f"kvevict: scorer must be a name or a kvevict scorer object, got {type(scorer).__name__}")
    return scorer


def tier_scoring(name: str):
    """The ``TierScoring`` value of an ``EvictionConfig.tier_scoring`` name."""
    return _k.TierScoring.kHeadMean if name == "head_mean" else _k.TierScoring.kPerHead


def left_padding_counts(mask: Optional[torch.Tensor], B: int, T: int, where: str) -> Optional[List[int]]:
    """Real tokens per row from a 2-D 0/1 attention mask [B, T] whose ones are each row's last
    columns (left padding); None when every column is real. Raises ValueError on another shape
    or a hole / right padding (naming `where`)."""
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (B, T):
        raise ValueError(f"kvevict: {where}: attention_mask must be [B, T] = [{B}, {T}], got {list(mask.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"kvevict: {where}: attention_mask must hold only 0 (pad) and 1 (token)")
    m = mask.to(torch.bool)
    counts = m.sum(1)
    cols = torch.arange(T, device=m.device).unsqueeze(0)
    if not torch.equal(m, cols >= (T - counts).unsqueeze(1)):
        raise ValueError(f"kvevict: {where}: attention_mask must be left padding (each row's real tokens its last "
                         "columns, no holes); pad on the left")
    counts = [int(c) for c in counts.tolist()]
    return None if all(c == T for c in counts) else counts


def chunk_counts(T: int, counts: Optional[List[int]], s: int, e: int) -> Optional[List[int]]:
    """Real tokens of each row in columns [s, e) of a left-padded chunk of T columns."""
    if counts is None:
        return None
    return [max(0, e - max(s, T - c)) for c in counts]


@dataclasses.dataclass
class EvictionConfig:
    """What ``kvevict.hf.install_kv_eviction`` and ``kvevict.install`` build (H2O, Zhang et al. 2023, Sec. 3: sinks, heavy hitters
    and a recent window per layer and sequence). Capacity per row and layer =
    ``n_sink + budget + n_recent`` tokens (``layer_budgets`` replaces ``budget`` per layer).

    Attributes:
        budget: heavy hitters kept per row and layer (tokens).
        n_sink: the first positions, always kept (attention sinks).
        n_recent: the newest positions, always kept (the recent window).
        scorer: "h2o" (accumulated attention, the default), "mean", "tova", "decay", or a kvevict
            scorer object. SnapKV scores a prompt: it is the press's scorer (``kvevict.hf.press``,
            ``kvevict.press``), refused here.
        evict_every: a row evicts once it holds more than capacity and has appended in this many
            forwards since its last pass (the cache then holds up to capacity + evict_every - 1).
        layer_budgets: one budget per layer (PyramidKV-style), or None.
        layout: "latent" (c_kv 512 + k_pe 64 per token, absorbed attention) or "expanded" (per-head
            keys 192 and values 128, ``kv_b_proj`` applied once per token on its way in).
        tier_tokens: evicted tokens kept per row and layer in a host tier (0: no tier). With a
            tier, each forward recalls up to ``recall_tokens`` of them before attending (ArkVale,
            Chen et al. 2024; pages scored by Quest's bounds, Tang et al. 2024, Sec. 3.2).
        tier_page_size: tier page size in tokens (Quest digests per page).
        recall_tokens: tokens recalled per forward and layer when a tier is on.
        recall_rescore: two-level recall: the best pages up to this many tokens are scored again
            token by token (0: whole pages come back). At least ``tier_page_size`` when set.
        tier_scoring: "head_mean" (pages scored by the heads' mean logit) or "per_head".
        prefill_chunk: a forward of more than this many tokens (a long prompt) is appended,
            attended and evicted chunk by chunk, so the attention's memory is
            O(chunk x (capacity + chunk) x heads) instead of O(T^2 x heads). 0: one chunk.
        observe: feed each attention to the scorer (False: sinks + window + arrival order).
    """

    budget: int = 4096
    n_sink: int = 4
    n_recent: int = 512
    scorer: ScorerLike = "h2o"
    evict_every: int = 1
    layer_budgets: Optional[List[int]] = None
    layout: Literal["latent", "expanded"] = "latent"
    tier_tokens: int = 0
    tier_page_size: int = 64
    recall_tokens: int = 3
    recall_rescore: int = 256
    tier_scoring: Literal["head_mean", "per_head"] = "head_mean"
    prefill_chunk: int = 0
    observe: bool = True

    def __post_init__(self):
        for name in ("budget", "n_sink", "n_recent", "tier_tokens", "recall_tokens", "recall_rescore",
                     "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"kvevict: {name} must be an int, got {type(v).__name__} ({v!r})")
            if v < 0:
                raise ValueError(f"kvevict: {name} must be >= 0, got {v}")
        for name in ("evict_every", "tier_page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kvevict: {name} must be an int >= 1, got {v!r}")
        if self.layout not in ("latent", "expanded"):
            raise ValueError(f"kvevict: layout must be 'latent' or 'expanded', got {self.layout!r}")
        if self.tier_scoring not in ("head_mean", "per_head"):
            raise ValueError(f"kvevict: tier_scoring must be 'head_mean' or 'per_head', got {self.tier_scoring!r}")
        if self.tier_tokens and self.recall_rescore and self.recall_rescore < self.tier_page_size:
            raise ValueError(f"kvevict: recall_rescore must be 0 or >= tier_page_size = {self.tier_page_size}, "
                             f"got {self.recall_rescore}")
        if not isinstance(self.observe, bool):
            raise TypeError(f"kvevict: observe must be a bool, got {type(self.observe).__name__} ({self.observe!r})")
        if isinstance(self.scorer, _k.SnapKV):
            raise ValueError("kvevict: a SnapKV scorer scores a prompt once: use it through the press "
                             "(kvevict.hf.press, kvevict.press), or a decode-time scorer ('h2o', 'mean', 'tova', "
                             "'decay')")
        if self.layer_budgets is not None:
            if isinstance(self.layer_budgets, (str, bytes)) or not hasattr(self.layer_budgets, "__iter__"):
                raise TypeError("kvevict: layer_budgets must be a list of ints (one budget per layer) or None, got "
                                f"{type(self.layer_budgets).__name__}")
            budgets = list(self.layer_budgets)
            for i, b in enumerate(budgets):
                if isinstance(b, bool) or not isinstance(b, int):
                    raise TypeError(f"kvevict: layer_budgets[{i}] must be an int, got {type(b).__name__} ({b!r})")
            self.layer_budgets = budgets
        if isinstance(self.scorer, str) and self.scorer.lower() == "snapkv":
            raise ValueError("kvevict: scorer='snapkv' scores a prompt once: use the press (kvevict.hf.press, "
                             "kvevict.press) for SnapKV, or a decode-time scorer ('h2o', 'mean', 'tova', 'decay')")
        make_scorer(self.scorer)  # raises on an unknown name or type

    @property
    def capacity(self) -> int:
        """Tokens kept per row and layer (with ``budget``; ``layer_budgets`` set their own)."""
        return self.n_sink + self.budget + self.n_recent


@dataclasses.dataclass
class MemoryReport:
    """Bytes, all layers, all rows. ``cache_bytes``: the kvevict cache's device buffers now
    (slots for capacity + evict_every per row and layer, the trash slot included).
    ``full_cache_bytes``: what transformers' own ``DynamicCache`` would hold for the same
    columns in this transformers version's layout (``full_layout``; pads included, as it stores
    them). ``tier_bytes``: host memory of the tier (rows and digests)."""

    cache_bytes: int
    full_cache_bytes: int
    full_layout: str
    tier_bytes: int
    columns: int

    @property
    def ratio(self) -> float:
        """full_cache_bytes / cache_bytes."""
        return self.full_cache_bytes / self.cache_bytes if self.cache_bytes else float("inf")
