"""Prompt lookup with several matches inside dynamic trees (issue 30), replayed on the held-out chats.

    .venv/bin/python scripts/lookup_matches.py [--max-positions 25000] [--sizes 4,8,16] [--matches 1,2,3]

`tune`'s calibration (the held-out split of data/distill/smollm2, whole chats up to
--max-positions positions) with the shipped heads; for each number of matches m, the measured
lookup confidence (`tuning.confidence.fit_lookup_confidence`) and, for each budget T, the tokens per
step that greedy decoding with ``dynamic:T:4`` and prompt lookup (3 tokens, m matches) inside the
budget would take (`tuning.replay.dynamic_accepted`, exact). One JSON line per (m, T).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from medusa_jax import resolve  # noqa: E402
from medusa_jax.convert.load import load_model  # noqa: E402
from medusa_jax.convert.medusa_format import load_heads  # noqa: E402
from medusa_jax.decoding.tree import dynamic_tree, with_lookup  # noqa: E402
from medusa_jax.heads.hydra import token_embeddings  # noqa: E402
from medusa_jax.heads.medusa import with_proposal_projection  # noqa: E402
from medusa_jax.models.llama import lm_head_matrix  # noqa: E402
from medusa_jax.tuning.calibrate import calibration_data  # noqa: E402
from medusa_jax.tuning.confidence import fit_confidence, fit_lookup_confidence  # noqa: E402
from medusa_jax.tuning.replay import Replay, dynamic_accepted, lookup_drafts, proposal_events  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-positions", type=int, default=25000, help="held-out positions replayed (whole chats)")
    p.add_argument("--sizes", default="4,8,16", help="budgets T")
    p.add_argument("--matches", default="1,2,3", help="matches offered")
    args = p.parse_args()
    model = load_model(None, with_tokenizer=False)
    hcfg, hp = load_heads(resolve.DEFAULT_HEADS_DIR, model.cfg)
    lm = lm_head_matrix(model.cfg, model.params)
    _, _, chats, pos, sources = calibration_data(model, "data/distill/smollm2", 0.04, 0, hcfg.num_heads, 512,
                                                 args.max_positions, False)
    jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
    emb = token_embeddings(model.params)
    confidence = fit_confidence(*proposal_events(hcfg, jhp, lm, pos, hcfg.topk, embeddings=emb))
    decode = Replay(chats, sources)
    for m in (int(x) for x in args.matches.split(",")):
        lookup = resolve.DEFAULT_PROMPT_LOOKUP._replace(matches=m)
        drafts = lookup_drafts(chats, sources, lookup)
        rates = fit_lookup_confidence(chats, sources, *drafts[:2])
        for T in (int(x) for x in args.sizes.split(",")):
            tree = with_lookup(dynamic_tree(T, min(hcfg.num_heads, T - 1), hcfg.topk, 4, confidence, rates), lookup)
            accepted = dynamic_accepted(hcfg, jhp, lm, pos, tree, emb, lookup_drafts=drafts)
            print(json.dumps({"matches": m, "T": T, "tokens_per_step": round(decode.tokens_per_step(accepted), 4),
                              "lookup_acceptance": [[round(float(np.exp(x)), 3) for x in r] for r in rates]}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
