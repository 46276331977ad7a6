"""kvevict from Python: KV-cache eviction for DeepSeek-style (MLA) models.

The C++ library (include/kvevict/) bound as ``kvevict._kvevict`` and re-exported here:
caches (``MlaCache``, ``MlaLatentCache``), the caller-owned-storage ``EvictionPolicy``,
attention (``attend``, ``attend_absorbed``), LSE scoring (``observe_lse``, ``LseRing``),
prompt compression (``compress_prompt``, ``prefill_chunked``), ``Selection`` and the memory
model. ``kvevict.models`` has the shipped quality model in PyTorch; ``kvevict.install`` and
``kvevict.press`` put eviction on it in one call; ``kvevict.hf`` (with transformers installed)
puts it on transformers' DeepSeek-V2/V3 models.
"""

import torch  # noqa: F401  (loads libtorch and torch's Python types before the extension)

from ._kvevict import *  # noqa: F401,F403
from ._kvevict import __version__  # noqa: F401

from . import models  # noqa: E402,F401
from .config import SCORERS, EvictionConfig, MemoryReport, make_scorer  # noqa: E402,F401
from ._install import Installed, install, press  # noqa: E402,F401
