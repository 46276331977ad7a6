"""The shipped quality model (examples/quality/model.hpp) in PyTorch.

A small decoder with DeepSeek-V3 attention: MLA with low-rank q and kv compression and the
decoupled RoPE split (a no-RoPE part per head plus one RoPE key shared by all heads), RMSNorm,
SwiGLU MLP, tied embeddings, and one addition to DeepSeek-V3: the token shift (token t-1's
attention input projected into token t's kv latent before its norm; Olsson et al. 2022's
smeared keys). Byte-level vocabulary (0..255) plus special tokens for the retrieval tasks.

The same operations in the same order as the C++ model, so the logits agree to fp32 rounding:

- ``Model.forward(tokens)``: full causal attention over the whole sequence (the reference);
- ``Model.step(tokens, cache, state)``: through a kvevict cache, either layout:
  ``MlaCache`` (keys and values decompressed per head, ``kvevict.attend``) or
  ``MlaLatentCache`` (W_UK absorbed into the query, W_UV applied after
  ``kvevict.attend_absorbed``; only ckv + kpe cached);
- ``Model.prefill_compressed(tokens, cache, state)``: the prompt attended in full and each
  layer compressed once by ``kvevict.compress_prompt`` (SnapKV's setting).

``kvevict.install(model, ...)`` runs ``model(tokens)`` through a cache without these calls. The
cache calls themselves (update, recall, attend, the press) are the runtime's (``_runtime.py``), which
``kvevict.install`` and ``kvevict.hf`` share; this module maps the model's projections onto them
(``MLA.rows``, ``MLA.output``). ``import kvevict`` does not import this module.
Weights: ``Model.load(path)`` reads ``WEIGHTS`` by default, the shipped weights installed with the
package (the repository's examples/quality/weights.pt: ``torch::save`` of the fp16
parameters in ``named_parameters()`` order: a TorchScript archive whose parameters are
named "0", "1", ...).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch
from torch import nn

from . import _kvevict as _k
from ._runtime import Expanded, Latent, Rows, attend_chunk, press_prompt

# ---- vocabulary (tasks.hpp) ---------------------------------------------------------------
BOS = 256  #: start of every row
QUERY = 257  #: "what was stored under the next key?"
PASS = 258  #: passkey marker
COPY = 259  #: copy delimiter
KEY0 = 264  #: 64 key symbols
VAL0 = 328  #: 64 value symbols
NUM_SYM = 64
VOCAB = 392


def _weights() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.join(here, "weights.pt")  # pip install . puts them into the package
    if os.path.exists(installed):
        return installed
    # An editable install runs these sources from the tree: python/kvevict -> examples/quality.
    return os.path.normpath(os.path.join(here, "..", "..", "examples", "quality", "weights.pt"))


#: The shipped weights, installed with the package (kvevict/weights.pt, a copy of the
#: repository's examples/quality/weights.pt).
WEIGHTS = _weights()


@dataclass
class Config:
    """The model's dimensions (model.hpp ``kvq::Config``); the defaults are the shipped model's."""

    vocab: int = VOCAB
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    q_lora: int = 64
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_dim: int = 32
    ffn: int = 352
    rope_theta: float = 10000.0
    eps: float = 1e-6
    smear: bool = True  #: the token shift into the kv latent

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(float(self.qk_dim))


@dataclass
class DecodeState:
    """Per-sequence state outside the KV cache: each layer's last attention input [B, 1, dim]
    (for the next token's shifted kv latent). The RoPE position of the next token is the cache's
    seen tokens (a compressed prompt counts whole)."""

    last: List[Optional[torch.Tensor]] = field(default_factory=list)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on x [B, T, d] or [B, H, T, d] at positions pos [T] (every row) or [B, T]
    (per row: a ragged batch), int64 on x's device."""
    d = x.size(-1)
    half = d // 2
    inv = torch.pow(theta, -torch.arange(0, half, dtype=torch.float32, device=x.device) * 2.0 / float(d))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv  # [T, half] or [B, T, half]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    if pos.dim() == 2 and x.dim() == 4:  # per-row positions, broadcast over the heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.narrow(-1, 0, half), x.narrow(-1, half, half)
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


@dataclass
class Projection:
    q_nope: torch.Tensor  #: [B, H, T, qk_nope]
    q_pe: torch.Tensor  #: [B, H, T, qk_rope], RoPE applied
    ckv: torch.Tensor  #: [B, T, kv_lora], normed
    kpe: torch.Tensor  #: [B, T, qk_rope], RoPE applied


class MLA(nn.Module):
    """DeepSeek-V3 multi-head latent attention with the token shift. ``forward`` is full causal
    attention; ``cached`` and ``compressed`` go through a kvevict cache (either layout)."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.wq_a = _linear(c.dim, c.q_lora)
        self.q_norm = RMSNorm(c.q_lora, c.eps)
        self.wq_b = _linear(c.q_lora, c.n_heads * c.qk_dim)
        self.wkv_a = _linear(c.dim, c.kv_lora + c.qk_rope)
        self.kv_norm = RMSNorm(c.kv_lora, c.eps)
        self.wkv_b = _linear(c.kv_lora, c.n_heads * (c.qk_nope + c.v_dim))
        self.wo = _linear(c.n_heads * c.v_dim, c.dim)
        self.wkv_s = _linear(c.dim, c.kv_lora) if c.smear else None

    def project(self, x: torch.Tensor, pos: torch.Tensor,
                last: Optional[torch.Tensor] = None) -> Tuple[Projection, torch.Tensor]:
        """Queries and latent rows of x [B, T, dim] at positions pos [T]; `last` is the previous
        token's attention input [B, 1, dim] (None: the sequence starts at x[:, 0]). Returns the
        projection and this chunk's last attention input (the next chunk's `last`)."""
        c = self.c
        B, T, H = x.size(0), x.size(1), c.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, c.qk_dim).transpose(1, 2)
        q_nope = q.narrow(-1, 0, c.qk_nope)
        q_pe = rope(q.narrow(-1, c.qk_nope, c.qk_rope), pos, c.rope_theta)
        kv = self.wkv_a(x)
        raw = kv.narrow(-1, 0, c.kv_lora)
        new_last = x.narrow(1, T - 1, 1).detach()
        if self.wkv_s is not None:
            first = last if last is not None else torch.zeros(B, 1, c.dim, dtype=x.dtype, device=x.device)
            prev = torch.cat([first, x.narrow(1, 0, T - 1)], 1)
            raw = raw + self.wkv_s(prev)
        ckv = self.kv_norm(raw)
        kpe = rope(kv.narrow(-1, c.kv_lora, c.qk_rope), pos, c.rope_theta)
        return Projection(q_nope, q_pe, ckv, kpe), new_last

    def expand(self, ckv: torch.Tensor, kpe: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, H, T, qk_dim] and values [B, H, T, v_dim] from the latent rows."""
        c = self.c
        B, T, H = ckv.size(0), ckv.size(1), c.n_heads
        kvb = self.wkv_b(ckv).view(B, T, H, c.qk_nope + c.v_dim).transpose(1, 2)
        k = torch.cat([kvb.narrow(-1, 0, c.qk_nope), kpe.unsqueeze(1).expand(B, H, T, c.qk_rope)], -1)
        return k, kvb.narrow(-1, c.qk_nope, c.v_dim)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """[B, H, T, v_dim] -> [B, T, dim]."""
        return self.wo(o.transpose(1, 2).reshape(o.size(0), o.size(2), self.c.n_heads * self.c.v_dim))

    def absorbed_weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, qk_nope, kv_lora] and W_UV [H, v_dim, kv_lora] (views of wkv_b)."""
        c = self.c
        w = self.wkv_b.weight.view(c.n_heads, c.qk_nope + c.v_dim, c.kv_lora)
        return w.narrow(1, 0, c.qk_nope), w.narrow(1, c.qk_nope, c.v_dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full causal attention over x [B, T, dim] at positions pos; mask [T, T] bool, True above
        the diagonal."""
        p, _ = self.project(x, pos)
        k, v = self.expand(p.ckv, p.kpe)
        q = torch.cat([p.q_nope, p.q_pe], -1)
        logits = torch.matmul(q, k.transpose(-2, -1)).mul(self.c.scale).masked_fill(mask, -math.inf)
        return self.out(torch.matmul(torch.softmax(logits, -1), v))

    def rows(self, p: Projection, latent: bool) -> Rows:
        """The projection as the runtime's rows: latent, W_UK absorbed into the query
        (``_runtime.Latent``: q_nope @ W_UK, q_pe, ckv, kpe); expanded, the per-head keys and
        values (``_runtime.Expanded``: q, k, v from ``expand``)."""
        if latent:
            w_uk, _ = self.absorbed_weights()
            return Latent(torch.matmul(p.q_nope, w_uk.unsqueeze(0)), p.q_pe, p.ckv, p.kpe)  # q_a [B, H, T, r]
        k, v = self.expand(p.ckv, p.kpe)
        return Expanded(torch.cat([p.q_nope, p.q_pe], -1), k, v)

    def output(self, o: torch.Tensor, latent: bool) -> torch.Tensor:
        """The runtime's attention output ([B, H, T, r] latent: W_UV applied here; [B, H, T, v]
        expanded) -> the attention block's output [B, T, dim]."""
        if latent:
            o = torch.matmul(o, self.absorbed_weights()[1].transpose(1, 2).unsqueeze(0))  # [B, H, T, v]
        return self.out(o)

    def cached(self, x: torch.Tensor, pos: torch.Tensor, cache, layer: int, last: Optional[torch.Tensor],
               observe: bool = True, counts: Optional[List[int]] = None, recall_tokens: int = 0,
               recall_rescore: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, dim] appended to `layer` of `cache` (MlaCache or MlaLatentCache) and attended
        through it (``_runtime.attend_chunk``; no eviction). pos: [T], or [B, T] per row. counts:
        a left-padded chunk, row b's tokens are its last counts[b] columns (``update``'s counts;
        None: every column). recall_tokens > 0 (a cache with a tier): up to that many evicted
        tokens per row come back from the tier before attending (``recall`` / ``recall_absorbed``
        with `recall_rescore`). Returns (the attention block's output [B, T, dim], the next `last`)."""
        p, new_last = self.project(x, pos, last)
        latent = isinstance(cache, _k.MlaLatentCache)
        o = attend_chunk(cache, layer, self.rows(p, latent), self.c.scale, counts, observe, recall_tokens,
                         recall_rescore)
        return self.output(o, latent), new_last

    def compressed(self, x: torch.Tensor, pos: torch.Tensor, cache, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Full causal attention over a whole prompt x [B, T, dim] at positions 0..T-1, and
        `layer` of the empty `cache` filled by one-shot compression from the prompt's LSE
        (``_runtime.press_prompt``: compress_prompt under the cache's scorer). Returns (output,
        the next `last`)."""
        p, new_last = self.project(x, pos)
        latent = isinstance(cache, _k.MlaLatentCache)
        return self.output(press_prompt(cache, layer, self.rows(p, latent), self.c.scale), latent), new_last


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = _linear(c.dim, c.ffn)
        self.w3 = _linear(c.dim, c.ffn)
        self.w2 = _linear(c.ffn, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = RMSNorm(c.dim, c.eps)
        self.attn = MLA(c)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), pos, mask)
        return x + self.mlp(self.ffn_norm(x))


class Model(nn.Module):
    """The quality model: ``Model()`` has random weights (as the C++ model before training),
    ``Model.load(path)`` the shipped ones. ``model(tokens)`` [B, T] int64 -> logits
    [B, T, vocab], full causal attention (or through the cache after ``kvevict.install``)."""

    def __init__(self, c: Optional[Config] = None):
        super().__init__()
        self.c = c = c or Config()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.eps)

    @classmethod
    def load(cls, path: Union[str, os.PathLike] = WEIGHTS, config: Optional[Config] = None) -> "Model":
        """A model with the weights at `path` (default: ``WEIGHTS``, the shipped weights),
        in fp32 (stored as fp16), in eval mode. Raises ValueError naming the first tensor whose
        count or shape does not match."""
        m = cls(config)
        m.load_weights(path)
        return m.eval()

    def load_weights(self, path: Union[str, os.PathLike]) -> None:
        """Loads a C++ ``kvq::save_weights`` file: the parameters as a list of
        fp16 tensors in ``named_parameters()`` order (``torch::save(std::vector<Tensor>)``, a
        TorchScript archive with parameters "0", "1", ...), converted to fp32."""
        with warnings.catch_warnings():
            # torch >= 2.10 deprecates torch.jit.load; the file is what C++ torch::save writes.
            warnings.filterwarnings("ignore", message=".*torch.jit.load.*", category=FutureWarning)
            archive = torch.jit.load(str(path), map_location="cpu")
        stored = dict(archive.named_parameters())
        tensors = [stored[str(i)] for i in range(len(stored))]
        params = list(self.named_parameters())
        if len(tensors) != len(params):
            raise ValueError(f"{path}: {len(tensors)} tensors, the model has {len(params)}")
        with torch.no_grad():
            for (name, p), t in zip(params, tensors):
                if t.shape != p.shape:
                    raise ValueError(f"{path}: tensor {name} has shape {list(t.shape)}, the model {list(p.shape)}")
                p.copy_(t.to(torch.float32))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.norm(x), self.embed.weight.t())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64 -> logits [B, T, vocab], full causal attention."""
        T = tokens.size(1)
        pos = torch.arange(T, dtype=torch.long, device=tokens.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, pos, mask)
        return self.head(x)

    def step(self, tokens: torch.Tensor, cache, state: DecodeState, observe: bool = True,
             evict: bool = True) -> torch.Tensor:
        """tokens [B, T] appended to `cache` (MlaCache or MlaLatentCache, built from
        ``expanded_options`` / ``latent_options``); each layer attends through the cache, then
        ``cache.evict(layer)`` (unless evict is False). `state` belongs to this cache's sequence.
        -> logits [B, T, vocab]."""
        c = self.c
        start, T = cache.seen_tokens(0), tokens.size(1)
        if len(state.last) != c.n_layers or start == 0:
            state.last = [None] * c.n_layers
        pos = torch.arange(start, start + T, dtype=torch.long, device=tokens.device)
        x = self.embed(tokens)
        for l, b in enumerate(self.blocks):
            a, state.last[l] = b.attn.cached(b.attn_norm(x), pos, cache, l, state.last[l], observe)
            x = x + a
            if evict:
                cache.evict(l)
            x = x + b.mlp(b.ffn_norm(x))
        return self.head(x)

    def prefill_compressed(self, tokens: torch.Tensor, cache, state: DecodeState) -> torch.Tensor:
        """A prompt [B, T] into an empty cache, each layer compressed once to its capacity by
        ``kvevict.compress_prompt`` under the cache's scorer. Later ``step`` calls continue at RoPE
        position T. -> logits [B, T, vocab] (exact: the prompt attends to every token)."""
        c = self.c
        T = tokens.size(1)
        state.last = [None] * c.n_layers
        pos = torch.arange(T, dtype=torch.long, device=tokens.device)
        x = self.embed(tokens)
        for l, b in enumerate(self.blocks):
            a, state.last[l] = b.attn.compressed(b.attn_norm(x), pos, cache, l)
            x = x + a
            x = x + b.mlp(b.ffn_norm(x))
        return self.head(x)

    def expanded_options(self, batch: int = 1) -> "_k.MlaCacheOptions":
        c = self.c
        return _k.MlaCacheOptions(c.n_layers, c.n_heads, qk_dim=c.qk_dim, v_dim=c.v_dim, batch_size=batch)

    def latent_options(self, batch: int = 1) -> "_k.MlaLatentCacheOptions":
        c = self.c
        return _k.MlaLatentCacheOptions(c.n_layers, c.n_heads, kv_lora_rank=c.kv_lora, qk_rope_dim=c.qk_rope,
                                        qk_nope_dim=c.qk_nope, batch_size=batch)

