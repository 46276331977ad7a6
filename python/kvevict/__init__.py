"""kvevict from Python: KV-cache eviction for DeepSeek-style (MLA) models.

The C++ library (include/kvevict/) bound as ``kvevict._kvevict`` and re-exported here:
caches (``MlaCache``, ``MlaLatentCache``), the caller-owned-storage ``EvictionPolicy``,
attention (``attend``, ``attend_absorbed``), LSE scoring (``observe_lse``, ``LseRing``),
prompt compression (``compress_prompt``, ``prefill_chunked``), ``Selection`` and the memory
model. ``EvictionConfig`` (``config.py``) is the installers' options. Two thin adapters over one
runtime (``_runtime.py``: the cache factory, the chunk loop, the press, stats and memory):
``kvevict.hf`` (with transformers installed) puts eviction on transformers' DeepSeek-V2/V3 models;
``kvevict.install`` and ``kvevict.press`` (``_install.py``) put it on ``kvevict.models``, the
shipped quality model in PyTorch. Those three are imported when first used: ``import kvevict``
imports neither the quality model nor transformers.
"""

import importlib

import torch  # noqa: F401  (loads libtorch and torch's Python types before the extension)

from ._kvevict import *  # noqa: F401,F403
from ._kvevict import __version__  # noqa: F401

from .config import LAYOUTS, SCORERS, EvictionConfig, make_scorer  # noqa: E402,F401
from ._runtime import MemoryReport  # noqa: E402,F401

#: Names imported on first use: the quality model and its installer (module __getattr__, PEP 562).
_LAZY = {"models": None, "install": "_install", "press": "_install", "Installed": "_install"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvevict' has no attribute {name!r}")
    if _LAZY[name] is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
