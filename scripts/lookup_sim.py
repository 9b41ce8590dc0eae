"""Offline estimate of prompt lookup on Spec-Bench (20 prompts per task, 128 new tokens, greedy).

1. Plain greedy answers (cached in runs/lookup_outputs.json).
2. For every position of every answer, the shipped heads' tree's accepted length there, from
   teacher-forced hidden states (greedy output is fixed, so what a step at that position accepts
   does not depend on how decoding got there); cached in runs/lookup_aM.json.
3. Decoding replayed under drafting policies, with the shipped heads' measured cost table c(T):
   "medusa" (the heads' tree only), "switch" (a chain of k copied tokens when the context's last
   n-gram occurred before, else the heads' tree), "union_when" (both, in one bigger tree, when a
   copy exists). Prints tokens/step and the predicted speed-up per task.
Run from the checkout: .venv/bin/python scripts/lookup_sim.py (~15 min on the project's CPU).
"""
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
from medusa_jax import resolve
from medusa_jax.chat import apply_chat_template, load_first_turns
from medusa_jax.convert.load import load_model
from medusa_jax.drafts.heads import draft_tokens
from medusa_jax.decoding.setup import decoding_setup
from medusa_jax.evals.speed import per_category, spec_bench_groups, time_jit_generate
from medusa_jax.train.hidden import hidden_fn

os.makedirs("runs", exist_ok=True)
OUT = "runs/lookup_outputs.json"
model = load_model(None)
cfg, params = model.cfg, model.params
heads, tree, note = resolve.resolve_heads(model, None, None)
recs = per_category(spec_bench_groups(load_first_turns("data/Spec-Bench_question.jsonl", None)), 20)
prompts = [apply_chat_template(model.tokenizer, r["prompt"]) for r in recs]
if os.path.exists(OUT):
    outs = json.load(open(OUT))
else:
    outs = []
    for i, ids in enumerate(prompts):
        outs.append(time_jit_generate(cfg, params, None, None, ids, 128, cfg.eos_token_ids, progress=False)["tokens"])
        print(i, len(outs[-1]), flush=True)
    json.dump(outs, open(OUT, "w"))
dp, hcfg, hp, tr = decoding_setup(cfg, params, heads, tree)
hid = hidden_fn(cfg)
draft = jax.jit(lambda h, root: draft_tokens(cfg, hcfg, hp, dp, types.SimpleNamespace(hidden=h), root, tr))
print("tree", tr.medusa_choices)
res = []
for i, (ids, out) in enumerate(zip(prompts, outs)):
    seq = np.asarray(ids + out, np.int32)
    H = np.asarray(hid(params, seq[None]))[0]        # [L, D]
    P = len(ids)
    # root at absolute index P+t (t=0..n-1); hidden at P+t-1
    n = len(out)
    toks = np.asarray(draft(jnp.asarray(H[P - 1:P + n - 1]), jnp.asarray(seq[P:P + n])))  # [n, T]
    aM = []
    for t in range(n):
        best = 0
        for path in tr.retrieve_indices[:, 1:]:
            a = 0
            for d, node in enumerate(path):
                if node == 0 or P + t + 1 + d >= len(seq) or toks[t, node] != seq[P + t + 1 + d]:
                    break
                a += 1
            best = max(best, a)
        aM.append(best)
    res.append({"cat": recs[i]["category"], "P": P, "seq": seq.tolist(), "aM": aM})
    print(i, recs[i]["category"], n, np.mean(aM), flush=True)
json.dump(res, open("runs/lookup_aM.json", "w"))


# ---- 3. replay under drafting policies
import collections

res = json.load(open("runs/lookup_aM.json"))
# c(T): the mean of `tune --update-shipped-heads` cost table (2026-12-01); c(7) interpolated
c = {1: 1.0, 2: 1.15, 3: 1.25, 4: 1.32, 5: 1.49, 6: 1.58, 7: 1.65, 8: 1.72, 10: 1.88}

def lookup(ctx, nmax, nmin, k, recent=True):
    L = len(ctx)
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1: continue
        pat = ctx[-n:]
        rng = range(L - n - 1, -1, -1) if recent else range(0, L - n)
        for i in rng:
            if ctx[i:i + n] == pat:
                cand = ctx[i + n:i + n + k]
                if cand: return cand, n
    return None, 0

def simulate(r, policy, nmax, nmin, k, recent=True, nthresh=1):
    seq, P, aM = r["seq"], r["P"], r["aM"]
    n = len(aM); t = 0; steps = 0; cost = 0.0; toks = 0
    while t < n:
        ctx = seq[:P + t + 1]
        cand, ng = lookup(ctx, nmax, nmin, k, recent)
        aL = 0
        if cand is not None:
            for d, x in enumerate(cand):
                if P + t + 1 + d < len(seq) and seq[P + t + 1 + d] == x: aL += 1
                else: break
        has = cand is not None and ng >= nthresh
        if policy == "medusa": a, T = aM[t], 4
        elif policy == "switch": (a, T) = (aL, k + 1) if has else (aM[t], 4)
        elif policy == "union_when": (a, T) = (max(aM[t], aL), 4 + k) if has else (aM[t], 4)
        elif policy == "union": a, T = max(aM[t], aL if has else 0), 4 + k
        a = min(a, n - t - 1)
        t += a + 1; steps += 1; cost += c[T]; toks += a + 1
    return toks, steps, cost

cats = sorted(set(r["cat"] for r in res))
configs = [("medusa", 1, 1, 0)]
for k in (2, 3, 4, 6):
    for nmax, nmin in ((3, 1), (3, 2), (2, 1), (4, 2)):
        for pol in ("switch", "union_when"):
            if pol == "union_when" and k + 4 not in c: continue
            configs.append((pol, nmax, nmin, k))
for pol, nmax, nmin, k in configs:
    tot = collections.defaultdict(lambda: np.zeros(3))
    for r in res:
        s = np.array(simulate(r, pol, nmax, nmin, k))
        tot[r["cat"]] += s; tot["all"] += s
    line = f"{pol:10s} n{nmax}-{nmin} k{k}: " + " ".join(
        f"{ct[:6]} {v[0]/v[1]:.2f}/{v[0]/v[2]:.2f}" for ct, v in sorted(tot.items()))
    print(line, flush=True)
