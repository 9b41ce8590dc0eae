"""Compare heads directories on the same held-out chats: calibrated top-1/top-5 per head and the
tokens/step that replaying greedy decoding gives (`medusa_jax.tuning.replay`) for each one's own tree
(heads alone and with prompt lookup) and for a larger tree searched for each.

    python scripts/compare_heads.py --heads runs/heads_s12 medusa_jax/assets/heads/smollm2-135m-instruct \
        --first 4541 --out docs/results/issue10/compare_heads_session13.json

``--first N`` keeps the held-out chats among the data's first N answers: the split is by answer id,
so heads trained before the data grew are compared on chats that neither of them saw.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", required=True, help="heads directories to compare")
    p.add_argument("--data", default="data/distill/smollm2", help="self-distillation directory")
    p.add_argument("--val-fraction", type=float, default=0.04, help="the training config's held-out fraction")
    p.add_argument("--seed", type=int, default=0, help="the training config's split seed")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per chat kept")
    p.add_argument("--first", type=int, default=0, help="only the held-out chats among the first N answers (0 = all)")
    p.add_argument("--large-tree", type=int, default=32, help="nodes of the searched larger tree (0 = none)")
    p.add_argument("--prompt-lookup", type=int, default=3, help="lookup copy length for the 'lookup' figures")
    p.add_argument("--out", default=None, help="write the comparison here as JSON")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from medusa_jax import resolve
    from medusa_jax.convert.load import load_model
    from medusa_jax.convert.medusa_format import load_heads
    from medusa_jax.decoding.tree import build_tree
    from medusa_jax.heads.hydra import token_embeddings
    from medusa_jax.heads.medusa import with_proposal_projection
    from medusa_jax.models.llama import lm_head_matrix
    from medusa_jax.train import data as D
    from medusa_jax.train.hidden import Backbone, compute_positions, position_sources
    from medusa_jax.tuning.replay import Replay, path_ranks, rank_accuracies_of, search_tree, tree_accepted

    examples = D.load_distilled(args.data)
    if args.first:
        examples = examples[:args.first]
    _, val = D.split_train_val(examples, args.val_fraction, args.seed)
    chats = [(np.asarray(i, np.int32)[:args.max_seq_len], np.asarray(m, bool)[:args.max_seq_len]) for i, m in val]
    model = load_model(None, with_tokenizer=False)
    lm = lm_head_matrix(model.cfg, model.params)
    emb = token_embeddings(model.params)
    lookup = resolve.tree_lookup(build_tree([]), args.prompt_lookup).lookup
    result = {}
    pos = sources = alone = looked = None
    for d in args.heads:
        hcfg, hp = load_heads(d, model.cfg)
        if pos is None:
            pos = compute_positions(Backbone(model.cfg, model.params, model.path), chats, hcfg.num_heads,
                                    args.max_seq_len, 4096, desc="hidden states")
            sources = position_sources(chats, hcfg.num_heads)
            alone, looked = Replay(chats, sources), Replay(chats, sources, lookup)
        jhp = with_proposal_projection(hcfg, jax.tree_util.tree_map(jnp.asarray, hp), lm)
        ranks = path_ranks(hcfg, jhp, lm, pos, hcfg.topk, embeddings=emb)
        acc, counts = rank_accuracies_of(ranks, pos.valid, hcfg.topk)
        own = [list(c) for c in hcfg.medusa_choices]
        acc_own = tree_accepted(ranks, own, hcfg.topk)
        row = {"chats": len(chats), "positions": int(counts[0]), "top1": np.round(acc[:, 0], 4).tolist(),
               "top5": np.round(acc[:, :5].sum(1), 4).tolist(),
               "own_tree": {"choices": own, "alone": alone.tokens_per_step(acc_own),
                            "lookup": looked.tokens_per_step(acc_own)}}
        if args.large_tree > 1:
            big = [list(c) for c in search_tree(ranks, args.large_tree, hcfg.topk, alone)]
            row[f"tree{args.large_tree}"] = {"choices": big,
                                             "alone": alone.tokens_per_step(tree_accepted(ranks, big, hcfg.topk))}
        result[d] = row
        print(d, json.dumps({k: v for k, v in row.items() if k != f"tree{args.large_tree}"}),
              f"tree{args.large_tree} alone {row.get(f'tree{args.large_tree}', {}).get('alone')}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
