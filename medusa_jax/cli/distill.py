"""``medusa-distill`` / ``python -m medusa_jax.cli.distill``: self-distil a prompt pool
(`medusa_jax.train.distill`)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from medusa_jax.train.distill import EvalSetError, distill


def main(argv: Optional[Sequence[str]] = None) -> None:
    from medusa_jax.cli.common import HelpFormatter

    p = argparse.ArgumentParser(prog="medusa-distill", description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--out", required=True,
                   help="output directory (samples.jsonl, meta.json); an interrupted run resumes there")
    p.add_argument("--model", default=None, help="backbone: HF directory or GGUF (default: SmolLM2 GGUF)")
    p.add_argument("--prompts", default=None,
                   help="JSONL with a 'prompt' field (default: the permissive pool); never an evaluation set")
    p.add_argument("--target-tokens", type=int, default=None,
                   help="stop taking new prompts once samples.jsonl holds this many response tokens "
                        "(default: answer the whole pool)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt at most")
    p.add_argument("--batch-size", type=int, default=128,
                   help="prompts decoded together (continuous batching); on a 2-core CPU 128 made 320 tokens/s "
                        "where 32 made 210 and 16 made 170")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; > 0: sampled")
    p.add_argument("--seed", type=int, default=0, help="seed of the pool's shuffle and of sampling")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N prompts of the shuffled pool (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="skip prompts longer than this many tokens after the chat template")
    a = p.parse_args(argv)
    try:
        res = distill(a.out, model=a.model, prompts=a.prompts, target_tokens=a.target_tokens,
                      max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, temperature=a.temperature,
                      seed=a.seed, limit=a.limit, max_prompt_tokens=a.max_prompt_tokens)
    except (EvalSetError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
