"""kvevict.hf under transformers' own tensor parallelism: a tiny random DeepSeek-V3 model saved here,
loaded with ``from_pretrained(path, tp_plan="auto")`` by 2 ranks (``torchrun``, gloo, loopback, CPU;
python/tests/hf_tp_worker.py) and by this process alone. At an evicting budget, every rank keeps the same
positions at every layer, and those positions and the greedy tokens equal the one-process run's, for the
latent and the expanded layout and with the host tier's recall. The oracle is the one-process model
with eviction installed at the same settings (test_hf.py checks that one against transformers)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_tp_worker import run_case  # noqa: E402
from test_hf import VOCAB, make_model  # noqa: E402
from kvevict.hf import install_kv_eviction  # noqa: E402

WORLD = 2
PROMPT = 40
NEW = 10
SHARPEN = 4.0  # the query and key projections' scale over the random init
COMMON = dict(budget=8, n_sink=2, n_recent=8)
CASES = {
    "latent": dict(COMMON, layout="latent"),
    "expanded": dict(COMMON, layout="expanded"),
    # H2O keeps the oldest tokens here (a causal prompt gives them the most observers), whichever heads score:
    # scorers without that bias keep what the heads attend to, and differ when a rank scores its heads alone
    "latent_mean": dict(COMMON, layout="latent", scorer="mean"),
    "expanded_tova": dict(COMMON, layout="expanded", scorer="tova"),
    # the host tier: page scores of recall are summed over the ranks like the observations
    "latent_tier": dict(COMMON, layout="latent", tier_tokens=64, tier_page_size=4, recall_tokens=2,
                        recall_rescore=8, tier_scoring="per_head"),
    "expanded_tier_head_mean": dict(COMMON, layout="expanded", tier_tokens=64, tier_page_size=4, recall_tokens=2,
                                    tier_scoring="head_mean"),
}


def _requirements():
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate (pip install 'kvevict[hf]')")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no torch.distributed with gloo")
    plan = getattr(transformers.DeepseekV3Config, "base_model_tp_plan", None) or {}
    if "layers.*.self_attn.kv_b_proj" not in plan:  # 5.14: the MLPs only; every rank runs every head
        pytest.skip(f"transformers {transformers.__version__}'s DeepSeek-V3 tp_plan does not shard the attention "
                    f"({sorted(plan)})")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt():
    return torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()


def _one_process(model_dir, options):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return run_case(model, _prompt(), NEW, options)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(the saved model's folder, each rank's results): one torchrun of WORLD ranks for every case."""
    _requirements()
    root = tmp_path_factory.mktemp("hf_tp")
    model_dir, out_dir = str(root / "model"), str(root / "out")
    os.makedirs(out_dir)
    model = make_model("v3", "eager", layers=2)
    with torch.no_grad():  # sharper attention than the random init's near-uniform one: heads disagree on what to keep
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_b_proj, layer.self_attn.kv_b_proj):
                proj.weight.mul_(SHARPEN)
    model.save_pretrained(model_dir)
    spec = {"prompt": _prompt(), "max_new_tokens": NEW,
            "cases": [{"name": n, "options": o} for n, o in CASES.items()]}
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               TP_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(WORLD),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           os.path.join(HERE, "hf_tp_worker.py"), model_dir, out_dir, json.dumps(spec)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun of {WORLD} ranks did not finish within 240 s; output:\n{(e.stdout or '')[-3000:]}"
                    f"\n{(e.stderr or '')[-3000:]}")
    if p.returncode != 0:
        pytest.fail(f"torchrun of {WORLD} ranks failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    ranks = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return model_dir, ranks


@pytest.mark.parametrize("case", list(CASES))
def test_tp_ranks_keep_the_same_positions_as_one_process(tp_run, case):
    model_dir, ranks = tp_run
    got = [r["cases"][case] for r in ranks]
    for r, g in enumerate(got):
        # each rank attends with its own heads and divides the summed scores by every rank's
        assert (g["heads"], g["total_heads"], g["tp_size"]) == (4 // WORLD, 4, WORLD), r
    ref = _one_process(model_dir, CASES[case])
    assert ref["stats"]["tokens_evicted"] > 0  # the budget evicts
    if "tier" in case:
        assert ref["stats"]["tier_recalled"] > 0  # and recall brings tokens back
    assert len(ref["steps"]) == NEW  # the prompt's forward, then one per new token but the last
    for r, g in enumerate(got):
        for step, (mine, first, one) in enumerate(zip(g["steps"], got[0]["steps"], ref["steps"])):
            for layer in range(2):
                assert mine[layer] == first[layer], (case, "rank", r, "step", step, "layer", layer)
                assert mine[layer] == one[layer], (case, "rank", r, "step", step, "layer", layer)
        assert len(g["steps"]) == len(ref["steps"])
        assert g["tokens"] == ref["tokens"], (case, r)
        assert g["stats"] == ref["stats"], (case, r)
        # one all-reduce per layer and forward (2 x 10); with the tier's two-level recall at every forward, two more:
        # the pages' scores and the pool's
        assert g["reductions"] == (60 if "tier" in case else 20), (case, r, g["reductions"])


def test_tp_settings_that_differ_across_ranks_and_the_press_are_refused(tp_run):
    _, ranks = tp_run
    for r, res in enumerate(ranks):
        msg = res["mismatch"]
        assert "budget differs across the 2 ranks" in msg and "rank 0: 8" in msg and "rank 1: 9" in msg, (r, msg)
        assert "press() on a tensor-parallel model (tp_size 2) is not supported" in res["press"], (r, res["press"])


# ---- the sharding kvevict refuses, read from the weights (no process group needed) -----------------------
class _FakeShard(torch.nn.Parameter):
    """A weight as transformers' tensor parallelism leaves it (a DTensor's placements, device_mesh and
    to_local()), over a local tensor: enough for install's checks, which raise before any collective."""

    def __new__(cls, local, placements, mesh):
        p = super().__new__(cls, local, requires_grad=False)
        p.placements, p.device_mesh = placements, mesh
        return p

    def to_local(self):
        return self.data


class _FakeMesh:
    ndim = 1

    def size(self):
        return WORLD


MESH = _FakeMesh()


def _shard(module_linear, placement, rows=None):
    w = module_linear.weight.data
    local = w[: (rows if rows is not None else w.size(0) // WORLD)] if placement.is_shard(0) else w
    if placement.is_shard(1):
        local = w[:, : w.size(1) // WORLD]
    module_linear.weight = _FakeShard(local.clone(), (placement,), MESH)


def test_tp_layouts_kvevict_cannot_follow_are_refused_naming_the_weights():
    pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.tensor import Shard

    model = make_model("v3", "eager", layers=2)
    for layer in model.model.layers:  # colwise q_b_proj and kv_b_proj, but o_proj left whole
        _shard(layer.self_attn.q_b_proj, Shard(0))
        _shard(layer.self_attn.kv_b_proj, Shard(0))
    with pytest.raises(ValueError, match=r"layer 0's self_attn is tensor-parallel in a layout kvevict does not "
                                         r"support: .* got \{'kv_b_proj': 'Shard\(dim=0\)', 'q_b_proj': "
                                         r"'Shard\(dim=0\)', 'o_proj': 'not a DTensor'"):
        install_kv_eviction(model, budget=8, n_sink=2, n_recent=8)
    for layer in model.model.layers:
        _shard(layer.self_attn.o_proj, Shard(1))
        _shard(layer.self_attn.kv_b_proj, Shard(0), rows=48)  # 1.5 heads of 32 rows
    with pytest.raises(ValueError, match=r"layer 0's self_attn: this rank's shards must hold whole heads, the same "
                                         r"in kv_b_proj and q_b_proj: kv_b_proj has 48 rows \(heads of 32"):
        install_kv_eviction(model, budget=8, n_sink=2, n_recent=8)
    model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight = _FakeShard(
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.data[:20].clone(), (Shard(0),), MESH)
    with pytest.raises(ValueError, match=r"the latent \(kv_a_proj_with_mqa\) replicated"):
        install_kv_eviction(model, budget=8, n_sink=2, n_recent=8)
    assert "_kvevict_handle" not in model.__dict__  # nothing installed
