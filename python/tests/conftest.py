"""Shared helpers of the Python tests.

``reference(request)`` runs the C++ reference tool (python/tests/reference.cpp, built as
``kvevict_reference`` next to the module; ctest passes its path in KVEVICT_REFERENCE) on a
request dict and returns its reply: the library's own answer, without the binding.
``oracle_keep`` is an independent selection oracle written here from the contract
(docs/DESIGN.md), as tests/support.hpp's oracle_keep is for the C++ tests.
"""

import math
import os
import subprocess
import tempfile

import pytest
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
WEIGHTS = os.path.join(ROOT, "examples", "quality", "weights.pt")


def reference_path() -> str:
    path = os.environ.get("KVEVICT_REFERENCE", os.path.join(ROOT, "build", "python", "kvevict_reference"))
    if not os.path.exists(path):
        pytest.fail(f"the C++ reference tool {path} is missing: build the kvevict_reference target "
                    "(scripts/setup.sh builds it) or set KVEVICT_REFERENCE")
    return path


def _picklable(x):
    """`x` in what LibTorch 1.13's unpickler reads: it has no APPEND or SETITEM opcode (what
    pickle writes for a list or dict of one element), so lists become tuples (TUPLE1..3 or
    MARK ... TUPLE) and a one-entry dict gets a second, unused entry."""
    if isinstance(x, dict):
        d = {k: _picklable(v) for k, v in x.items()}
        if len(d) == 1:
            d["_"] = None
        return d
    if isinstance(x, (list, tuple)):
        return tuple(_picklable(v) for v in x)
    return x


def reference(request: dict) -> dict:
    """Runs kvevict_reference on `request` (a dict of ints, floats, strings, tensors and lists)."""
    with tempfile.TemporaryDirectory() as d:
        req, rep = os.path.join(d, "request.pt"), os.path.join(d, "reply.pt")
        torch.save(_picklable(request), req)
        run = subprocess.run([reference_path(), req, rep], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"kvevict_reference failed ({run.returncode}): {run.stderr.strip()}")
        # A torch::save archive of the tool's own: not weights only (torch >= 2.6 defaults to that).
        return torch.load(rep, weights_only=False)


def oracle_keep(positions, scores, n_sink, budget, n_recent):
    """Positions one row keeps under the contract: the n_sink oldest, the n_recent newest and the
    `budget` other tokens of highest score (non-finite lowest; equal scores keep the newer
    position, i.e. evict the older first). Ascending."""
    tokens = sorted(zip(positions, scores))
    S = len(tokens)
    if S <= n_sink + budget + n_recent:
        return [p for p, _ in tokens]
    kept = [p for i, (p, _) in enumerate(tokens) if i < n_sink or i >= S - n_recent]
    cand = [t for i, t in enumerate(tokens) if n_sink <= i < S - n_recent]
    cand.sort(key=lambda t: (math.isfinite(t[1]), t[1] if math.isfinite(t[1]) else 0.0, t[0]), reverse=True)
    kept += [p for p, _ in cand[:budget]]
    return sorted(kept)


def kept(cache_or_positions, layer=0, row=0):
    """Ascending live positions of `row` (from a cache's layer or a [B, S] positions tensor)."""
    pos = cache_or_positions if isinstance(cache_or_positions, torch.Tensor) else cache_or_positions.positions(layer)
    p = pos[row]
    return sorted(int(x) for x in p[p >= 0])

