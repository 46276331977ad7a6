"""The seed's call on a Hugging Face transformers DeepSeek-V3 model: install, then generate.

A random-initialised DeepseekV3ForCausalLM (small, so that it runs on a CPU in seconds; the
call is the same for a checkpoint from the hub), a prompt longer than the cache's capacity
(4 sinks + 4,096 heavy hitters + 512 recent = 4,612 tokens per layer), and greedy generate.

    python examples/python/hf_seed.py
"""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from kvevict.hf import install_kv_eviction, reset_eviction_scores

torch.manual_seed(0)
config = DeepseekV3Config(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,  # MLA: one per head
                          q_lora_rank=64, kv_lora_rank=64,
                          qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=8192)
model = DeepseekV3ForCausalLM(config).eval()

# The seed's call, unchanged:
handle = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)

prompt = torch.randint(0, config.vocab_size, (1, 5000))
with torch.no_grad():
    out = model.generate(prompt, max_new_tokens=32, do_sample=False)

stats, mem = handle.stats(), handle.memory()
print(f"generated {out.shape[1] - prompt.shape[1]} tokens after a {prompt.shape[1]}-token prompt")
print(f"kvevict: kept {stats['kept'][0]} of {stats['columns']} tokens per layer "
      f"(capacity {stats['capacity'][0]}), {stats['tokens_evicted']} evicted in {stats['eviction_events']} passes")
print(f"kvevict: cache {mem.cache_bytes:,} bytes; transformers' own cache would hold {mem.full_cache_bytes:,} "
      f"({mem.full_layout} layout)")
reset_eviction_scores(model)  # the seed's reset between independent generations
handle.remove()               # the model attends in full again

# transformers' own attention, under any implementation (eager needs num_key_value_heads to divide the heads)
logits = {}
for impl in ("eager", "sdpa"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        logits[impl] = model(prompt[:, :64]).logits
print(f"after remove(): eager and sdpa logits agree to {(logits['eager'] - logits['sdpa']).abs().max().item():.1e}")
