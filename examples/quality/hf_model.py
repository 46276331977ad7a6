"""The shipped quality model as a Hugging Face ``transformers.DeepseekV3ForCausalLM``.

``kvevict.models.Model`` (examples/quality/model.hpp in PyTorch) is DeepSeek-V3 attention plus
one addition, the token shift: token t's raw kv latent gets ``W_s x_{t-1}`` added before its
RMSNorm (x_{t-1}: the previous token's attention input, zeros at a sequence's first token).
Everything else maps onto transformers' DeepSeek-V3 one to one:

    embed                      -> model.embed_tokens (lm_head tied to it)
    blocks.i.attn_norm         -> model.layers.i.input_layernorm
    blocks.i.attn.wq_a / q_norm / wq_b -> self_attn.q_a_proj / q_a_layernorm / q_b_proj
    blocks.i.attn.wkv_a (+ wkv_s)      -> self_attn.kv_a_proj_with_mqa (a ShiftedKVProj)
    blocks.i.attn.kv_norm / wkv_b / wo -> self_attn.kv_a_layernorm / kv_b_proj / o_proj
    blocks.i.ffn_norm          -> model.layers.i.post_attention_layernorm
    blocks.i.mlp.w1 / w3 / w2  -> mlp.gate_proj / up_proj / down_proj (dense: first_k_dense_replace)
    norm                       -> model.norm

The attention modules stay ``DeepseekV3Attention``, so ``kvevict.hf.install_kv_eviction``
recognizes them; the token shift lives in ``kv_a_proj_with_mqa``, which every forward (the
module's own and the one kvevict installs) calls once per layer on the chunk's attention input.
It keeps the chunk's last input as the next chunk's x_{t-1}; a forward pre-hook on the decoder
clears that state when a sequence starts (no cache, or a cache with no columns yet).

    from hf_model import build_hf_model
    model = build_hf_model()          # the shipped weights (kvevict.models.WEIGHTS)
    model.generate(ids, max_new_tokens=4, do_sample=False)

Batches: every row's tokens must be real (no padding); the shift reads the previous column.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kvevict.models import BOS, WEIGHTS, Config, Model

__all__ = ["ShiftedKVProj", "hf_config", "build_hf_model", "default_weights", "from_kvevict_model"]


class ShiftedKVProj(nn.Linear):
    """``kv_a_proj_with_mqa`` with the token shift: y_t = W_a x_t + [W_s x_{t-1}, 0] (the shift
    only into the first ``kv_lora`` channels, the latent; the RoPE key's channels untouched).
    ``weight`` is W_a [kv_lora + rope, dim] (kvevict.hf reads its dtype and device), ``shift``
    is W_s [kv_lora, dim]. ``last`` [B, 1, dim] is the previous chunk's last input (None: the
    sequence starts here); ``reset()`` clears it."""

    def __init__(self, dim: int, kv_lora: int, rope: int):
        super().__init__(dim, kv_lora + rope, bias=False)
        self.kv_lora = kv_lora
        self.shift = nn.Linear(dim, kv_lora, bias=False)
        self.last: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        out = nn.functional.linear(x, self.weight)
        first = self.last
        if first is None or first.size(0) != B:
            first = x.new_zeros(B, 1, D)
        prev = torch.cat([first, x[:, : T - 1]], 1)
        lat = out[..., : self.kv_lora] + self.shift(prev)  # the same sum, in the same order, as MLA.project
        self.last = x[:, T - 1:].detach()
        return torch.cat([lat, out[..., self.kv_lora:]], -1)


def hf_config(c: Optional[Config] = None, attn_implementation: str = "eager") -> DeepseekV3Config:
    """The DeepseekV3Config of the quality model: every MLP dense, rotate-half RoPE (theta from
    ``c``), no attention biases, tied embeddings, BOS = 256, no EOS (answers are 4 tokens)."""
    c = c or Config()
    return DeepseekV3Config(
        vocab_size=c.vocab, hidden_size=c.dim, intermediate_size=c.ffn, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_heads, q_lora_rank=c.q_lora, kv_lora_rank=c.kv_lora,
        qk_rope_head_dim=c.qk_rope, qk_nope_head_dim=c.qk_nope, v_head_dim=c.v_dim,
        first_k_dense_replace=c.n_layers,  # every layer's MLP is the dense SwiGLU (no MoE)
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=c.ffn,
        hidden_act="silu", rms_norm_eps=c.eps, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        rope_interleave=False, attention_bias=False, tie_word_embeddings=True, max_position_embeddings=4096,
        bos_token_id=BOS, eos_token_id=None, pad_token_id=None, attn_implementation=attn_implementation)


def _reset_hook(model: DeepseekV3ForCausalLM):
    projs = [layer.self_attn.kv_a_proj_with_mqa for layer in model.model.layers]

    def hook(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            for p in projs:
                p.reset()
        return None

    return model.model.register_forward_pre_hook(hook, with_kwargs=True)


def from_kvevict_model(src: Model, attn_implementation: str = "eager") -> DeepseekV3ForCausalLM:
    """A DeepseekV3ForCausalLM with `src`'s weights (copied), fp32, eval mode."""
    c = src.c
    if not c.smear:
        raise ValueError("hf_model: the model has no token shift (smear=False); use a plain DeepseekV3ForCausalLM")
    model = DeepseekV3ForCausalLM(hf_config(c, attn_implementation)).to(torch.float32)
    with torch.no_grad():
        m = model.model
        m.embed_tokens.weight.copy_(src.embed.weight)
        m.norm.weight.copy_(src.norm.weight)
        for layer, b in zip(m.layers, src.blocks):
            a, s = layer.self_attn, b.attn
            proj = ShiftedKVProj(c.dim, c.kv_lora, c.qk_rope)
            proj.weight.copy_(s.wkv_a.weight)
            proj.shift.weight.copy_(s.wkv_s.weight)
            a.kv_a_proj_with_mqa = proj
            for dst, w in ((a.q_a_proj, s.wq_a), (a.q_a_layernorm, s.q_norm), (a.q_b_proj, s.wq_b),
                           (a.kv_a_layernorm, s.kv_norm), (a.kv_b_proj, s.wkv_b), (a.o_proj, s.wo),
                           (layer.input_layernorm, b.attn_norm), (layer.post_attention_layernorm, b.ffn_norm),
                           (layer.mlp.gate_proj, b.mlp.w1), (layer.mlp.up_proj, b.mlp.w3),
                           (layer.mlp.down_proj, b.mlp.w2)):
                dst.weight.copy_(w.weight)
            a.kv_a_layernorm.variance_epsilon = c.eps
            a.q_a_layernorm.variance_epsilon = c.eps
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != m.embed_tokens.weight.data_ptr():
        with torch.no_grad():
            model.lm_head.weight.copy_(m.embed_tokens.weight)
    model._kvq_reset_hook = _reset_hook(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None  # rows are unpadded: pass attention_mask=ones (or none)
    model.generation_config.bos_token_id = BOS
    return model.eval()


def default_weights() -> str:
    """``kvevict.models.WEIGHTS`` (the weights installed with the package) where that file exists,
    else the repository's copy beside this file (examples/quality/weights.pt): the same file."""
    if os.path.exists(WEIGHTS):
        return WEIGHTS
    return os.path.join(os.path.dirname(os.path.realpath(__file__)), "weights.pt")


def build_hf_model(weights: Optional[str] = None, attn_implementation: str = "eager") -> DeepseekV3ForCausalLM:
    """The shipped quality model (``kvevict.models.Model.load(weights)``, default
    ``default_weights()``) as a DeepseekV3ForCausalLM."""
    return from_kvevict_model(Model.load(weights or default_weights()), attn_implementation)
