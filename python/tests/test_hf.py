"""kvevict.hf against transformers' own DeepSeek-V2/V3 code: tiny random-initialised configs built
here, CPU, no downloads. The oracles are transformers' modules (DynamicCache generate, and the
decoder layers run with a per-layer mask), never kvevict's code."""

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

import kvevict  # noqa: E402
from kvevict import hf  # noqa: E402
from kvevict.hf import install_kv_eviction, reset_eviction_scores  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOL = 1e-4
VOCAB = 97
LATENT_CACHE = hf._CROP_COUNTS  # transformers >= 5.15 caches the latent


def make_model(family="v3", attn="eager", layers=2, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                  kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                  max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**common, attn_implementation=attn))
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**common, attn_implementation=attn))
    return model.to(dtype).eval()


def padded_batch(seed=1, lengths=(12, 8, 5)):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, T - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def gen(model, ids, mask, **kw):
    with torch.no_grad():
        kw = {"do_sample": False, "pad_token_id": 0, **kw}
        return model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **kw)


def assert_same_generation(ref, out):
    assert torch.equal(ref.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff < TOL, diff


# ---- 100% budget: the same tokens and logits as transformers' DynamicCache --------------------------
@pytest.mark.parametrize("family", ["v3", "v2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", ["latent", "expanded"])
def test_full_budget_equals_dynamic_cache_padded_batch(family, attn, layout):
    model = make_model(family, attn)
    ids, mask = padded_batch()
    ref = gen(model, ids, mask, max_new_tokens=8)
    assert isinstance(ref.past_key_values, DynamicCache)
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512, layout=layout)
    out = gen(model, ids, mask, max_new_tokens=8)
    assert isinstance(out.past_key_values, hf.KVEvictCache)
    assert_same_generation(ref, out)
    # pads are never stored: row r holds its real tokens only, positions 0..n-1
    seen = ids.size(1) + 8 - 1
    for layer in range(2):
        p = h.positions(layer)
        for r, n in enumerate((12, 8, 5)):
            kept = p[r][p[r] >= 0]
            assert kept.tolist() == list(range(n + 7)), (layer, r)
    assert out.past_key_values.get_seq_length() == seen
    h.remove()


def test_sampling_eos_and_max_new_tokens_match():
    model = make_model()
    ids, mask = padded_batch(seed=3)
    torch.manual_seed(7)
    ref = gen(model, ids, mask, max_new_tokens=12)
    eos = int(ref.sequences[0, ids.size(1) + 3])  # a token row 0 generates: generation stops there
    torch.manual_seed(11)
    with torch.no_grad():
        ref_s = model.generate(ids, attention_mask=mask, do_sample=True, top_k=20, max_new_tokens=12, pad_token_id=0,
                               eos_token_id=eos)
    install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    torch.manual_seed(11)
    with torch.no_grad():
        out_s = model.generate(ids, attention_mask=mask, do_sample=True, top_k=20, max_new_tokens=12, pad_token_id=0,
                               eos_token_id=eos)
    assert torch.equal(ref_s, out_s)
    out = gen(model, ids, mask, max_new_tokens=12, eos_token_id=eos)
    row0 = out.sequences[0, ids.size(1):].tolist()
    assert eos in row0 and all(t == 0 for t in row0[row0.index(eos) + 1:])  # row 0 stopped at eos
    model.__dict__["_kvevict_handle"].remove()
    ref2 = gen(model, ids, mask, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(ref2.sequences, out.sequences)


def test_continue_conversation_with_returned_cache():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    turn2 = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))

    def two_turns():
        a = gen(model, ids, None, max_new_tokens=5)
        ids2 = torch.cat([a.sequences, turn2], 1)
        b = gen(model, ids2, None, max_new_tokens=5, past_key_values=a.past_key_values)
        return a, b

    ref_a, ref_b = two_turns()
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    a, b = two_turns()
    assert isinstance(b.past_key_values, hf.KVEvictCache) and b.past_key_values is a.past_key_values
    assert_same_generation(ref_a, a)
    assert_same_generation(ref_b, b)
    assert h.stats()["columns"] == b.sequences.size(1) - 1


def test_prompt_lookup_at_a_full_budget_crops_rejected_drafts_and_equals_greedy():
    model = make_model()
    base = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(9))
    ids = torch.cat([base, base, base[:, :4]], 1)  # repeats: prompt lookup proposes drafts
    kw = dict(max_new_tokens=16, prompt_lookup_num_tokens=3)
    ref = gen(model, ids, None, **kw)
    plain = gen(model, ids, None, max_new_tokens=16)
    assert torch.equal(ref.sequences, plain.sequences)  # speculation never changes greedy output
    calls = []
    orig = hf.KVEvictCache.crop

    def spy(self, n):
        calls.append(n)
        return orig(self, n)

    hf.KVEvictCache.crop = spy
    try:
        install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
        out = gen(model, ids, None, **kw)
    finally:
        hf.KVEvictCache.crop = orig
    assert torch.equal(ref.sequences, out.sequences)
    assert any(n < 0 for n in calls), calls  # some draft was rejected and cropped


def test_crop_equals_dynamic_cache_crop_then_forward():
    model = make_model()
    ids, mask = padded_batch(seed=4, lengths=(9, 6))
    nxt = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(1))

    def run(cache):
        with torch.no_grad():
            model(ids, attention_mask=mask, past_key_values=cache)
            m2 = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
            model(nxt, attention_mask=m2, past_key_values=cache)
            cache.crop(-2)  # drop the last two columns
            m3 = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
            return model(nxt[:, 2:], attention_mask=m3, past_key_values=cache).logits

    ref = run(DynamicCache(config=model.config))
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    c = h.new_cache()
    out = run(c)
    assert (ref - out).abs().max().item() < TOL
    assert c.get_seq_length() == ids.size(1) + 2


def test_beams_and_other_caches_are_refused():
    model = make_model()
    ids, mask = padded_batch()
    install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    with pytest.raises(ValueError, match="beam"):
        model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=3, pad_token_id=0)
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=3, pad_token_id=0)


# ---- an oracle that does not use kvevict: transformers' decoder layers, per-layer masks ---------------
def masked_reference_logits(model, ids, visible):
    """Logits [N, vocab] of the full sequence ids [1, N] through transformers' own modules, where
    layer l's query row j sees exactly the positions visible[l][j] (a set)."""
    N = ids.size(1)
    dec = model.model
    pos = torch.arange(N).unsqueeze(0)
    with torch.no_grad():
        h = dec.embed_tokens(ids)
        pe = dec.rotary_emb(h, pos)
        for l, layer in enumerate(dec.layers):
            m = torch.full((1, 1, N, N), float("-inf"))
            for j in range(N):
                m[0, 0, j, sorted(visible[l][j])] = 0.0
            h = layer(h, attention_mask=m, position_ids=pos, position_embeddings=pe)
            if isinstance(h, tuple):
                h = h[0]
        return model.lm_head(dec.norm(h))[0]


@pytest.mark.parametrize("layout", ["latent", "expanded"])
def test_decode_logits_equal_masked_oracle(layout):
    model = make_model(attn="eager", layers=3)
    oracle = copy.deepcopy(model)
    P, steps = 24, 40
    ids = torch.randint(3, VOCAB, (1, P), generator=torch.Generator().manual_seed(2))
    h = install_kv_eviction(model, budget=6, n_sink=2, n_recent=4, layout=layout)  # capacity 12
    cache = h.new_cache()
    L = 3
    visible = [[set(range(j + 1)) for j in range(P)] for _ in range(L)]  # the prompt: causal, one chunk
    seq = ids
    logits = []
    with torch.no_grad():
        out = model(ids, past_key_values=cache).logits[:, -1]
        for t in range(steps):
            kept = [set(h.positions(l)[0][h.positions(l)[0] >= 0].tolist()) for l in range(L)]
            for l in range(L):
                assert len(kept[l]) <= 12
            nxt = out.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            j = seq.size(1) - 1
            for l in range(L):
                visible[l].append(kept[l] | {j})
            out = model(nxt, past_key_values=cache).logits[:, -1]
            logits.append(out[0])
    ref = masked_reference_logits(oracle, seq, visible)
    got = torch.stack(logits)
    want = ref[P:]
    assert (got - want).abs().max().item() < TOL
    # eviction did happen, and positions kept are real positions (not renumbered)
    assert h.stats()["tokens_evicted"] > 0
    assert max(h.positions(0)[0].tolist()) == seq.size(1) - 1


def test_capacity_and_flat_memory_over_2000_steps():
    model = make_model(layers=2)
    h = install_kv_eviction(model, budget=16, n_sink=4, n_recent=12)  # capacity 32
    cache = h.new_cache()
    tok = torch.tensor([[5]])
    sizes = set()
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 40)), past_key_values=cache)
        for t in range(2000):
            logits = model(tok, past_key_values=cache).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            for l in range(2):
                assert cache.kv.size(l, 0) <= 32
            if t >= 10:
                sizes.add(cache.kv.stats().bytes_allocated)
    assert len(sizes) == 1, sizes
    assert cache.get_seq_length() == 2040
    mem = h.memory()
    assert mem.cache_bytes == sizes.pop() and mem.full_cache_bytes > mem.cache_bytes


# ---- the options that keep answers ----------------------------------------------------------------
def test_tier_recall_chunked_prefill_per_layer_budgets_at_full_budget():
    model = make_model()
    ids, mask = padded_batch(lengths=(20, 13, 7))
    ref = gen(model, ids, mask, max_new_tokens=6)
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512, tier_tokens=64, tier_page_size=4,
                            recall_rescore=8, prefill_chunk=6, layer_budgets=[4096, 2048], evict_every=2)
    out = gen(model, ids, mask, max_new_tokens=6)
    assert_same_generation(ref, out)
    assert h.stats()["capacity"] == [4612, 2564]


def test_tier_recall_at_small_budget_recalls():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(8))
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=6, tier_tokens=256, tier_page_size=4,
                            recall_tokens=2, recall_rescore=8, tier_scoring="per_head")
    gen(model, ids, None, max_new_tokens=12)
    s = h.stats()
    assert s["tier_tokens"] > 0 and s["tier_recalled"] > 0
    assert all(k <= 16 for k in s["kept"])
    assert h.memory().tier_bytes > 0


def test_scorers_and_evict_every_reach_the_cache():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(8))
    for scorer in ("h2o", "mean", "tova", kvevict.DecayedAttention(0.5)):
        h = install_kv_eviction(model, budget=6, n_sink=2, n_recent=4, scorer=scorer, evict_every=3)
        gen(model, ids, None, max_new_tokens=5)
        assert all(k <= 12 + 3 - 1 for k in h.stats()["kept"])
        h.remove()


def test_press_snapkv_compresses_the_prompt_and_warns_on_a_long_window():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    ref = gen(model, ids, None, max_new_tokens=4)
    with hf.press(model, budget=4096, n_sink=4, n_recent=512, window=8, kernel=3) as h:
        out = gen(model, ids, None, max_new_tokens=4)  # the prompt fits: nothing dropped
    assert_same_generation(ref, out)
    assert "_kvevict_handle" not in model.__dict__
    with pytest.warns(UserWarning, match="window"):
        with hf.press(model, budget=8, n_sink=2, n_recent=6, window=16, kernel=3) as h:
            gen(model, ids, None, max_new_tokens=4)
            assert h.stats()["kept"][0] <= 16
    with hf.press(model, budget=8, n_sink=2, n_recent=8, window=8, kernel=3) as h:
        gen(model, ids, None, max_new_tokens=2)
        s = h.stats()
        assert s["kept"][0] == 18 and s["columns"] == 41
        # compress_prompt keeps the prompt positions (docs/cpp-guide.md, "Long prompts"): the decoded token is at 40,
        # and the 40 - 18 dropped prompt tokens of each layer count as evicted
        assert h.positions(0)[0].max().item() == 40
        assert s["tokens_evicted"] >= (40 - 18) * len(s["kept"])


# ---- errors, and what install changes ---------------------------------------------------------------
def test_bad_input_is_refused_and_changes_nothing():
    model = make_model()
    keys = list(model.state_dict().keys())
    attn = model.model.layers[0].self_attn
    for kw, exc, text in [(dict(budget=-1), ValueError, "budget"), (dict(n_recent=2.5), TypeError, "n_recent"),
                          (dict(layout="paged"), ValueError, "layout"), (dict(scorer="snapkv"), ValueError, "press"),
                          (dict(scorer="nope"), ValueError, "scorer"), (dict(tier_page_size=0), ValueError,
                                                                        "tier_page_size"),
                          (dict(budget=0, n_sink=0, n_recent=0), ValueError, "capacity"),
                          (dict(layer_budgets=[8]), ValueError, "layer_budgets"),
                          (dict(bogus=1), TypeError, "bogus")]:
        with pytest.raises(exc, match=text):
            install_kv_eviction(model, **{**dict(budget=8, n_sink=2, n_recent=4), **kw})
        assert "forward" not in attn.__dict__ and "_kvevict_handle" not in model.__dict__
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    assert list(model.state_dict().keys()) == keys
    with pytest.raises(ValueError, match="already"):
        install_kv_eviction(model)
    ids = torch.randint(3, VOCAB, (2, 6))
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=right, past_key_values=h.new_cache())
    with pytest.raises(IndexError, match="layer"):
        gen(model, ids, None, max_new_tokens=1)
        h.positions(5)
    h.remove()
    assert "forward" not in attn.__dict__
    with pytest.raises(RuntimeError, match="removed"):
        h.new_cache()
    with pytest.raises(ValueError, match="no eviction"):
        reset_eviction_scores(model)


def test_unsupported_model_names_its_attention_class():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4)
    llama = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="LlamaAttention"):
        install_kv_eviction(llama)


def test_subclassed_attention_and_cache_on_model_dtype():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

    class MyAttention(m3.DeepseekV3Attention):
        pass

    model = make_model(dtype=torch.bfloat16)
    for i, layer in enumerate(model.model.layers):
        old = layer.self_attn
        new = MyAttention(model.config, i).to(torch.bfloat16)
        new.load_state_dict(old.state_dict())
        layer.self_attn = new
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    out = gen(model, torch.randint(3, VOCAB, (1, 20)), None, max_new_tokens=3)
    assert out.sequences.shape == (1, 23)
    assert h.cache.kv.ckv(0).dtype == torch.bfloat16 and h.cache.kv.ckv(0).device == torch.device("cpu")
    assert "KVEvictCache(" in repr(h.cache) and "KVEviction(" in repr(h)


def test_reset_eviction_scores_starts_a_new_sequence():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 10))
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    c = h.new_cache()
    with torch.no_grad():
        a = model(ids, past_key_values=c).logits
        reset_eviction_scores(model)
        assert c.get_seq_length() == 0
        b = model(ids, past_key_values=c).logits
    assert torch.equal(a, b)


def test_plain_forward_without_our_cache_is_the_model_itself():
    model = make_model()
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        install_kv_eviction(model, budget=2, n_sink=1, n_recent=1)
        out = model(ids, use_cache=False).logits
    assert torch.equal(ref, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_full_budget_equals_dynamic_cache():
    model = make_model().cuda()
    ids, mask = padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    ref = gen(model, ids, mask, max_new_tokens=8)
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    out = gen(model, ids, mask, max_new_tokens=8)
    assert h.cache.kv.ckv(0).device.type == "cuda"
    assert_same_generation(ref, out)


def test_seed_example_runs_as_written():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "python", "hf_seed.py")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "kvevict: kept" in r.stdout
    # after remove() the model is transformers' own under eager attention too (num_key_value_heads set)
    agree = [l for l in r.stdout.splitlines() if l.startswith("after remove(): eager and sdpa logits agree to ")]
    assert agree and float(agree[0].rsplit(" ", 1)[1]) < 1e-4, r.stdout


def test_crop_past_an_evicted_token_raises_and_changes_nothing():
    model = make_model()
    h = install_kv_eviction(model, budget=4, n_sink=2, n_recent=2)  # capacity 8
    c = h.new_cache()
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        model(ids, past_key_values=c)
    before = [h.positions(l).clone() for l in range(2)]
    with pytest.raises(RuntimeError, match="already evicted"):
        c.crop(-5)
    assert c.get_seq_length() == 20
    assert all(torch.equal(before[l], h.positions(l)) for l in range(2))
    if LATENT_CACHE:  # transformers >= 5.15: crop(k > 0) raises, as DynamicCache
        with pytest.raises(ValueError, match="negative"):
            c.crop(4)
    c.crop(-2)  # the recent window: fine
    assert c.get_seq_length() == 18
    kept = set(before[0][0].tolist()) - {18, 19, -1}
    assert set(h.positions(0)[0].tolist()) - {-1} == kept


def test_left_padding_wider_than_every_row():
    model = make_model()
    ids, mask = padded_batch(lengths=(5, 8))
    ids = torch.nn.functional.pad(ids, (3, 0))
    mask = torch.nn.functional.pad(mask, (3, 0))  # 3 columns that are pads in every row
    ref = gen(model, ids, mask, max_new_tokens=5)
    install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    assert_same_generation(ref, gen(model, ids, mask, max_new_tokens=5))


def test_a_mask_that_hides_stored_columns_is_refused():
    model = make_model()
    ids, mask = padded_batch(lengths=(6, 9))
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    c = h.new_cache()
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=c)
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        m2[0, -2] = 0  # a column row 0 already stored
        with pytest.raises(ValueError, match="cannot hide tokens already stored"):
            model(torch.tensor([[5], [6]]), attention_mask=m2, past_key_values=c)
    assert c.get_seq_length() == 9


def test_a_mask_is_read_by_the_runtime_shared_with_install():
    """The new columns' mask goes through kvevict.install's parsing too: only 0 and 1, and a hole
    names its row; the press's scorer warning points at the caller's with."""
    model = make_model()
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    ids = torch.randint(3, VOCAB, (2, 4))
    with torch.no_grad():
        with pytest.raises(ValueError, match="attention_mask must hold only 0 \\(pad\\) and 1 \\(token\\)"):
            model(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 2, 1, 1]]), past_key_values=h.new_cache())
        with pytest.raises(ValueError, match="left padding: in the new 4 columns, row 1 has a masked column after"):
            model(ids, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]), past_key_values=h.new_cache())
    h.remove()
    with pytest.warns(UserWarning, match="window") as record:
        with hf.press(model, budget=8, n_sink=2, n_recent=4, window=8):
            pass
    assert record[0].filename == __file__


def test_an_interrupted_forward_makes_the_cache_refuse():
    model = make_model()
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    c = h.new_cache()

    def boom(*_):
        raise KeyboardInterrupt

    hook = model.model.layers[0].mlp.register_forward_hook(boom)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(torch.randint(3, VOCAB, (1, 6)), past_key_values=c)
    hook.remove()
    with torch.no_grad(), pytest.raises(RuntimeError, match="unusable"):
        model(torch.randint(3, VOCAB, (1, 1)), past_key_values=c)


def test_deepcopy_and_pickle_are_refused_clearly_and_the_dtype_follows_the_model():
    import pickle
    model = make_model()
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    with pytest.raises(TypeError, match="remove"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="remove"):
        pickle.dumps(model)
    model.to(torch.bfloat16)
    out = gen(model, torch.randint(3, VOCAB, (1, 12)), None, max_new_tokens=2)
    assert out.sequences.shape == (1, 14) and h.cache.kv.dtype == torch.bfloat16
    h.remove()
    copy.deepcopy(model)


def test_press_snapkv_by_name_takes_window_and_kernel():
    model = make_model()
    with pytest.warns(UserWarning, match=r"SnapKV window \(16\) is longer than n_recent \(8\)"):
        with hf.press(model, budget=8, n_sink=2, n_recent=8, window=16, kernel=3, scorer="snapkv"):
            pass
    with hf.press(model, budget=8, n_sink=2, n_recent=8, window=4, kernel=3, scorer="snapkv") as h:
        assert repr(h._compress) == "SnapKV(window=4, kernel=3)"


# ---- issue 37: what would run without eviction is refused or said ------------------------------------
def test_continuous_batching_is_refused_before_any_forward():
    model = make_model(attn="sdpa")
    forwards = []
    model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    gc = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    entry_points = {
        "generate_batch": lambda: model.generate_batch([[5, 6, 7], [8, 9]], generation_config=gc),
        "init_continuous_batching": lambda: model.init_continuous_batching(generation_config=gc),
        "continuous_batching_context_manager":
            lambda: model.continuous_batching_context_manager(generation_config=gc).__enter__(),
        "generate_batch ": lambda: model.generate(torch.tensor([[5, 6, 7]]), cache_implementation="paged",
                                                  max_new_tokens=3, pad_token_id=0),
    }
    for name, call in entry_points.items():
        with pytest.raises(NotImplementedError, match=rf"kvevict: {name.strip()}\(\).*model\.generate\(\.\.\.\) per "
                                                      "request"):
            call()
    assert forwards == []
    # a manager built by hand (no entry point) runs the model with its PagedAttentionCache: refused at the
    # decoder, before any attention (a bare instance: the real one needs the manager's memory planning)
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    paged = PagedAttentionCache.__new__(PagedAttentionCache)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="got a PagedAttentionCache.*per request"):
        model(torch.tensor([[5, 6, 7]]), past_key_values=paged)
    h.remove()
    assert not {"generate_batch", "init_continuous_batching", "continuous_batching_context_manager"} & set(
        model.__dict__)


def kvevict_warnings(record):
    return [str(m.message) for m in record if issubclass(m.category, hf.KVEvictWarning)]


def test_a_plain_forward_says_nothing_and_a_run_without_eviction_says_so_every_time():
    model = make_model()
    h = install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    x = torch.randint(3, VOCAB, (1, 6))
    with warnings.catch_warnings(record=True) as w, torch.no_grad():
        warnings.simplefilter("always")
        loss = model(x, labels=x).loss  # no cache passed: the model makes its own DynamicCache
        model(x, use_cache=False)
        assert loss.isfinite() and kvevict_warnings(w) == []
        for _ in range(3):  # a cache kvevict did not make: one warning per forward (not per layer, not once)
            model(x, past_key_values=DynamicCache(config=model.config))
        said = kvevict_warnings(w)
        assert len(said) == 3 and all("DynamicCache, not a KVEvictCache" in m and "without eviction" in m for m in said)
        assert all(m.filename == __file__ for m in w if issubclass(m.category, hf.KVEvictWarning))  # the user's line
        c = h.new_cache()
        for _ in range(2):  # attentions are not returned through kvevict's attention: said at every forward
            out = model(x, past_key_values=c, output_attentions=True)
        assert all(a.numel() == 0 for a in out.attentions)
        said = kvevict_warnings(w)[3:]
        assert len(said) == 2 and all("output_attentions=True" in m and "no attention weights" in m for m in said)
        # generate(): once per call, for all its forwards
        for kw, text in [(dict(output_attentions=True, return_dict_in_generate=True), "output_attentions=True"),
                         (dict(past_key_values=DynamicCache(config=model.config)), "DynamicCache, not a KVEvictCache"),
                         (dict(use_cache=False), "use_cache=False")]:
            n = len(kvevict_warnings(w))
            model.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0, **kw)
            said = kvevict_warnings(w)[n:]
            assert len(said) == 1 and text in said[0], (kw, said)
        n = len(kvevict_warnings(w))
        gen(model, x, None, max_new_tokens=4)  # with eviction: nothing to say
        assert kvevict_warnings(w)[n:] == []


def test_the_warning_shows_at_every_call_under_pythons_default_filters():
    code = ("import sys, torch; sys.path.insert(0, %r)\n"
            "from test_hf import make_model, DynamicCache\n"
            "from kvevict.hf import install_kv_eviction\n"
            "m = make_model(); install_kv_eviction(m, budget=8, n_sink=2, n_recent=4)\n"
            "for _ in range(3):\n"
            "    m(torch.tensor([[5, 6, 7]]), past_key_values=DynamicCache(config=m.config))\n"
            % os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("KVEvictWarning: kvevict: this forward got a DynamicCache") == 3, r.stderr[-2000:]


def test_the_hf_extra_brings_accelerate_at_transformers_minimum():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement
    from transformers.dependency_versions_table import deps
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = {Requirement(r).name: Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["hf"]}
    assert "accelerate" in extra, "device_map= and tp_plan= need accelerate: pip install 'kvevict[hf]' must bring it"
    assert str(extra["accelerate"].specifier) == str(Requirement(deps["accelerate"]).specifier)


def model_with_a_bf16_layer(layers=2):
    """make_model() with decoder layer 1 in bf16; transformers leaves casting between layers of different dtypes to
    the model's owner, so hooks cast the hidden states (and RoPE's cos/sin) into that layer and back out."""
    model = make_model(layers=layers)
    layer = model.model.layers[1].to(torch.bfloat16)

    def into(mod, args, kwargs):
        kwargs["position_embeddings"] = tuple(t.bfloat16() for t in kwargs["position_embeddings"])
        return (args[0].bfloat16(),) + tuple(args[1:]), kwargs

    def out_of(mod, args, kwargs, out):
        return out.float() if isinstance(out, torch.Tensor) else (out[0].float(),) + tuple(out[1:])

    layer.register_forward_pre_hook(into, with_kwargs=True)
    layer.register_forward_hook(out_of, with_kwargs=True)
    return model


def test_each_layer_s_cache_takes_its_layer_s_dtype():
    model = model_with_a_bf16_layer()
    ids, mask = padded_batch()
    ref = gen(model, ids, mask, max_new_tokens=8)
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    out = gen(model, ids, mask, max_new_tokens=8)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) < 1e-2  # one layer in bf16
    kv = out.past_key_values.kv
    assert isinstance(kv, hf.LayerGroups) and len(kv.caches) == 2
    assert kv.ckv(0).dtype == torch.float32 and kv.ckv(1).dtype == torch.bfloat16
    assert [p[p >= 0].tolist() for p in h.positions(1)] == [list(range(n + 7)) for n in (12, 8, 5)]
    mem = h.memory()  # transformers' cache: layer 0's rows in fp32, layer 1's in bf16
    per_token = (32 + 8) if LATENT_CACHE else 4 * (16 + 8 + 16)  # latent c_kv + k_pe, or H x (k + v)
    assert mem.full_cache_bytes == 3 * out.past_key_values.get_seq_length() * per_token * (4 + 2)
    assert mem.cache_bytes == sum(c.stats().bytes_allocated for c in kv.caches)
    assert "bfloat16: layers [1]" in repr(kv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_layers_split_between_cpu_and_cuda():
    """device_map as accelerate loads a big checkpoint: layer 0 on the CPU, layer 1 (and the head)
    on CUDA. At a full budget kvevict equals transformers' own cache on the same split model; at an
    evicting budget each layer's cache lives on its layer's device."""
    accelerate = pytest.importorskip("accelerate")
    model = accelerate.dispatch_model(make_model(), device_map={
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": 0,
        "model.norm": 0, "lm_head": 0})
    ids, mask = padded_batch()
    ref = gen(model, ids, mask, max_new_tokens=8)
    h = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
    out = gen(model, ids, mask, max_new_tokens=8)
    assert_same_generation(ref, out)
    kv = out.past_key_values.kv
    assert isinstance(kv, hf.LayerGroups) and len(kv.caches) == 2
    assert kv.caches[0].device.type == "cpu" and kv.caches[1].device.type == "cuda"
    h.remove()
    h = install_kv_eviction(model, budget=6, n_sink=2, n_recent=4)
    gen(model, ids, mask, max_new_tokens=12)
    assert h.stats()["tokens_evicted"] > 0
    assert h.positions(1).device.type == "cuda"


def test_a_bf16_layer_evicts_like_the_masked_oracle():
    model = model_with_a_bf16_layer(layers=3)
    P, steps = 20, 24
    ids = torch.randint(3, VOCAB, (1, P), generator=torch.Generator().manual_seed(2))
    h = install_kv_eviction(model, budget=6, n_sink=2, n_recent=4)  # capacity 12
    cache = h.new_cache()
    visible = [[set(range(j + 1)) for j in range(P)] for _ in range(3)]
    seq, logits = ids, []
    with torch.no_grad():
        out = model(ids, past_key_values=cache).logits[:, -1]
        for t in range(steps):
            kept = [set(h.positions(l)[0][h.positions(l)[0] >= 0].tolist()) for l in range(3)]
            nxt = out.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            for l in range(3):
                visible[l].append(kept[l] | {seq.size(1) - 1})
            out = model(nxt, past_key_values=cache).logits[:, -1]
            logits.append(out[0])
        cache.crop(-2)  # rollback across both caches
    assert cache.get_seq_length() == P + steps - 2
    assert all(h.positions(l)[0].max().item() == P + steps - 3 for l in range(3))
    assert h.stats()["tokens_evicted"] > 0
    h.remove()
    ref = masked_reference_logits(model, seq, visible)[P:]
    assert (torch.stack(logits) - ref).abs().max().item() < 1e-2


SPECULATION = {
    "prompt_lookup": lambda: dict(prompt_lookup_num_tokens=6),  # longer than n_recent (4)
    "assistant": lambda: dict(assistant_model=make_model(layers=1, seed=1)),  # transformers' default draft: 20
}
EVICTING = {  # capacity 14 (a 40-token prompt): every verify forward evicts
    "h2o": dict(budget=8, n_sink=2, n_recent=4),
    "tier_recall": dict(budget=8, n_sink=2, n_recent=4, tier_tokens=16, tier_page_size=2, recall_tokens=2),
    "evict_every_3": dict(budget=8, n_sink=2, n_recent=4, evict_every=3),
}


def run_spying_crop(model, ids, mask=None, **kw):
    """generate(), and the crop() calls it made."""
    calls = []
    orig = hf.KVEvictCache.crop

    def spy(self, n):
        calls.append(int(n))
        return orig(self, n)

    hf.KVEvictCache.crop = spy
    try:
        return gen(model, ids, mask, **kw), calls
    finally:
        hf.KVEvictCache.crop = orig


@pytest.mark.parametrize("layout", ["latent", "expanded"])
@pytest.mark.parametrize("settings", sorted(EVICTING))
@pytest.mark.parametrize("speculation", sorted(SPECULATION))
def test_speculative_decoding_equals_greedy_under_eviction(layout, settings, speculation):
    """transformers' promise (assisted decoding with do_sample=False gives greedy's tokens) under
    eviction: the verify forward runs each draft alone on saved layers, crop() runs the accepted
    ones again, so the cache after each step is greedy's: the same tokens kept in every layer."""
    model = make_model()
    base = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([base] * 4, 1)  # 40 tokens of repeats: prompt lookup proposes drafts
    h = install_kv_eviction(model, layout=layout, **EVICTING[settings])
    greedy = gen(model, ids, None, max_new_tokens=24)
    kept = [h.positions(l).clone() for l in range(2)]
    greedy_stats = h.stats()
    spec, crops = run_spying_crop(model, ids, max_new_tokens=24, **SPECULATION[speculation]())
    assert any(n < 0 for n in crops), crops  # some draft was rejected
    assert torch.equal(greedy.sequences, spec.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(greedy.logits, spec.logits))
    assert diff < 1e-4, diff
    assert all(torch.equal(kept[l], h.positions(l)) for l in range(2))
    stats = h.stats()
    assert stats["tokens_evicted"] == greedy_stats["tokens_evicted"] > 0
    if settings == "tier_recall":
        assert stats["tier_recalled"] == greedy_stats["tier_recalled"] > 0


def test_speculative_decoding_with_the_press_equals_greedy():
    model = make_model()
    base = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([base] * 4, 1)
    with hf.press(model, budget=8, n_sink=2, n_recent=4, window=4, kernel=3) as h:
        greedy = gen(model, ids, None, max_new_tokens=16)
        kept = h.positions(1).clone()
        spec, crops = run_spying_crop(model, ids, max_new_tokens=16, prompt_lookup_num_tokens=5)
        assert any(n < 0 for n in crops), crops
        assert torch.equal(greedy.sequences, spec.sequences)
        assert torch.equal(kept, h.positions(1))


@pytest.mark.parametrize("layout", ["latent", "expanded"])
def test_speculative_decoding_of_a_left_padded_row_equals_greedy(layout):
    """One row with left padding: the first verify forward is the padded prompt plus the drafts."""
    model = make_model()
    base = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([torch.zeros(1, 2, dtype=torch.long)] + [base] * 4, 1)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    h = install_kv_eviction(model, layout=layout, **EVICTING["tier_recall"])
    greedy = gen(model, ids, mask, max_new_tokens=24)
    kept = [h.positions(l).clone() for l in range(2)]
    for draft in (3, 6):  # 6 > n_recent
        spec, crops = run_spying_crop(model, ids, mask, max_new_tokens=24, prompt_lookup_num_tokens=draft)
        assert any(n < 0 for n in crops), crops
        assert torch.equal(greedy.sequences, spec.sequences)
        assert all(torch.equal(kept[l], h.positions(l)) for l in range(2))


def test_reading_the_handle_from_another_thread_leaves_speculation_exact():
    """A read of the handle on another thread between a verify forward and its crop() (placed
    there by a spy on crop) does not run the drafts: only crop() or the generating thread may.
    The tokens stay greedy's."""
    import threading
    model = make_model()
    base = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([base] * 4, 1)
    h = install_kv_eviction(model, **EVICTING["tier_recall"])
    greedy = gen(model, ids, None, max_new_tokens=24)
    orig = hf.KVEvictCache.crop
    reads = []

    def crop_after_a_foreign_read(self, n):
        reader = threading.Thread(target=lambda: reads.append((h.stats()["tokens_evicted"], h.positions(0))))
        reader.start()
        reader.join()
        return orig(self, n)

    hf.KVEvictCache.crop = crop_after_a_foreign_read
    try:
        spec = gen(model, ids, None, max_new_tokens=24, prompt_lookup_num_tokens=6)
    finally:
        hf.KVEvictCache.crop = orig
    assert reads and torch.equal(greedy.sequences, spec.sequences)


def test_assistant_early_exit_is_refused_before_any_forward():
    model = make_model()
    forwards = []
    model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    install_kv_eviction(model, budget=8, n_sink=2, n_recent=4)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="assistant_early_exit is not supported"):
        gen(model, ids, None, max_new_tokens=6, assistant_early_exit=1)
    assert forwards == [] and model.config.num_hidden_layers == 2
    gen(model, ids, None, max_new_tokens=6)  # the model still runs


def test_a_heuristic_draft_schedule_equals_greedy_under_eviction():
    model = make_model()
    assistant = make_model(layers=1, seed=1)
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"  # drafts grow past n_recent
    assistant.generation_config.num_assistant_tokens = 3
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    install_kv_eviction(model, budget=6, n_sink=2, n_recent=2)
    greedy = gen(model, ids, None, max_new_tokens=20)
    spec = gen(model, ids, None, max_new_tokens=20, assistant_model=assistant)
    assert torch.equal(greedy.sequences, spec.sequences)
