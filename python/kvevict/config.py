"""The options of both installers, and their only list: ``EvictionConfig`` (every option, its
default and its checks; it builds the C++ ``EvictionOptions`` once), the scorer names
(``SCORERS``, ``make_scorer``) and the layouts (``LAYOUTS``). ``kvevict.install`` (the shipped
model) and ``kvevict.hf`` (transformers' DeepSeek models) take its fields as keyword arguments;
what they run is ``_runtime.py``. No transformers import here."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Literal, Optional, Union

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

#: The cache layouts: "latent" (``MlaLatentCache``, the default) and "expanded" (``MlaCache``).
LAYOUTS = ("latent", "expanded")


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


@dataclasses.dataclass
class EvictionConfig:
    """What ``kvevict.hf.install_kv_eviction`` and ``kvevict.install`` build, and the only list of
    their options and defaults (H2O, Zhang et al. 2023, Sec. 3: sinks, heavy hitters and a recent
    window per layer and sequence). Capacity per row and layer = ``n_sink + budget + n_recent``
    tokens (``layer_budgets`` replaces ``budget`` per layer).

    Checked once, when made (``__post_init__``: ValueError / TypeError naming the field), which
    also builds the C++ ``EvictionOptions`` (``eviction_options``) that every cache of an install
    takes. Make a new config (``dataclasses.replace``) rather than assigning a field: an assigned
    field is not checked again.

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
        layout: "latent" (the default for both installers: c_kv 512 + k_pe 64 per token,
            ``MlaLatentCache``, absorbed attention) or "expanded" (``MlaCache``: per-head keys 192
            and values 128, ``kv_b_proj`` applied once per token on its way in).
        tier_tokens: evicted tokens kept per row and layer in a host tier (0: no tier). With a
            tier, each forward recalls up to ``recall_tokens`` of them before attending (ArkVale,
            Chen et al. 2024; pages scored by Quest's bounds, Tang et al. 2024, Sec. 3.2).
        tier_page_size: tier page size in tokens (Quest digests per page).
        recall_tokens: tokens recalled per forward and layer when a tier is on.
        recall_rescore: two-level recall: the best pages up to this many tokens are scored again
            token by token (at most ``recall_tokens``, e.g. 0: whole pages come back). At least
            ``tier_page_size`` when it is more than ``recall_tokens``.
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
            if not 0 <= v <= _k.EvictionOptions.MAX_TOKENS:
                raise ValueError(f"kvevict: {name} must be in [0, 2^40], got {v}")
        for name in ("evict_every", "tier_page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= _k.EvictionOptions.MAX_TOKENS:
                raise ValueError(f"kvevict: {name} must be an int in [1, 2^40], got {v!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"kvevict: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.tier_scoring not in ("head_mean", "per_head"):
            raise ValueError(f"kvevict: tier_scoring must be 'head_mean' or 'per_head', got {self.tier_scoring!r}")
        if (self.tier_tokens and self.recall_rescore > self.recall_tokens
                and self.recall_rescore < self.tier_page_size):  # two-level recall's pool: at least one page
            raise ValueError(f"kvevict: recall_rescore must be <= recall_tokens ({self.recall_tokens}, whole pages) or "
                             f">= tier_page_size ({self.tier_page_size}, two-level recall), got {self.recall_rescore}")
        if not isinstance(self.observe, bool):
            raise TypeError(f"kvevict: observe must be a bool, got {type(self.observe).__name__} ({self.observe!r})")
        if self.layer_budgets is not None:
            if isinstance(self.layer_budgets, (str, bytes)) or not hasattr(self.layer_budgets, "__iter__"):
                raise TypeError("kvevict: layer_budgets must be a list of ints (one budget per layer) or None, got "
                                f"{type(self.layer_budgets).__name__}")
            budgets = list(self.layer_budgets)
            for i, b in enumerate(budgets):
                if isinstance(b, bool) or not isinstance(b, int):
                    raise TypeError(f"kvevict: layer_budgets[{i}] must be an int, got {type(b).__name__} ({b!r})")
            self.layer_budgets = budgets
        if isinstance(self.scorer, _k.SnapKV) or (isinstance(self.scorer, str) and self.scorer.lower() == "snapkv"):
            raise ValueError(f"kvevict: scorer={self.scorer!r}: SnapKV scores a prompt once: use kvevict.press "
                             "(kvevict.hf.press for transformers) for it, or a decode-time scorer ('h2o', 'mean', "
                             "'tova', 'decay')")
        make_scorer(self.scorer)  # raises on an unknown name or type
        self.eviction_options.validate()  # capacity >= 1, and the ranges of the C++ options

    @property
    def capacity(self) -> int:
        """Tokens kept per row and layer (with ``budget``; ``layer_budgets`` set their own)."""
        return self.n_sink + self.budget + self.n_recent

    @property
    def eviction_options(self) -> "_k.EvictionOptions":
        """The C++ ``EvictionOptions`` of budget, n_sink, n_recent and evict_every, built once (a
        copy or unpickled config builds its own)."""
        ev = self.__dict__.get("_eviction")
        if ev is None:
            ev = _k.EvictionOptions(self.budget, n_sink=self.n_sink, n_recent=self.n_recent,
                                    evict_every=self.evict_every)
            self.__dict__["_eviction"] = ev
        return ev

    def __setattr__(self, name: str, value: Any) -> None:  # a field assigned later: built again (not checked)
        super().__setattr__(name, value)
        self.__dict__.pop("_eviction", None)

    def __getstate__(self) -> Dict[str, Any]:  # copies and pickles leave the C++ options out
        return {k: v for k, v in self.__dict__.items() if k != "_eviction"}

    @classmethod
    def of(cls, where: str, budget: int, n_sink: int, n_recent: int, options: Dict[str, Any]) -> "EvictionConfig":
        """The config of an installer's call: `options` are the other fields' keyword arguments.
        Raises TypeError naming `where` on a keyword that is not a field."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"kvevict: {where} got unknown options {unknown}; known: {known}")
        return cls(budget=budget, n_sink=n_sink, n_recent=n_recent, **options)
