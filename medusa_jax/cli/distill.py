"""``medusa-distill`` / ``python -m medusa_jax.cli.distill``: self-distil a prompt pool
(`medusa_jax.train.distill`).

Bad flags, a prompts file that cannot be read or holds no prompt, an ``--out`` that is not a
directory or holds a run made with other settings are refused with one line and exit status 2,
before the model loads; a pool none of whose prompts fits ``--max-prompt-tokens`` is said so after
(exit status 2, nothing kept)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from medusa_jax.cli import interruptible
from medusa_jax.train.distill import META_FILE, SAMPLES_FILE, EvalSetError, check_settings, distill


@interruptible
def main(argv: Optional[Sequence[str]] = None) -> int:
    from medusa_jax.cli.common import HelpFormatter, make_out_dir

    p = argparse.ArgumentParser(prog="medusa-distill", description=__doc__.split("\n")[0].replace("``", ""),
                                formatter_class=HelpFormatter)
    p.add_argument("--out", required=True,
                   help="output directory (samples.jsonl, meta.json); an interrupted run resumes there")
    p.add_argument("--model", default=None, help="backbone: HF directory or GGUF (default: SmolLM2 GGUF)")
    p.add_argument("--prompts", default=None,
                   help="JSONL with a 'prompt' field (default: the checkout's data/prompt_pool_permissive.jsonl); "
                   "never an evaluation set")
    p.add_argument("--target-tokens", type=int, default=None,
                   help="stop taking new prompts once samples.jsonl holds this many (>= 1) response tokens "
                        "(default: answer the whole pool)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt at most (>= 1)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="prompts decoded together (>= 1; continuous batching); on a 2-core CPU 128 made 320 "
                        "tokens/s where 32 made 210 and 16 made 170")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; > 0: sampled")
    p.add_argument("--seed", type=int, default=0, help="seed of the pool's shuffle and of sampling, in [0, 2**31)")
    p.add_argument("--limit", type=int, default=None,
                   help="only the first N >= 1 prompts of the shuffled pool (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="skip prompts longer than this many (>= 1) tokens after the chat template")
    a = p.parse_args(argv)
    try:  # the settings first: meta.json records them, and nothing is written or loaded before they pass
        check_settings(target_tokens=a.target_tokens, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                       temperature=a.temperature, seed=a.seed, limit=a.limit,
                       max_prompt_tokens=a.max_prompt_tokens, flags=True)
    except ValueError as e:
        p.error(str(e))
    if a.prompts is not None and os.path.isdir(a.prompts):
        p.error(f"--prompts {a.prompts}: is a directory; give a JSONL file with a 'prompt' field per line")
    if a.prompts is not None and not os.path.exists(a.prompts):
        p.error(f"--prompts {a.prompts}: no such file; give a JSONL file with a 'prompt' field per line")
    make_out_dir(p, a.out)
    meta_path, samples_path = os.path.join(a.out, META_FILE), os.path.join(a.out, SAMPLES_FILE)
    fresh = not os.path.exists(meta_path)
    try:
        res = distill(a.out, model=a.model, prompts=a.prompts, target_tokens=a.target_tokens,
                      max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, temperature=a.temperature,
                      seed=a.seed, limit=a.limit, max_prompt_tokens=a.max_prompt_tokens)
    except (EvalSetError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if res["written"] == 0 and res["total_tokens"] == 0:  # no prompt was taken, and none before
        if fresh:  # this run's empty files go, so that other settings may use --out
            for path in (meta_path, samples_path):
                if os.path.exists(path) and (path == meta_path or os.path.getsize(path) == 0):
                    os.remove(path)
        print(f"error: nothing to distill: no prompt of {a.prompts or 'the default pool'} fits in "
              f"--max-prompt-tokens {a.max_prompt_tokens} tokens after the chat template (with "
              f"--max-new-tokens {a.max_new_tokens} in the model's context); allow longer prompts or give others",
              file=sys.stderr)
        return 2
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
