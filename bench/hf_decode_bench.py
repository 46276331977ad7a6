#!/usr/bin/env python3
"""One decode step of a DeepSeek-V3-sized MLA layer in transformers, side by side: transformers'
own DynamicCache against kvevict installed through ``kvevict.hf.install_kv_eviction``.

The layer: transformers' ``DeepseekV3Attention`` from a ``DeepseekV3Config`` with hidden 7168,
128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128 (random init),
wrapped in a one-layer ``DeepseekV3ForCausalLM`` (dense MLP of intermediate 256, vocab 256) so
that every variant runs through transformers' own model code. Two times are taken per step:

- step: the whole one-layer model forward for one new token (embedding, norms, attention, the
  small MLP, lm_head, transformers' mask and cache bookkeeping, kvevict's decoder hooks);
- attn: the attention module's forward alone (forward pre/post hooks on ``self_attn``).

Variants, all on the same weights (the models share their parameter tensors):

- a_dynamic: transformers' ``DynamicCache`` (latent layout since 5.15: c_kv 512 + k_pe 64 per
  token) and its own attention, which re-expands every cached row through ``kv_b_proj`` each
  step. Filled with ``DynamicCache.update`` (random latent rows), cropped back to the context
  after each step (outside the timing).
- b_kvevict: ``install_kv_eviction(budget=4096, n_sink=4, n_recent=512)``, latent layout,
  capacity 4,612, no tier.
- c_kvevict_tier: the same with a host tier of ``tier_tokens = context`` and recall every step
  with the defaults (recall_tokens 3, recall_rescore 256, tier_page_size 64, head_mean).
- d_direct: the same absorbed attention without transformers or the adapter: q projections,
  RMSNorm and RoPE written here on the module's weight tensors, ``MlaLatentCache.update``,
  ``attend_absorbed``, ``evict``, W_UV and o_proj. Its step is its attention (no model around it).

Filling the caches. Every variant first runs one real forward of one token (position 0); then
context - 1 random latent rows (c_kv ~ N(0, 1), i.e. RMS 1 as after kv_a_layernorm with weight 1;
k_pe ~ N(0, 1)) go in. The same rows go into all four caches. kvevict's caches are filled
*directly* through the kvevict cache API in chunks of --fill-chunk: ``update`` (+ ``recall_absorbed``
with the tier) + ``attend_absorbed`` of one random query per chunk (observe=True, so the H2O
scores are not all zero) + ``evict`` -- the adapter's own per-chunk sequence, without the q/kv
projections of 32K real tokens (a real chunked prefill of 32K tokens costs ~0.4 GFLOP of
projections per token plus the chunks' attention: tens of minutes on 2 cores). The adapter's
column counter is advanced through its own bookkeeping (``KVEvictCache._begin`` / ``_end``), so
the decode step sees position = context, as transformers would after a prefill.

Check: where context + 1 <= capacity nothing is evicted, so b, c and d hold exactly the rows
a_dynamic holds and their first decode step must give its attention output: the largest
|difference| relative to max |a| is printed (and written to the CSV).

Timing: one untimed step per variant (the check), then --reps rounds; each round steps every
variant once, in a rotated order (interleaved), a_dynamic only in its first --reps-dynamic
rounds (several seconds a step at 32K on CPU). Medians. kvevict's caches keep appending (one
token a step, evicting one at capacity), so their context grows by at most reps + 1 tokens.

Cache bytes: a_dynamic: the layer's key and value tensors (sum of nbytes); kvevict:
``stats().bytes_allocated`` (device buffers: capacity + evict_every slots, scores, positions),
and ``stats().tier_bytes`` for the host tier.

Usage:
    python bench/hf_decode_bench.py                              # 1K, 4K, 16K, 32K
    python bench/hf_decode_bench.py --contexts 1024 --reps 1      # smoke, well under a minute
Writes --out/hf_decode.csv, --out/hf_decode.gp (gnuplot) and --out/hf_decode.png (if gnuplot is
on the PATH), prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import kvevict
from kvevict.hf import install_kv_eviction

import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

VARIANTS = ("a_dynamic", "b_kvevict", "c_kvevict_tier", "d_direct")
LABELS = {"a_dynamic": "(a) DynamicCache", "b_kvevict": "(b) kvevict hf", "c_kvevict_tier": "(c) kvevict hf + tier",
          "d_direct": "(d) kvevict direct"}
BUDGET, N_SINK, N_RECENT = 4096, 4, 512
CAPACITY = N_SINK + BUDGET + N_RECENT


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384,32768", help="comma-separated context lengths (tokens)")
    p.add_argument("--reps", type=int, default=9, help="timed steps per variant and context (kvevict variants)")
    p.add_argument("--reps-dynamic", type=int, default=3, help="at most this many timed steps for a_dynamic")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (CPU; 1: on a shared 2-core machine two threads wait on each other)")
    p.add_argument("--fill-chunk", type=int, default=512, help="rows per kvevict fill chunk")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--no-write", action="store_true", help="print the table only (no CSV / plot)")
    a = p.parse_args()
    a.contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or not a.contexts or min(a.contexts) < 2 or a.reps < 1 or a.reps_dynamic < 0:
        p.error(f"bad --variants {bad} / --contexts / --reps")
    return a


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model(dtype, dev):
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=7168, intermediate_size=256, moe_intermediate_size=256,
                           num_hidden_layers=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                           first_k_dense_replace=1, max_position_embeddings=131072)
    model = DeepseekV3ForCausalLM(cfg).eval().to(device=dev, dtype=dtype)
    return cfg, model


def share_weights_copy(model):
    """A second model object over the same parameter tensors (buffers copied: RoPE's inv_freq)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


class AttnTimer:
    """Forward pre/post hooks on a self_attn module: the time of its last forward and its output."""

    def __init__(self, module, dev):
        self.dev, self.t0, self.dt, self.out = dev, 0.0, 0.0, None
        self.h = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, m, args):
        sync(self.dev)
        self.t0 = time.perf_counter()

    def _post(self, m, args, out):
        sync(self.dev)
        self.dt = time.perf_counter() - self.t0
        self.out = out[0] if isinstance(out, tuple) else out


class Direct:
    """(d): the absorbed MLA decode step on the attention module's weight tensors, no transformers code."""

    def __init__(self, attn, rotary, dtype, dev):
        self.H, self.nope, self.rope, self.r, self.v = (attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                                                         attn.kv_lora_rank, attn.v_head_dim)
        self.wqa, self.wqb = attn.q_a_proj.weight, attn.q_b_proj.weight
        self.nq, self.eq = attn.q_a_layernorm.weight, attn.q_a_layernorm.variance_epsilon
        self.wkva = attn.kv_a_proj_with_mqa.weight
        self.nkv, self.ekv = attn.kv_a_layernorm.weight, attn.kv_a_layernorm.variance_epsilon
        w = attn.kv_b_proj.weight.view(self.H, self.nope + self.v, self.r)
        self.w_uk, self.w_uv_t = w[:, : self.nope], w[:, self.nope:].transpose(1, 2)
        self.wo = attn.o_proj.weight
        self.scale = float(attn.scaling)
        self.inv_freq = rotary.inv_freq.float().to(dev)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.interleave = bool(getattr(attn.config, "rope_interleave", False))
        opts = kvevict.MlaLatentCacheOptions(1, self.H, kv_lora_rank=self.r, qk_rope_dim=self.rope,
                                             qk_nope_dim=self.nope, batch_size=1, dtype=dtype, device=dev)
        ev = kvevict.EvictionOptions(BUDGET, n_sink=N_SINK, n_recent=N_RECENT)
        self.kv = kvevict.MlaLatentCache(opts, ev, kvevict.make_scorer("h2o"))
        self.pos = 0

    @staticmethod
    def _rms(x, w, eps):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def _rope(self, x, cos, sin):
        if self.interleave:  # DeepSeek's pairs (x0, x1), (x2, x3) ..., written out de-interleaved
            c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    def step(self, h):
        """h: [1, 1, hidden] (after input_layernorm) of the token at position self.pos -> [1, 1, hidden]."""
        H = self.H
        q = F.linear(self._rms(F.linear(h, self.wqa), self.nq, self.eq), self.wqb)
        q = q.view(1, 1, H, self.nope + self.rope).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        ckv, kpe = torch.split(F.linear(h, self.wkva), [self.r, self.rope], dim=-1)
        ckv = self._rms(ckv, self.nkv, self.ekv)
        freqs = float(self.pos) * self.inv_freq
        emb = torch.cat([freqs, freqs])
        cos, sin = (emb.cos() * self.rope_scale).to(h.dtype), (emb.sin() * self.rope_scale).to(h.dtype)
        q_pe = self._rope(q_pe, cos, sin).contiguous()
        kpe = self._rope(kpe, cos, sin)
        self.kv.update(0, ckv, kpe)
        q_a = torch.matmul(q_nope, self.w_uk)  # [1, H, 1, r]
        out = kvevict.attend_absorbed(q_a, q_pe, self.kv, 0, self.scale)
        self.kv.evict(0)
        out = torch.matmul(out, self.w_uv_t)  # [1, H, 1, v]
        self.pos += 1
        return F.linear(out.transpose(1, 2).reshape(1, 1, H * self.v), self.wo)


def fill_kvevict(kv, ckv, kpe, chunk, scale, tier, gen):
    """Appends ckv [1, n, r] / kpe [1, n, rope] to layer 0 chunk by chunk as the adapter's chunked
    prefill does (update, recall with a tier, attend observing, evict), with one random query per
    chunk instead of the chunk's own queries."""
    H = kv.options.num_heads
    dt, dev = ckv.dtype, ckv.device
    for s in range(0, ckv.size(1), chunk):
        e = min(ckv.size(1), s + chunk)
        kv.update(0, ckv[:, s:e], kpe[:, s:e])
        qa = (torch.randn(1, H, 1, ckv.size(2), generator=gen) * 0.2).to(dev, dt)
        qb = (torch.randn(1, H, 1, kpe.size(2), generator=gen) * 0.8).to(dev, dt)
        if tier:
            kv.recall_absorbed(0, qa, qb, scale, 3, 256)
        kvevict.attend_absorbed(qa, qb, kv, 0, scale, observe=True)
        kv.evict(0)


def dyn_bytes(cache):
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def run_context(S, args, models, dev, dtype, gen):
    """Builds the four states for context S, times them interleaved, returns {variant: row dict}."""
    cfg = models["cfg"]
    r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    tok0 = torch.tensor([[1]], device=dev)
    tok = torch.tensor([[2]], device=dev)
    ckv = torch.randn(1, S - 1, r, generator=gen).to(dev, dtype)
    kpe = torch.randn(1, S - 1, rope, generator=gen).to(dev, dtype)
    scale = float(models["a"].model.layers[0].self_attn.scaling)
    state, step_fn, timers = {}, {}, {}
    with torch.inference_mode():
        if "a_dynamic" in args.variants:
            m = models["a"]
            dyn = DynamicCache(config=cfg)
            m(input_ids=tok0, cache=dyn, use_cache=True)
            dyn.update(ckv.unsqueeze(1), kpe.unsqueeze(1), 0)
            assert dyn.get_seq_length() == S

            def step_a(m=m, dyn=dyn):
                out = m(input_ids=tok, cache=dyn, use_cache=True)
                return out.logits

            def after_a(dyn=dyn):
                dyn.crop(-1)  # back to S rows (outside the timing)

            state["a_dynamic"] = dyn
            step_fn["a_dynamic"] = (step_a, after_a)
        for v, key in (("b_kvevict", "b"), ("c_kvevict_tier", "c")):
            if v not in args.variants:
                continue
            m, handle = models[key], models[key + "_handle"]
            cache = handle.new_cache()
            m(input_ids=tok0, cache=cache, use_cache=True)
            # S - 1 more columns, counted by the adapter's own bookkeeping, rows filled directly
            cache._begin(S - 1, 1, None)
            fill_kvevict(cache.kv, ckv, kpe, args.fill_chunk, scale, v == "c_kvevict_tier", gen)
            cache._layers_done = handle.geometry.num_layers
            cache._end()
            assert cache.get_seq_length() == S

            def step_b(m=m, cache=cache):
                return m(input_ids=tok, cache=cache, use_cache=True).logits

            state[v] = cache
            step_fn[v] = (step_b, None)
        if "d_direct" in args.variants:
            ma = models["a"]
            d = Direct(ma.model.layers[0].self_attn, ma.model.rotary_emb, dtype, dev)
            norm = ma.model.layers[0].input_layernorm
            h0 = norm(ma.model.embed_tokens(tok0))
            h = norm(ma.model.embed_tokens(tok))
            d.step(h0)
            fill_kvevict(d.kv, ckv, kpe, args.fill_chunk, scale, False, gen)
            d.pos = S

            def step_d(d=d, h=h):
                return d.step(h)

            state["d_direct"] = d
            step_fn["d_direct"] = (step_d, None)
        del ckv, kpe

        # warm-up step = the check step
        first = {}
        for v in args.variants:
            fn, after = step_fn[v]
            tm = models.get(v + "_timer")
            fn_out = fn()
            sync(dev)
            first[v] = (tm.out if tm is not None else fn_out).float().cpu()
            if after:
                after()
        check = {}
        if "a_dynamic" in first and S + 1 <= CAPACITY:
            ref = first["a_dynamic"]
            for v in args.variants:
                if v != "a_dynamic":
                    check[v] = float((first[v] - ref).abs().max() / ref.abs().max())

        steps = {v: [] for v in args.variants}
        attns = {v: [] for v in args.variants}
        order = list(args.variants)
        for rep in range(args.reps):
            rot = order[rep % len(order):] + order[: rep % len(order)]
            for v in rot:
                if v == "a_dynamic" and rep >= args.reps_dynamic:
                    continue
                fn, after = step_fn[v]
                tm = models.get(v + "_timer")
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                dt = time.perf_counter() - t0
                steps[v].append(dt)
                attns[v].append(tm.dt if tm is not None else dt)
                if after:
                    after()

    rows = {}
    for v in args.variants:
        if not steps[v]:
            continue
        if v == "a_dynamic":
            dyn = state[v]
            b, tb, kept = dyn_bytes(dyn), 0, dyn.get_seq_length()
        else:
            kv = state[v].kv
            st = kv.stats()
            b, tb, kept = st.bytes_allocated, st.tier_bytes, kv.size(0)
        rows[v] = dict(context=S, variant=v, reps=len(steps[v]),
                       step_ms_median=1e3 * statistics.median(steps[v]), step_ms_min=1e3 * min(steps[v]),
                       attn_ms_median=1e3 * statistics.median(attns[v]), attn_ms_min=1e3 * min(attns[v]),
                       cache_bytes=b, tier_bytes=tb, kept_tokens=kept,
                       check_rel_diff=("" if v not in check else f"{check[v]:.2e}"))
    state.clear()
    return rows


GNUPLOT = r"""# bench/hf_decode_bench.py writes this next to hf_decode.csv; redraw with: gnuplot hf_decode.gp (in this folder)
set datafile separator comma
set terminal pngcairo size 1500,600 font ",10" noenhanced
set output "hf_decode.png"
meta = system("sed -n 2p hf_decode.csv | cut -c3-")
set multiplot layout 1,2 title "kvevict.hf: one decode step of a DeepSeek-V3-sized MLA layer (capacity 4612)\n".meta font ",9"
set logscale x 2
set logscale y 10
set xtics (1024, 2048, 4096, 8192, 16384, 32768)
set xlabel "context (tokens)"
set key below
set grid
set xrange [700:48000]
# the CSV's rows are by variant, then context: one variant's rows are consecutive, 1/0 elsewhere
col(v, c) = (strcol(2) eq v ? column(c) : 1/0)
do for [panel = 1:2] {
  c = (panel == 1 ? 4 : 6)
  set title (panel == 1 ? "whole 1-layer model forward (d: its attention alone)" : "attention module forward")
  set ylabel (panel == 1 ? "ms per decode step (median)" : "ms per attention forward (median)")
  plot "hf_decode.csv" using 1:(col("a_dynamic", c)) with linespoints lw 2 pt 7 title "(a) DynamicCache", \
       "hf_decode.csv" using 1:(col("b_kvevict", c)) with linespoints lw 2 pt 7 title "(b) kvevict hf", \
       "hf_decode.csv" using 1:(col("c_kvevict_tier", c)) with linespoints lw 2 pt 7 title "(c) kvevict hf + tier", \
       "hf_decode.csv" using 1:(col("d_direct", c)) with linespoints lw 2 pt 7 title "(d) kvevict direct (no transformers)"
}
unset multiplot
"""

FIELDS = ["context", "variant", "reps", "step_ms_median", "step_ms_min", "attn_ms_median", "attn_ms_min",
          "cache_bytes", "tier_bytes", "kept_tokens", "check_rel_diff"]


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    args = parse_args()
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    started = datetime.datetime.now().astimezone()
    load0 = os.getloadavg()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])

    t = time.time()
    cfg, model = build_model(dtype, dev)
    models = {"cfg": cfg, "a": model}
    if "b_kvevict" in args.variants:
        models["b"] = share_weights_copy(model)
        models["b_handle"] = install_kv_eviction(models["b"], BUDGET, N_SINK, N_RECENT)
    if "c_kvevict_tier" in args.variants:
        models["c"] = share_weights_copy(model)
        models["c_handle"] = install_kv_eviction(models["c"], BUDGET, N_SINK, N_RECENT,
                                                 tier_tokens=max(args.contexts))
    for v, key in (("a_dynamic", "a"), ("b_kvevict", "b"), ("c_kvevict_tier", "c")):
        if v in args.variants:
            models[v + "_timer"] = AttnTimer(models[key].model.layers[0].self_attn, dev)
    print(f"# model built in {time.time() - t:.1f} s: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters, {args.dtype} on {dev}, attn_implementation={model.config._attn_implementation}, "
          f"threads={torch.get_num_threads()}", flush=True)

    rows = []
    for S in args.contexts:
        t = time.time()
        if "c_kvevict_tier" in args.variants:
            models["c_handle"].config.tier_tokens = S  # the tier holds the whole context (read at the cache's build)
        res = run_context(S, args, models, dev, dtype, gen)
        rows.extend(res[v] for v in args.variants if v in res)
        print(f"# context {S}: {time.time() - t:.1f} s; " +
              ", ".join(f"{v} {r['step_ms_median']:.1f} ms" for v, r in res.items()), flush=True)
    load1 = os.getloadavg()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is KiB on Linux)
    ended = datetime.datetime.now().astimezone()

    by = {(r["context"], r["variant"]): r for r in rows}
    print()
    print(f"kvevict.hf decode step, one DeepSeek-V3-sized MLA layer ({args.dtype}, {dev}, {args.threads} threads); "
          f"capacity {CAPACITY} (budget {BUDGET}, n_sink {N_SINK}, n_recent {N_RECENT})")
    print(f"{started:%Y-%m-%d %H:%M:%S %Z} .. {ended:%H:%M:%S}; load average at start {load0[0]:.2f} "
          f"{load0[1]:.2f} {load0[2]:.2f}, at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; peak RSS {rss:.1f} GiB; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, kvevict {kvevict.__version__}")
    print()
    print("| context | variant | reps | step ms | attn ms | a / this (step) | a / this (attn) | this / d (attn) "
          "| cache MiB | tier MiB | kept | check |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        a = by.get((r["context"], "a_dynamic"))
        d = by.get((r["context"], "d_direct"))
        sa = f"{a['step_ms_median'] / r['step_ms_median']:.1f}x" if a and r["variant"] != "a_dynamic" else ""
        aa = f"{a['attn_ms_median'] / r['attn_ms_median']:.1f}x" if a and r["variant"] != "a_dynamic" else ""
        od = (f"{r['attn_ms_median'] / d['attn_ms_median']:.2f}" if d and r["variant"] in ("b_kvevict", "c_kvevict_tier")
              else "")
        print(f"| {r['context']} | {LABELS[r['variant']]} | {r['reps']} | {r['step_ms_median']:.1f} | "
              f"{r['attn_ms_median']:.1f} | {sa} | {aa} | {od} | {mib(r['cache_bytes'])} | "
              f"{mib(r['tier_bytes']) if r['tier_bytes'] else ''} | {r['kept_tokens']} | {r['check_rel_diff']} |")
    print()
    print("step: the whole one-layer model forward (d: its attention alone, no model); attn: the attention "
          "module's forward. check: max |x - a| / max |a| of the first step's attention output where nothing "
          "is evicted (context + 1 <= capacity).")

    if args.no_write:
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "hf_decode.csv")
    with open(path, "w", newline="") as f:
        f.write(f"# {cmd}\n# {started.isoformat(timespec='seconds')} .. {ended.isoformat(timespec='seconds')}; "
                f"load average start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, end {load1[0]:.2f} {load1[1]:.2f} "
                f"{load1[2]:.2f}; peak RSS {rss:.1f} GiB; {platform.node()} {os.cpu_count()} cpus, {args.threads} threads, {args.dtype} on {dev}; "
                f"torch {torch.__version__}, transformers {transformers.__version__}\n")
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in sorted(rows, key=lambda r: (VARIANTS.index(r["variant"]), r["context"])):
            w.writerow({k: (f"{r[k]:.3f}" if isinstance(r[k], float) else r[k]) for k in FIELDS})
    gp = os.path.join(args.out, "hf_decode.gp")
    with open(gp, "w") as f:
        f.write(GNUPLOT)
    print(f"\nwrote {path}, {gp}")
    if shutil.which("gnuplot"):
        subprocess.run(["gnuplot", "hf_decode.gp"], cwd=args.out, check=True)
        print(f"wrote {os.path.join(args.out, 'hf_decode.png')}")
    else:
        print("gnuplot not found: no plot (gnuplot hf_decode.gp in that folder draws it)")


if __name__ == "__main__":
    main()
