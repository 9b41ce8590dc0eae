"""What the command-line tools share: default heads, tree choice, compilation cache, text streaming."""
from __future__ import annotations

import math
import os
import sys
from typing import Optional, Tuple

from .config import MedusaConfig
from .lookup import PromptLookup
from .tree import PRESETS, TreeBuffers, get_tree, with_lookup

_ASSET_HEADS = os.path.join(os.path.dirname(__file__), "assets", "heads")
#: Heads shipped for the default model (SmolLM2-135M-Instruct), inside the package.
DEFAULT_HEADS_DIR = os.path.join(_ASSET_HEADS, "smollm2-135m-instruct")
#: The other heads shipped for the default model, by the name `--heads` accepts: the paper's
#: Medusa-1 heads (Cai et al. 2024, Sec. 2.2.1), kept beside the default (Hydra) heads.
SHIPPED_HEADS = {"medusa1": os.path.join(_ASSET_HEADS, "smollm2-135m-instruct-medusa1")}
#: Prompt lookup (`medusa_jax.lookup`) on the tools' trees unless asked otherwise: copies of 3
#: tokens after a repeated 3- or 2-gram. On Spec-Bench with SmolLM2-135M it beat copies of 2, 4
#: and 6 and 1-grams (docs/performance.md, "Prompt lookup").
DEFAULT_PROMPT_LOOKUP = PromptLookup(num_tokens=3, max_ngram=3, min_ngram=2)


def tree_lookup(tree: TreeBuffers, prompt_lookup: Optional[int] = None) -> TreeBuffers:
    """`tree` with the prompt lookup asked for: None: the tree's own (a tree file's
    ``prompt_lookup``), else `DEFAULT_PROMPT_LOOKUP`; 0: none; K > 0: copies of K tokens (n-grams
    as the default's). Raises ValueError for K < 0."""
    if prompt_lookup is None:
        return tree if tree.lookup is not None else with_lookup(tree, DEFAULT_PROMPT_LOOKUP)
    if prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup takes the tokens copied per draft (0 = off), got {prompt_lookup}")
    return with_lookup(tree, DEFAULT_PROMPT_LOOKUP._replace(num_tokens=prompt_lookup) if prompt_lookup else None)


def add_lookup_arg(p) -> None:
    """The ``--prompt-lookup K`` flag of decode.py, check and bench (`tree_lookup`)."""
    def tokens(text: str) -> int:
        import argparse

        try:
            k = int(text)
        except ValueError:
            k = -1
        if k < 0:
            raise argparse.ArgumentTypeError(f"takes the tokens copied per draft, an integer >= 0 (0 = off), "
                                             f"got {text!r}")
        return k

    p.add_argument("--prompt-lookup", type=tokens, default=None, metavar="K",
                   help="prompt lookup: when the context's last 3- or 2-gram occurred before, verify the K tokens "
                        "that followed it instead of the heads' tree (lossless, like the heads' candidates; fast "
                        "on summaries, translations, answers about a document); 0 = off; default: the tree "
                        f"file's setting, else K={DEFAULT_PROMPT_LOOKUP.num_tokens}")


def heads_help(zero: bool = True) -> str:
    """The --heads help of the tools; `zero`: the tool also takes 'zero' (fresh heads)."""
    return ("a heads directory (ours, the official Medusa format or vLLM's); 'medusa1' for the shipped Medusa-1 "
            "heads; " + ("'zero' for fresh zero-initialised heads; " if zero else "")
            + "default: the heads shipped for the default model")
#: Tree used when neither --tree nor the heads name one.
DEFAULT_TREE = "small_16"


def enable_compilation_cache(path: Optional[str] = None) -> None:
    """Persist XLA compilations across runs (``~/.cache/medusa_jax/xla`` by default), so a second
    `decode.py` run starts faster. Set MEDUSA_JAX_NO_CACHE=1 to disable."""
    if os.environ.get("MEDUSA_JAX_NO_CACHE"):
        return
    import jax

    path = path or os.path.join(os.path.expanduser("~"), ".cache", "medusa_jax", "xla")
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception:  # an unwritable home or an older jax: run without the cache
        pass


def heads_location(heads_path: Optional[str]) -> Optional[str]:
    """`heads_path` with a shipped heads name (`SHIPPED_HEADS`, e.g. "medusa1") replaced by its
    directory; anything else (None, "zero", a path; an existing path of that name wins) unchanged."""
    if heads_path in SHIPPED_HEADS and not os.path.exists(heads_path):
        return SHIPPED_HEADS[heads_path]
    return heads_path


def resolve_tree(spec, heads_cfg: MedusaConfig) -> TreeBuffers:
    """The Medusa tree: `spec` (preset name, JSON/YAML file, or paths) if given, else the tree saved
    with the heads, else `DEFAULT_TREE` cut to the heads' depth.

    Raises ValueError for an unknown preset, a malformed file, or a tree deeper than the heads.
    """
    if spec is not None:
        return get_tree(spec, topk=None, num_heads=heads_cfg.num_heads)
    if heads_cfg.medusa_choices:
        return get_tree(heads_cfg.medusa_choices, topk=heads_cfg.topk, num_heads=heads_cfg.num_heads)
    choices = [p for p in PRESETS[DEFAULT_TREE] if len(p) <= heads_cfg.num_heads]
    return get_tree(choices, topk=heads_cfg.topk, num_heads=heads_cfg.num_heads)


def resolve_heads(model, heads_path: Optional[str], tree_spec=None, use_medusa: bool = True,
                  zero_heads: int = 4, prompt_lookup: Optional[int] = None
                  ) -> Tuple[Optional[Tuple[MedusaConfig, dict]], Optional[TreeBuffers], str]:
    """Heads and tree for a loaded model.

    Args:
      model: a `loading.LoadedModel`.
      heads_path: a heads directory or file; a shipped heads name (`SHIPPED_HEADS`); "zero":
        `zero_heads` fresh zero-initialised heads (they propose the base model's next-token
        guesses; for lossless checks); None: the heads shipped for the default model, when `model`
        is that model and they exist.
      tree_spec: see `resolve_tree`.
      use_medusa: False gives (None, None, "").
      prompt_lookup: the tree's prompt lookup (`tree_lookup`): None: the tree file's, else
        `DEFAULT_PROMPT_LOOKUP`; 0: off; K: copies of K tokens.
    Returns:
      ((MedusaConfig, params as jnp arrays) or None, TreeBuffers or None, a note for the user
      when Medusa was asked for but no heads fit). Without heads the tree is the trivial one with
      prompt lookup (lookup alone, which `generate` accepts without heads), or None when
      ``prompt_lookup=0`` (plain decoding). The heads come prepared for
      that tree (`heads.prepare_heads`): only its first ``tree.max_depth`` heads are kept, so a
      deeper tree needs another call.
    Raises:
      FileNotFoundError / HeadsFormatError / HeadsMismatchError from `load_heads` for an explicit
      path that is missing, corrupt or made for another backbone; ValueError for a bad tree.
    """
    if not use_medusa:
        return None, None, ""
    import jax.numpy as jnp

    heads_path = heads_location(heads_path)
    from .convert.medusa_format import load_heads
    from .heads import check_heads_match

    def without_heads(why: str):  # prompt lookup alone, unless it is off
        alone = tree_lookup(get_tree([]), prompt_lookup)
        if alone.lookup is None:
            return None, None, why + "; decoding plainly"
        return None, alone, why + "; decoding with prompt lookup only (no heads)"

    if heads_path == "zero":
        from .heads import init_heads
        from .models.llama import lm_head_matrix

        heads_cfg = MedusaConfig(hidden_size=model.cfg.hidden_size, vocab_size=model.cfg.vocab_size,
                                 num_heads=zero_heads)
        params = init_heads(heads_cfg, lm_head_matrix(model.cfg, model.params))
    elif heads_path is None:
        if not os.path.isdir(DEFAULT_HEADS_DIR):
            return without_heads("no default Medusa heads are installed (pass --heads DIR)")
        heads_cfg, params = load_heads(DEFAULT_HEADS_DIR)
        try:
            check_heads_match(heads_cfg, model.cfg)
        except ValueError:
            return without_heads("the shipped heads are for SmolLM2-135M-Instruct, not this model (train heads "
                                 "with train.py and pass --heads DIR)")
    else:
        heads_cfg, params = load_heads(heads_path, model.cfg)
    from . import sharding
    from .heads import prepare_heads
    from .models.llama import compute_dtype, lm_head_matrix

    if getattr(model, "params", None) is not None:  # the heads compute in the backbone's dtype
        dt = compute_dtype(model.params)
        params = {k: (v.astype(dt) if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating) else v)
                  for k, v in params.items()}
    tree = tree_lookup(resolve_tree(tree_spec, heads_cfg), prompt_lookup)
    # once, here, rather than every step: only the tree's heads, the proposal projection precomputed
    need_base = heads_cfg.proposal_vocab_size or not heads_cfg.shared_lm_head
    base = lm_head_matrix(model.cfg, model.params) if need_base else None
    heads_cfg, params = prepare_heads(heads_cfg, params, base, depth=max(tree.max_depth, 1))
    # once, here, for a model on a device mesh (`place_on_mesh`): decoding would otherwise place them every call
    params = sharding.shard_params(params, sharding.mesh_of(getattr(model, "params", None)))
    return (heads_cfg, params), tree, ""


def heads_calibration(heads_path: Optional[str]) -> Optional[dict]:
    """The ``tree_search`` report that `medusa_jax.tune` saved with the heads (calibrated
    ``rank_accuracies`` [K][topk], measured costs, the chosen tree), or None when there is none.
    `heads_path` None means the shipped heads; "zero" has none."""
    if heads_path == "zero":
        return None
    from .convert.medusa_format import read_heads_config

    try:
        return read_heads_config(heads_location(heads_path) or DEFAULT_HEADS_DIR).get("tree_search")
    except (OSError, ValueError):
        return None


def predicted_tokens_per_step(tree: TreeBuffers, calibration: Optional[dict]) -> Optional[Tuple[float, str]]:
    """The tokens per step `medusa_jax.tune` predicts for `tree`, and on what basis, or None.

    For the tree tune chose, with the prompt lookup it chose it with (or with none), the figure tune
    replayed on the held-out chats (`medusa_jax.replay`; with or without that lookup); for another
    tree, 1 + E[accepted] under the calibrated rank accuracies as if the heads erred independently
    (Medusa Sec. 3.3.1), which ignores prompt lookup. None without a calibration."""
    from .tree import expected_acceptance_length

    if not calibration or "rank_accuracies" not in calibration:
        return None
    lookup = tree.lookup_settings
    chosen = {tuple(p) for p in calibration.get("medusa_choices") or []}
    if calibration.get("predicted_by") == "replay" and chosen == set(tree.medusa_choices):
        if lookup is None:
            return calibration["predicted_tokens_per_step"], "replayed on the held-out chats, heads alone"
        if lookup == calibration.get("prompt_lookup") and calibration.get("predicted_tokens_per_step_lookup"):
            return calibration["predicted_tokens_per_step_lookup"], "replayed on the held-out chats, with prompt lookup"
    try:
        e = expected_acceptance_length(tree, calibration["rank_accuracies"])
    except ValueError:
        return None
    return 1.0 + e, "rank accuracies, independent heads" + (", without prompt lookup" if lookup else "")


def speed_note(tree: Optional[TreeBuffers], calibration: Optional[dict]) -> str:
    """A hint when `medusa_jax.tune` measured, on this kind of device, that the heads' chosen tree is
    slower than plain decoding (predicted speedup < 1); "" otherwise."""
    if tree is None or not calibration:
        return ""
    import jax

    if calibration.get("device") != str(jax.devices()[0].device_kind) or calibration.get("chosen_size") != tree.size:
        return ""
    if tree.lookup_settings != calibration.get("prompt_lookup"):
        return ""  # chosen for another prompt-lookup setting
    row = next((r for r in calibration.get("rows", []) if r.get("size") == tree.size), None)
    if row is None or row.get("predicted_speedup", 1.0) >= 1.0:
        return ""
    return (f"on this device ({calibration['device']}) these heads' tree is predicted at "
            f"{row['predicted_speedup']:.2f}x plain decoding (python -m medusa_jax.tune); --no-medusa is faster")


class TextStreamer:
    """Prints generated text as token chunks arrive, detokenizing incrementally (a character
    split across tokens is held back until complete)."""

    def __init__(self, tokenizer, enabled: bool = True, stream=None):
        self.tokenizer = tokenizer
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tokens: list = []
        self.printed = 0

    def push(self, chunk) -> None:
        if not self.enabled:
            return
        self.tokens.extend(chunk)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)

    def end(self) -> None:
        if self.enabled:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            self.stream.write(text[self.printed:] + "\n")
            self.stream.flush()


def preflight(model_path: Optional[str], heads_path: Optional[str], tree_spec=None, use_medusa: bool = True,
              zero_heads: int = 4) -> None:
    """Check the command-line inputs that name files before anything slow runs (the model load
    takes seconds), so that a typo fails at once.

    Checks: the model path exists and is an HF directory (config.json) or a GGUF file, or, with
    none, that the default model is installed; the heads path holds a known weight file and a
    readable config; the tree is a preset, a readable medusa_choices file or a list of paths, and
    is not deeper than the heads when the heads' config states their count (ours always does).
    Raises:
      FileNotFoundError: a missing model, heads or tree file, or the default model not installed
        (the message says how to install it).
      ValueError: a malformed tree, heads config (`HeadsFormatError`), or a file that is neither
        GGUF nor an HF directory; a tree deeper than the heads.
    """
    from .loading import check_model_path

    try:
        check_model_path(model_path)
    except (FileNotFoundError, ValueError) as e:
        if model_path is None:  # the default model: its message says how to install it
            raise
        raise type(e)(f"--model {e}") from e
    if not use_medusa:
        return
    heads_path = heads_location(heads_path)
    num_heads = None
    if heads_path == "zero":
        num_heads = zero_heads
    elif heads_path is not None:
        from .convert.medusa_format import read_heads_config

        raw = read_heads_config(heads_path)
        if "medusa_choices" in raw or "shared_lm_head" in raw:  # our format states the true count
            num_heads = raw.get("medusa_num_heads")
    if tree_spec is not None:
        tree = get_tree(tree_spec, topk=None, num_heads=None)
        if num_heads is not None and tree.max_depth > int(num_heads):
            raise ValueError(f"--tree has depth {tree.max_depth} but the heads have only {num_heads}; use a "
                             "shallower tree (a preset such as chain3, or a medusa_choices file)")


def add_acceptance_args(p, temperature_help: str = "0 = greedy; > 0 = sampling (see --acceptance)") -> None:
    """The sampling and acceptance flags of decode.py, check and bench (`acceptance_from_args`)."""
    p.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    p.add_argument("--acceptance", choices=("greedy", "typical", "exact"), default=None,
                   help="how Medusa accepts candidates: 'greedy' (temperature 0); 'exact': speculative sampling over "
                        "the tree, the output follows the model's own distribution (lossless); 'typical': Medusa's "
                        "typical acceptance, accepts more but changes the distribution; default: greedy at "
                        "temperature 0, exact above")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (temperature > 0), in (0, 1]")
    p.add_argument("--posterior-threshold", type=float, default=0.09,
                   help="typical acceptance: hard probability threshold epsilon, in (0, 1]")
    p.add_argument("--posterior-alpha", type=float, default=0.3,
                   help="typical acceptance: entropy-scaled threshold factor delta (accept if "
                        "p > min(threshold, alpha * exp(-entropy)))")
    p.add_argument("--seed", type=int, default=0,
                   help="PRNG seed for sampling, in [0, 2**31); prompt i of a prompt file uses (seed + i) mod "
                        "2**31, so its answer does not depend on the batch it runs in")


def acceptance_from_args(p, args):
    """The `verify.Acceptance` of the flags from `add_acceptance_args`; sets ``args.acceptance`` to
    the method that runs ("greedy" at temperature 0, "exact" by default above). Bad values exit
    through ``p.error`` (status 2) with a one-line message."""
    from .verify import Acceptance

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if not 0 < args.posterior_threshold <= 1:
        p.error("--posterior-threshold must be in (0, 1]")
    if not (math.isfinite(args.posterior_alpha) and args.posterior_alpha >= 0):
        p.error(f"--posterior-alpha must be a finite number >= 0, got {args.posterior_alpha}")
    if not 0 <= args.seed < 2 ** 31:
        p.error("--seed must be in [0, 2**31)")
    if args.acceptance is None:
        args.acceptance = "greedy" if args.temperature == 0 else "exact"
    elif args.acceptance == "greedy" and args.temperature > 0:
        p.error(f"--acceptance greedy decodes at temperature 0, got --temperature {args.temperature}: use "
                "--acceptance exact (the model's own distribution) or typical")
    elif args.acceptance != "greedy" and args.temperature == 0:
        p.error(f"--acceptance {args.acceptance} samples: give a --temperature > 0 (0 is greedy)")
    return Acceptance(temperature=args.temperature, posterior_threshold=args.posterior_threshold,
                      posterior_alpha=args.posterior_alpha, top_p=args.top_p,
                      method="exact" if args.acceptance == "greedy" else args.acceptance)


#: Compute dtypes the tools take (`--dtype`): the params, activations and KV cache are stored and
#: computed in it; logits stay float32 (`models.llama.LlamaModel`).
DTYPES = ("float32", "bfloat16", "float16")


def add_dtype_arg(p) -> None:
    """The --dtype flag of decode.py, check, bench and tune (pass ``jnp.dtype(args.dtype)`` to
    `load_model`)."""
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="compute dtype: params, activations and the KV cache in it, logits in float32 (plain and "
                        "Medusa share it, so greedy outputs stay identical); on a CPU bfloat16 and float16 are "
                        "slower than float32 (no weight-streaming kernel for them)")


def add_mesh_arg(p) -> None:
    """The --mesh flag of decode.py, bench and train.py (`place_on_mesh`)."""
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="run on a device mesh, e.g. 2x4: the batch split 2 ways ('data'), attention heads, MLP and "
                        "vocabulary 4 ways ('model', Megatron-style; the KV cache follows the heads); the model axis "
                        "must divide the query and KV heads. Default: one device. On a CPU, simulate N devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N")


def place_on_mesh(model, mesh):
    """`model` (a `loading.LoadedModel`) with its params on `mesh` (`sharding.shard_params`);
    unchanged for None. Raises ValueError when the mesh's model axis does not divide the attention
    heads (`sharding.check_model_axis`)."""
    if mesh is None:
        return model
    import dataclasses

    from . import sharding

    sharding.check_model_axis(model.cfg, mesh.shape["model"], what=os.path.basename(model.path) or "the model")
    return dataclasses.replace(model, params=sharding.shard_params(model.params, mesh))
