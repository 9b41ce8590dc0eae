"""Which heads and which tree to decode with: the shipped heads, a heads directory or fresh ones,
the tree saved with them or asked for, prompt lookup, and what `medusa_jax.tuning` calibrated for them."""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from medusa_jax import sharding
from medusa_jax.convert.load import weights_of
from medusa_jax.convert.medusa_format import load_heads, read_heads_config
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.tree import PRESETS, TreeBuffers, dynamic_tree, get_tree, with_lookup
from medusa_jax.decoding.tree_estimates import expected_acceptance_length
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import check_heads_match, init_heads, prepare_heads
from medusa_jax.models.llama import compute_dtype, lm_head_blocks, lm_head_matrix

_ASSET_HEADS = os.path.join(os.path.dirname(__file__), "assets", "heads")


#: Heads shipped for the default model (SmolLM2-135M-Instruct), inside the package.
DEFAULT_HEADS_DIR = os.path.join(_ASSET_HEADS, "smollm2-135m-instruct")


#: The other heads shipped for the default model, by the name `--heads` accepts: the paper's
#: Medusa-1 heads (Cai et al. 2024, Sec. 2.2.1), kept beside the default (Hydra) heads.
SHIPPED_HEADS = {"medusa1": os.path.join(_ASSET_HEADS, "smollm2-135m-instruct-medusa1")}


#: Prompt lookup (`medusa_jax.decoding.lookup`) on the tools' trees unless asked otherwise: copies of 3
#: tokens after a repeated 3- or 2-gram. On Spec-Bench with SmolLM2-135M it beat copies of 2, 4
#: and 6 and 1-grams (docs/performance.md, "Prompt lookup").
DEFAULT_PROMPT_LOOKUP = PromptLookup(num_tokens=3, max_ngram=3, min_ngram=2)

#: Matches of the n-gram copied into a tree chosen per step (``dynamic:T``) unless its file says: the
#: latest two (`PromptLookup.matches`; docs/performance.md, "several matches").
DYNAMIC_LOOKUP_MATCHES = 2

#: Tokens copied per match into a tree chosen per step unless asked otherwise: the copied tokens
#: compete for the tree's T slots (at most T - 1 of them are ever kept), so a longer copy costs
#: nothing when the heads' nodes score better; a copied token's acceptance rises with its depth
#: (0.79, 0.85, 0.89, 0.90, ... 0.95 at depth 8 on the held-out chats). MT-bench, dynamic:16 with
#: 8 against 3: docs/performance.md, "Longer copies in larger trees".
DYNAMIC_LOOKUP_TOKENS = 8

#: The longest n-gram a tree chosen per step matches (its shortest: `DEFAULT_PROMPT_LOOKUP`'s): the
#: match's length tells how sure its copy is (`DynamicSpec.lookup_ngram_confidence`).
DYNAMIC_LOOKUP_MAX_NGRAM = DEFAULT_PROMPT_LOOKUP.max_ngram


def default_lookup(tree: TreeBuffers, num_tokens: Optional[int] = None) -> PromptLookup:
    """`DEFAULT_PROMPT_LOOKUP` copying `num_tokens` (None: its 3 for a static tree,
    `DYNAMIC_LOOKUP_TOKENS` for a dynamic one), with `DYNAMIC_LOOKUP_MATCHES` matches for a dynamic
    tree (a static tree verifies one copied chain)."""
    dynamic = tree.dynamic is not None
    if num_tokens is None:
        num_tokens = DYNAMIC_LOOKUP_TOKENS if dynamic else DEFAULT_PROMPT_LOOKUP.num_tokens
    return dynamic_lookup(num_tokens) if dynamic else DEFAULT_PROMPT_LOOKUP._replace(num_tokens=num_tokens)


def dynamic_lookup(num_tokens: int) -> PromptLookup:
    """The prompt lookup of a tree chosen per step, copying `num_tokens`: `DEFAULT_PROMPT_LOOKUP`'s
    n-grams up to `DYNAMIC_LOOKUP_MAX_NGRAM`, `DYNAMIC_LOOKUP_MATCHES` matches (decoding's, and what
    tune replays and measures dynamic trees with)."""
    return DEFAULT_PROMPT_LOOKUP._replace(num_tokens=num_tokens, matches=DYNAMIC_LOOKUP_MATCHES,
                                          max_ngram=DYNAMIC_LOOKUP_MAX_NGRAM)


def tree_lookup(tree: TreeBuffers, prompt_lookup: Optional[int] = None) -> TreeBuffers:
    """`tree` with the prompt lookup asked for: None: the tree's own (a tree file's
    ``prompt_lookup``), else `default_lookup`; 0: none; K > 0: copies of K tokens (n-grams and
    matches as the default's). Raises ValueError for K < 0."""
    if prompt_lookup is None:
        return tree if tree.lookup is not None else with_lookup(tree, default_lookup(tree))
    if prompt_lookup < 0:
        raise ValueError(f"--prompt-lookup takes the tokens copied per draft (0 = off), got {prompt_lookup}")
    return with_lookup(tree, default_lookup(tree, prompt_lookup) if prompt_lookup else None)


#: Tree used when neither --tree nor the heads name one.
DEFAULT_TREE = "small_16"


def heads_location(heads_path: Optional[str]) -> Optional[str]:
    """`heads_path` with a shipped heads name (`SHIPPED_HEADS`, e.g. "medusa1") replaced by its
    directory; anything else (None, "zero", a path; an existing path of that name wins) unchanged."""
    if heads_path in SHIPPED_HEADS and not os.path.exists(heads_path):
        return SHIPPED_HEADS[heads_path]
    return heads_path


def resolve_tree(spec, heads_cfg: MedusaConfig) -> TreeBuffers:
    """The Medusa tree: `spec` (preset name, JSON/YAML file, ``dynamic:T[:W]`` or paths) if given, else
    the tree saved with the heads, else `DEFAULT_TREE` cut to the heads' depth. (`resolve_heads`
    passes the dynamic tree `medusa_jax.cli.tune` chose, when it chose one, as `spec`.)

    Raises ValueError for an unknown preset, a malformed file, or a tree deeper than the heads.
    """
    if spec is not None:
        return get_tree(spec, topk=None, num_heads=heads_cfg.num_heads)
    if heads_cfg.medusa_choices:
        return get_tree(heads_cfg.medusa_choices, topk=heads_cfg.topk, num_heads=heads_cfg.num_heads)
    choices = [p for p in PRESETS[DEFAULT_TREE] if len(p) <= heads_cfg.num_heads]
    return get_tree(choices, topk=heads_cfg.topk, num_heads=heads_cfg.num_heads)


def with_confidence(tree: TreeBuffers, confidence, lookup_confidence=None, lookup_ngram_confidence=None
                    ) -> TreeBuffers:
    """A dynamic tree scoring its nodes by the heads' measured `confidence` and prompt lookup's
    `lookup_confidence` and `lookup_ngram_confidence` (``tree_search.confidence``,
    ``lookup_confidence`` and ``lookup_ngram_confidence``, saved by `medusa_jax.cli.tune`:
    `tuning.confidence`), where it has none of its own; other trees as they are."""
    d = tree.dynamic
    if d is None:
        return tree
    conf = d.confidence if d.confidence is not None else (confidence or None)
    look = d.lookup_confidence if d.lookup_confidence is not None else (lookup_confidence or None)
    by_n = d.lookup_ngram_confidence if d.lookup_ngram_confidence is not None else (lookup_ngram_confidence or None)
    if (conf, look, by_n) == (d.confidence, d.lookup_confidence, d.lookup_ngram_confidence):
        return tree
    return with_lookup(dynamic_tree(d.budget, tree.max_depth, tree.topk, d.width, conf, look, by_n), tree.lookup)


def resolve_heads(model, heads_path: Optional[str], tree_spec=None, use_medusa: bool = True,
                  zero_heads: int = 4, prompt_lookup: Optional[int] = None
                  ) -> Tuple[Optional[Tuple[MedusaConfig, dict]], Optional[TreeBuffers], str]:
    """Heads and tree for a loaded model.

    Args:
      model: a `convert.load.LoadedModel`.
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
      that tree (`heads.medusa.prepare_heads`): only its first ``tree.max_depth`` heads are kept, so a
      deeper tree needs another call.
    Raises:
      FileNotFoundError / HeadsFormatError / HeadsMismatchError from `load_heads` for an explicit
      path that is missing, corrupt or made for another backbone; ValueError for a bad tree.
    """
    if not use_medusa:
        return None, None, ""

    heads_path = heads_location(heads_path)

    def without_heads(why: str):  # prompt lookup alone, unless it is off
        alone = tree_lookup(get_tree([]), prompt_lookup)
        if alone.lookup is None:
            return None, None, why + "; decoding plainly"
        return None, alone, why + "; decoding with prompt lookup only (no heads)"

    if heads_path == "zero":

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

    if getattr(model, "params", None) is not None:  # the heads compute in the backbone's dtype
        dt = compute_dtype(model.params)
        params = {k: (v.astype(dt) if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating) else v)
                  for k, v in params.items()}
    calibration = (heads_calibration(heads_path, weights_of(getattr(model, "params", None))) or {}) \
        if heads_path != "zero" else {}
    if tree_spec is None and calibration.get("dynamic_tree"):  # the tree tune chose, when it chose one per step
        saved = calibration["dynamic_tree"]
        tree_spec = f"dynamic:{int(saved['budget'])}:{int(saved['width'])}"
    elif tree_spec is None and calibration.get("medusa_choices"):  # tune's static tree for these weights
        heads_cfg = heads_cfg.replace(medusa_choices=tuple(tuple(p) for p in calibration["medusa_choices"]))
    tree = tree_lookup(with_confidence(resolve_tree(tree_spec, heads_cfg), calibration.get("confidence"),
                                       calibration.get("lookup_confidence"),
                                       calibration.get("lookup_ngram_confidence")), prompt_lookup)
    # once, here, rather than every step: only the tree's heads, the proposal projection precomputed
    need_base = heads_cfg.proposal_vocab_size or not heads_cfg.shared_lm_head
    base = functools.partial(lm_head_matrix, model.cfg, model.params) if need_base else None  # built if needed
    blocks = lm_head_blocks(model.cfg, model.params) if need_base else None  # the draft reads them as stored
    heads_cfg, params = prepare_heads(heads_cfg, params, base, depth=max(tree.max_depth, 1), lm_head_blocks=blocks)
    # once, here, for a model on a device mesh (`place_on_mesh`): decoding would otherwise place them every call
    params = sharding.shard_params(params, sharding.mesh_of(getattr(model, "params", None)))
    return (heads_cfg, params), tree, ""


def untuned_note(heads_path: Optional[str], heads, tree: Optional[TreeBuffers], calibration: Optional[dict],
                 tree_spec=None, model_path: Optional[str] = None) -> str:
    """A hint for heads that `medusa_jax.cli.tune` never calibrated (no ``tree_search`` report: heads
    in the official or vLLM format, which have no place for one) decoding with the tree of their
    config (its ``medusa_choices``, or the default tree) because no `tree_spec` was given; ""
    otherwise. Without a proposal vocabulary every head projects onto the whole vocabulary each
    step: on a CPU such heads decoded at a tenth of plain decoding's speed, with nothing saying why.

    heads: the (MedusaConfig, params) `resolve_heads` returned, or None. model_path: the backbone
    given (--model; None: the default model), named in the suggested command with the
    self-distillation data tune needs for it."""
    if heads is None or tree is None or heads_path == "zero" or calibration or tree_spec is not None:
        return ""
    vocab = "" if heads[0].proposal_vocab_size else ", each head projecting onto the whole vocabulary"
    return (f"these heads have no medusa-tune report, so they decode with the {tree.size}-token tree of their "
            f"config{vocab}: on this device that may be slower than plain decoding; `medusa-tune "
            + (f"--model {model_path} --data DISTILLED " if model_path else "")
            + f"--heads {heads_path} --proposal-vocab 8192 --out DIR` writes them to DIR with a tree and a proposal "
            "vocabulary chosen for this device" + (" (DISTILLED: medusa-distill's answers of this model)"
                                                   if model_path else "") + " (or give --tree)")


def heads_calibration(heads_path: Optional[str], weights: Optional[str] = None) -> Optional[dict]:
    """The ``tree_search`` report that `medusa_jax.cli.tune` saved with the heads (calibrated
    ``rank_accuracies`` [K][topk], measured costs, the chosen tree), or None when there is none.
    `heads_path` None means the shipped heads; "zero" has none. `weights` ("as-stored" or
    "float32", `convert.load.weights_of`): the report tune made on weights of that kind (step
    costs, hence trees, differ between them): the latest (``tree_search``, whose ``weights`` says
    which; float32 when it does not) or an earlier one kept in ``tree_search_by_weights``; the
    latest when there is none for them."""
    if heads_path == "zero":
        return None

    try:
        cfg = read_heads_config(heads_location(heads_path) or DEFAULT_HEADS_DIR)
    except (OSError, ValueError):
        return None
    latest = cfg.get("tree_search")
    if weights is None or latest is None or latest.get("weights", "float32") == weights:
        return latest
    return (cfg.get("tree_search_by_weights") or {}).get(weights) or latest


def predicted_tokens_per_step(tree: TreeBuffers, calibration: Optional[dict]) -> Optional[Tuple[float, str]]:
    """The tokens per step `medusa_jax.cli.tune` predicts for `tree`, and on what basis, or None.

    For the tree tune chose, with the prompt lookup it chose it with (or with none), the figure tune
    replayed on the held-out chats (`medusa_jax.tuning.replay`; with or without that lookup); for a
    tree chosen per step (``tree.dynamic``), the figure tune replayed for its budget and width (its
    ``dynamic_rows``); for another static tree, 1 + E[accepted] under the calibrated rank accuracies
    as if the heads erred independently (Medusa Sec. 3.3.1), which ignores prompt lookup. None
    without a calibration, and for a dynamic tree tune did not replay (or replayed with another
    prompt lookup)."""

    if not calibration or "rank_accuracies" not in calibration:
        return None
    lookup = tree.lookup_settings
    if tree.dynamic is not None:
        return _replayed_dynamic(tree, calibration, lookup)
    chosen = {tuple(p) for p in calibration.get("medusa_choices") or []}
    if (calibration.get("predicted_by") == "replay" and chosen == set(tree.medusa_choices)
            and not calibration.get("dynamic_tree")):  # else the figures are the dynamic tree's
        if lookup is None:
            return calibration["predicted_tokens_per_step"], "replayed on the held-out chats, heads alone"
        if lookup == calibration.get("prompt_lookup") and calibration.get("predicted_tokens_per_step_lookup"):
            return calibration["predicted_tokens_per_step_lookup"], "replayed on the held-out chats, with prompt lookup"
    try:
        e = expected_acceptance_length(tree, calibration["rank_accuracies"])
    except ValueError:
        return None
    return 1.0 + e, "rank accuracies, independent heads" + (", without prompt lookup" if lookup else "")


def _replayed_dynamic(tree: TreeBuffers, calibration: dict, lookup) -> Optional[Tuple[float, str]]:
    """tune's replayed tokens per step for dynamic `tree` (its ``dynamic_rows`` entry of the same
    budget and width), heads alone or with the prompt lookup tune replayed (its ``prompt_lookup``
    with `DYNAMIC_LOOKUP_MATCHES` matches and n-grams up to `DYNAMIC_LOOKUP_MAX_NGRAM`); else None."""
    replayed = {"budget": tree.dynamic.budget, "width": tree.dynamic.width}  # as tune writes a row's tree
    row = next((r for r in calibration.get("dynamic_rows") or [] if r.get("dynamic") == replayed), None)
    if row is None:
        return None
    if lookup is None:
        return row["predicted_tokens_per_step"], "replayed on the held-out chats, heads alone"
    replayed_lookup = calibration.get("prompt_lookup")  # tune replays a dynamic tree with several matches
    # copied tokens past depth T - 1 are never kept (each would need T - 1 ancestors above it), so copies
    # of K and K' tokens draft the same trees when both are at least T - 1 long
    kept = lambda settings: dict(settings, num_tokens=min(int(settings["num_tokens"]), tree.size - 1))
    replayed_lookup = replayed_lookup and dynamic_lookup(int(replayed_lookup["num_tokens"]))._asdict()  # as tune does
    if replayed_lookup and kept(lookup) == kept(replayed_lookup) \
            and row.get("predicted_tokens_per_step_lookup"):
        return row["predicted_tokens_per_step_lookup"], "replayed on the held-out chats, with prompt lookup"
    return None


def low_acceptance_note(tokens_per_step: float, steps: int, tree: Optional[TreeBuffers],
                        calibration: Optional[dict], base_model: str = "") -> str:
    """A hint when the drafts were hardly ever accepted: over at least `MIN_STEPS_NOTED` steps, the
    tokens per step stayed below a fifth of the way from 1 to what `medusa_jax.cli.tune` replayed for
    `tree` on the heads' held-out chats (`predicted_tokens_per_step`); "" otherwise, and without a
    prediction. Output is the same either way (greedy Medusa is plain greedy); what it says is that
    the heads do not fit this model or this kind of text (heads trained for another model of the same
    shape load without complaint), so decoding runs at plain speed or below."""
    predicted = predicted_tokens_per_step(tree, calibration) if tree is not None else None
    if predicted is None or steps < MIN_STEPS_NOTED or predicted[0] < 1.3:
        return ""
    if tokens_per_step >= 1.0 + 0.2 * (predicted[0] - 1.0):
        return ""
    made_for = f" (these were trained for {base_model})" if base_model else ""
    return (f"the drafts were hardly ever accepted: {tokens_per_step:.2f} tokens a step over {steps} steps, against "
            f"{predicted[0]:.2f} {predicted[1]}. Heads trained for another model{made_for}, or text far from "
            "their training data, accept little: the output is the same, the speed-up is lost (--no-medusa "
            "decodes plainly; train.py and medusa-tune fit heads to this model)")


#: The fewest steps after which `low_acceptance_note` judges the heads.
MIN_STEPS_NOTED = 32


def speed_note(tree: Optional[TreeBuffers], calibration: Optional[dict]) -> str:
    """A hint when `medusa_jax.cli.tune`, on this kind of device, predicted `tree` slower than plain
    decoding, or never timed a step as large as its; "" otherwise (and without a calibration made on
    this kind of device).

    Slower: a tree whose tokens per step tune replayed (`predicted_tokens_per_step`: the static tree
    it chose, a dynamic tree of a budget and width it replayed) are fewer than the plain steps its
    step costs, c(T) at its `TreeBuffers.step_size` (mean over the cache sizes tune timed, as tune
    compares trees). Larger: a tree whose step runs more tokens than the largest tune timed: on a
    CPU a step's cost grows with its tokens (~12 plain steps at 32 tokens on the GGUF blocks,
    docs/performance.md), so it may decode slower than plain while its tokens per step look good."""
    if tree is None or not calibration or calibration.get("device") != str(jax.devices()[0].device_kind):
        return ""
    key = "dynamic_cost_by_cache_size" if tree.dynamic is not None else "cost_by_cache_size"
    costs = [by_size for by_size in (calibration.get(key) or {}).values() if by_size]

    def cost(t: int) -> Optional[float]:  # c(t), mean over the cache sizes that timed it
        at = [by_size[str(t)] for by_size in costs if str(t) in by_size]
        return sum(at) / len(at) if at else None

    T = tree.step_size
    c = cost(T)
    if c is not None:
        predicted = predicted_tokens_per_step(tree, calibration)
        if predicted is None or not predicted[1].startswith("replayed") or predicted[0] >= c:
            return ""
        return (f"on this device ({calibration['device']}) this tree is predicted at {predicted[0] / c:.2f}x plain "
                f"decoding ({predicted[0]:.2f} tokens a step at {c:.2f} plain steps' cost, medusa-tune); "
                "--no-medusa is faster")
    timed = max((int(t) for by_size in costs for t in by_size), default=None)
    if timed is None or T <= timed:
        return ""
    return (f"this tree runs {T} tokens a step; medusa-tune timed steps on this device "
            f"({calibration['device']}) only up to {timed} tokens ({timed} cost {cost(timed):.2f} "
            f"plain steps; it chose {calibration.get('chosen_size')}): a larger step costs more, so this tree "
            f"may decode slower than plain; `medusa-tune --sizes {timed},{T}` predicts it, medusa-bench "
            "measures it")
