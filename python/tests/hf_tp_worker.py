"""One rank of test_hf_tp.py: run under ``torchrun --nproc_per_node N`` (gloo, loopback).

    python -m torch.distributed.run --nproc_per_node 2 hf_tp_worker.py MODEL_DIR OUT_DIR CASES_JSON

Loads the saved tiny DeepSeek-V3 model with transformers' own tensor parallelism
(``from_pretrained(MODEL_DIR, tp_plan="auto")``), and for each case of CASES_JSON
([{"name": ..., "options": {install_kv_eviction keyword arguments}}], the same prompt for all)
installs eviction, generates greedily, records the tokens and every layer's kept positions after
every forward, and removes it. Then checks that install_kv_eviction refuses settings that differ across ranks. Writes
OUT_DIR/rank<R>.json; the test compares the ranks with each other and with one process."""

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

from kvevict import hf
from kvevict.hf import install_kv_eviction

REDUCTIONS = [0]  # all-reduces of scores kvevict asked for (this rank)
_reduce = hf._TensorParallel.reduce


def _counted(self, layer, sums):
    REDUCTIONS[0] += 1
    return _reduce(self, layer, sums)


hf._TensorParallel.reduce = _counted


class _Positions(transformers.LogitsProcessor):
    """Records every layer's kept positions after each forward of generate() (prefill, then each step)."""

    def __init__(self, handle):
        self.handle, self.steps = handle, []

    def __call__(self, input_ids, scores):
        self.steps.append([self.handle.positions(layer).tolist() for layer in range(self.handle.geometry.num_layers)])
        return scores


def run_case(model, prompt, max_new_tokens: int, options: dict) -> dict:
    """Installs eviction with `options`, generates greedily from `prompt` (a list of token ids) and removes it:
    {"tokens", "steps" (per forward, per layer, the kept positions [1, S]), "stats", "heads", "total_heads",
    "tp_size"}. The same code for every rank and for the one-process reference."""
    ids = torch.tensor([prompt])
    h = install_kv_eviction(model, **options)
    rec = _Positions(h)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=max_new_tokens, logits_processor=transformers.LogitsProcessorList([rec]))
    g = h.geometry
    h.memory()  # this rank's cache: readable under tensor parallelism too
    result = {"tokens": out[0, ids.size(1):].tolist(), "steps": rec.steps, "stats": h.stats(),
              "heads": g.num_heads, "total_heads": g.total_heads, "tp_size": g.tp.size if g.tp else None}
    h.remove()
    return result


def main(model_dir: str, out_dir: str, cases_json: str) -> None:
    spec = json.loads(cases_json)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "cases": {}}
    for case in spec["cases"]:
        before = REDUCTIONS[0]
        result["cases"][case["name"]] = run_case(model, spec["prompt"], spec["max_new_tokens"], case["options"])
        result["cases"][case["name"]]["reductions"] = REDUCTIONS[0] - before
    # settings that differ across ranks are refused on every rank, before any forward
    try:
        install_kv_eviction(model, budget=8 + rank, n_sink=2, n_recent=8)
        result["mismatch"] = "installed"
    except ValueError as e:
        result["mismatch"] = str(e)
    try:  # the press compresses the prompt by each rank's heads alone: refused
        with hf.press(model, budget=8, n_sink=2, n_recent=8):
            pass
        result["press"] = "installed"
    except NotImplementedError as e:
        result["press"] = str(e)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])
