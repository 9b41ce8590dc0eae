"""Memory plan of one decoding step on a device mesh, from the compiled step, with nothing allocated.

``medusa-plan --config llama-2-7b --mesh 1x8 --dtype bfloat16 --max-len 4096 --batch 8``

The decoding step (`medusa_jax.decoding.step.step`, the jitted `medusa_jax.decoding.step.medusa_step`) is
lowered and compiled by XLA for abstract inputs (`jax.ShapeDtypeStruct` with their
`NamedSharding`), exactly as decoding lays them out on a ``DATAxMODEL`` mesh
(`medusa_jax.sharding`: Megatron-style on 'model', rows on 'data'):

- backbone params: the shapes of ``LlamaModel(cfg).init`` (`jax.eval_shape`), every leaf in
  ``--dtype`` (as ``load_model(dtype=...)`` stores them), placed by `sharding.spec_for`;
- Medusa heads: ``MedusaHeads`` with one residual block each and the backbone's shared lm_head,
  readied for the tree as decoding readies them (`heads.medusa.prepare_heads`: only the first
  tree-depth heads are kept), in ``--dtype``;
- KV cache: k, v ``[L, B, KVH, S, Dh]`` in ``--dtype``, B on 'data' and KVH on 'model'
  (`sharding.cache_spec`), lengths ``[B]`` int32 and token ids ``[B, S]`` int32 (counted with the
  decode state);
- decode state: logits ``[B, V]`` float32, hidden ``[B, D]``, per-row keys ``[B, 2]`` uint32 and
  temperature and top_p ``[B]`` float32 and top_k ``[B]`` int32, rows on 'data'.

The figures are per device, in bytes: what one device holds of each input (its shard,
``NamedSharding.shard_shape``), XLA's temporaries (``compiled.memory_analysis()``) and the step's
outputs that do not reuse a donated input. ``total = params + heads + KV cache + state +
unaliased outputs + temporaries`` is the step's peak. XLA's own argument size is reported beside
the sum of the inputs' shards as a cross-check. Prefill (chunks of `decoding.prefill.PREFILL_CHUNK` tokens)
is not planned; its temporaries scale with the chunk, not the tree.

Devices: compiling for a mesh needs its data x model devices. `main` asks the CPU platform for
that many simulated devices (``XLA_FLAGS=--xla_force_host_platform_device_count``) before JAX
starts, so the plan runs on any machine; on a machine whose default devices are too few, the
CPU's are used. The figures are then those of XLA's CPU compiler: weights, KV cache and state are
the same on any platform, temporaries are not. XLA:CPU has no native bfloat16 / float16 dots or
scatters and converts their whole operands to float32, so a bfloat16 plan's temporaries hold about
two bytes per weight and per cache entry more (llama-2-7b on 1x8, bfloat16, S 4096, B 8: 7.1 GiB
of temporaries, float32: 0.17 GiB); the result's ``notes`` say so. A GPU or TPU compile makes no
such copies.

The default tree (``--tree-nodes``, T tokens with the root): the first T - 1 nodes of the
official ``mc_sim_7b_63`` tree (FasterDecoding/Medusa, `decoding.tree.MC_SIM_7B_63`, acceptance order) of
depth <= K; 64 by default (the whole tree when K >= 4). A larger T than that tree holds is the
greedy tree (`decoding.tree_estimates.greedy_tree_search`, Medusa Sec. 3.3.1) on a stand-in accuracy table
(`STAND_IN_ACCURACY`). With K = 0 the step is plain decoding (`decoding.tree.PLAIN_TREE`, T = 1).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from medusa_jax import sharding
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.state import DecodeState
from medusa_jax.decoding.step import StepConfig, step
from medusa_jax.drafts import drafter_for
from medusa_jax.decoding.tree import MC_SIM_7B_63, PLAIN_TREE, build_tree, prefix_closed_head
from medusa_jax.decoding.tree_estimates import greedy_tree_search
from medusa_jax.heads.config import MedusaConfig
from medusa_jax.heads.medusa import MedusaHeads, prepare_heads
from medusa_jax.models.config import DTYPES, ModelConfig
from medusa_jax.models.kv_cache import KVCache
from medusa_jax.models.llama import LlamaModel

#: Hugging Face ``config.json`` values of the preset models (the published configs).
#: vicuna-7b is lmsys/vicuna-7b-v1.5 (Llama 2 based; v1.3, the base of the official Medusa heads,
#: has the same shapes with max_position_embeddings 2048 and rms_norm_eps 1e-6).
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama-2-7b": {  # meta-llama/Llama-2-7b-hf
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float16"},
    "llama-2-13b": {  # meta-llama/Llama-2-13b-hf
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 40, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float16"},
    "llama-2-70b": {  # meta-llama/Llama-2-70b-hf (grouped-query attention: 8 KV heads)
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float16"},
    "vicuna-7b": {  # lmsys/vicuna-7b-v1.5
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
        "torch_dtype": "float16"},
}


ACCEPTANCES: Tuple[str, ...] = ("greedy", "exact", "typical")


#: Tree tokens (root included) of the default tree: the whole ``mc_sim_7b_63`` tree.
DEFAULT_TREE_NODES = 64


#: Candidates per head of the planned trees (the official trees' top-k).
TREE_TOPK = 10


#: Stand-in rank accuracies for trees larger than ``mc_sim_7b_63``: head k's rank-r token is taken
#: to be right with probability ``STAND_IN_ACCURACY ** (k + 1) / (r + 1)``. Only the tree's shape
#: matters to memory; this gives bushy shallow levels and thin deep ones, as calibrated trees have.
STAND_IN_ACCURACY = 0.7


def load_hf_config(spec: str) -> Tuple[Dict[str, Any], str]:
    """The HF config dict that `spec` names, and a label for it.

    Args:
      spec: a preset name (`PRESETS`), a path to a ``config.json``, or a directory holding one.
    Returns:
      (config dict, label: the preset name or the file's path).
    Raises:
      ValueError: not a preset and no such file (the message lists the presets), or a file that is
        not a JSON object.
    """
    if spec in PRESETS:
        return dict(PRESETS[spec]), spec
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise ValueError(f"--config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json "
                         "file or a directory holding one")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as a Hugging Face config.json: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json), got {type(d).__name__}")
    return d, path


def plan_tree(num_heads: int, tree_nodes: Optional[int] = None):
    """The Medusa tree a plan compiles the step for (see the module docstring).

    Args:
      num_heads: K >= 0 Medusa heads; 0: plain decoding.
      tree_nodes: T, tree tokens with the root (>= 2 with heads; only 1 or None without); None:
        up to `DEFAULT_TREE_NODES` nodes of ``mc_sim_7b_63`` of depth <= K (fewer when K is small:
        the official tree has 10 nodes at depth 1).
    Returns:
      `decoding.tree.TreeBuffers` of depth <= K and exactly T tokens when T was given.
    Raises:
      ValueError: K < 0, T < 2 with heads, T > 1 without heads, or T more than a tree of depth K
        with top-10 heads can hold.
    """


    if num_heads < 0:
        raise ValueError(f"--medusa-heads must be >= 0 (0: plain decoding), got {num_heads}")
    if num_heads == 0:
        if tree_nodes not in (None, 1):
            raise ValueError(f"--tree-nodes {tree_nodes} needs Medusa heads: plain decoding (--medusa-heads 0) "
                             "runs the root alone (T = 1)")
        return PLAIN_TREE
    n = DEFAULT_TREE_NODES if tree_nodes is None else int(tree_nodes)
    if n < 2:
        raise ValueError(f"--tree-nodes must be >= 2 with Medusa heads (the root and at least one candidate), got "
                         f"{n}; for the root alone plan plain decoding with --medusa-heads 0")
    choices = prefix_closed_head([p for p in MC_SIM_7B_63 if len(p) <= num_heads], n - 1)
    if len(choices) < n - 1 and tree_nodes is not None:
        acc = np.array([[STAND_IN_ACCURACY ** (k + 1) / (r + 1) for r in range(TREE_TOPK)]
                        for k in range(num_heads)])
        choices = greedy_tree_search(acc, n, topk=TREE_TOPK)
        if len(choices) < n - 1:
            raise ValueError(f"--tree-nodes {n} exceeds the {len(choices) + 1} nodes a tree of depth {num_heads} "
                             f"with top-{TREE_TOPK} heads can hold; use fewer nodes or more --medusa-heads")
    return build_tree(choices, topk=TREE_TOPK, num_heads=num_heads)


def _mesh_devices(need: int) -> list:
    """The default devices, or the CPU's when the default platform has fewer than `need`."""

    devs = jax.devices()
    if len(devs) < need and devs[0].platform != "cpu":
        try:
            cpu = jax.devices("cpu")
        except RuntimeError:
            cpu = []
        if len(cpu) >= need:
            return cpu
    return devs


def shard_bytes(tree) -> int:
    """Bytes one device holds of every `jax.ShapeDtypeStruct` leaf of `tree` (its shard: the
    sharding's ``shard_shape`` of the leaf's shape, times the itemsize; the whole leaf without a
    sharding). Returns an int (0 for an empty tree)."""

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return int(total)


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of `tree`, whole (no sharding): e.g. the weights a plain decoding
    step streams (`tune`'s roofline). Returns an int (0 for an empty tree)."""

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def _acceptance(name: str):

    if name not in ACCEPTANCES:
        raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, got {name!r}")
    if name == "greedy":
        return Acceptance()
    return Acceptance(temperature=1.0, method=name).check()


def _model_config(hf_config_or_preset: Any) -> Tuple[ModelConfig, str]:
    """The `ModelConfig` of a preset name, a config.json path or directory, or an HF config dict, and
    its label (`load_hf_config`; "config dict" for a dict). Raises ValueError as `plan` says."""
    if isinstance(hf_config_or_preset, Mapping):
        hf, label = dict(hf_config_or_preset), "config dict"
    else:
        hf, label = load_hf_config(str(hf_config_or_preset))
    try:
        return ModelConfig.from_hf_dict(hf, source=label), label
    except KeyError as e:
        raise ValueError(f"{label}: missing key {e} (a Hugging Face config.json of a Llama-family model)") from None


def _place(mesh_obj, path: str, shape, dtype_, spec=None) -> jax.ShapeDtypeStruct:
    """An abstract array of `shape` and `dtype_` laid out on `mesh_obj` as decoding lays it out: by its
    param `path` (`sharding.spec_for`), or by `spec` fitted to the shape (`sharding.fit_spec`)."""
    spec = sharding.spec_for(path, shape, mesh_obj) if spec is None else sharding.fit_spec(spec, shape, mesh_obj)
    return jax.ShapeDtypeStruct(tuple(shape), dtype_, sharding=NamedSharding(mesh_obj, spec))


def _placed_tree(mesh_obj, abstract, dt):
    """Every leaf of the params tree `abstract` as an abstract array in `dt`, placed by its path (`_place`)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: _place(mesh_obj, sharding.path_str(p), x.shape, dt), abstract)


def _abstract_params(cfg: ModelConfig, mesh_obj, dt):
    """The backbone's params as placed abstract arrays in `dt` (the shapes of ``LlamaModel(cfg).init``)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract = jax.eval_shape(lambda t: LlamaModel(cfg).init(jax.random.PRNGKey(0), t, t)["params"], tokens)
    return _placed_tree(mesh_obj, abstract, dt)


def _abstract_heads(cfg: ModelConfig, mesh_obj, dt, medusa_heads: int, depth: int):
    """(heads config, placed abstract head params in `dt`) of `medusa_heads` one-block Medusa heads
    sharing the backbone's lm_head, readied for a tree of `depth` as decoding readies them (only the
    first `depth` heads kept); (None, None) for depth 0 (plain decoding)."""
    if depth <= 0:
        return None, None
    full_cfg = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                            num_heads=medusa_heads, num_layers=1, shared_lm_head=True)
    hidden = jax.ShapeDtypeStruct((1, cfg.hidden_size), jnp.float32)
    raw = jax.eval_shape(lambda h: MedusaHeads(full_cfg).init(jax.random.PRNGKey(0), h,
                                                              method=MedusaHeads.head_states)["params"], hidden)
    prepared = {}

    def ready(p):  # decoding keeps the first tree-depth heads only (`generate.decoding_setup`)
        c, out = prepare_heads(full_cfg, p, None, depth=depth)
        prepared["cfg"] = c
        return out

    head_params = _placed_tree(mesh_obj, jax.eval_shape(ready, raw), dt)
    return prepared["cfg"], head_params


def _abstract_state(cfg: ModelConfig, mesh_obj, dt, B: int, S: int) -> DecodeState:
    """The decode state of B rows and S cache slots as placed abstract arrays: the KV cache k, v
    [L, B, KVH, S, Dh] in `dt` (`sharding.cache_spec`), lengths [B] and tokens [B, S] int32, logits
    [B, V] float32, hidden [B, D] in `dt`, keys [B, 2] uint32, temperature, top_p [B] float32 and
    top_k [B] int32, rows on 'data'."""
    kv_shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    rows = lambda shape, dtype_: _place(mesh_obj, "", shape, dtype_, sharding.batch_spec(len(shape)))
    cache = KVCache(k=_place(mesh_obj, "", kv_shape, dt, sharding.cache_spec()),
                    v=_place(mesh_obj, "", kv_shape, dt, sharding.cache_spec()),
                    lengths=rows((B,), jnp.int32), tokens=rows((B, S), jnp.int32))
    return DecodeState(logits=rows((B, cfg.vocab_size), jnp.float32), hidden=rows((B, cfg.hidden_size), dt),
                       cache=cache, key=rows((B, 2), jnp.uint32), temperature=rows((B,), jnp.float32),
                       top_p=rows((B,), jnp.float32), top_k=rows((B,), jnp.int32))


def _plan_notes(data: int, B: int, platform: str, dt) -> list:
    """The plan's caveats: rows replicated when B does not divide by the data devices, and XLA:CPU's
    float32 copies in the temporaries of a plan in another dtype."""
    notes = []
    if data > 1 and B % data:
        notes.append(f"batch {B} does not divide by the mesh's {data} data devices: the rows, the KV cache and "
                     f"the decode state are replicated on every data device (each holds all {B} rows) instead "
                     f"of split; a batch that divides by {data} splits them")
    if platform == "cpu" and dt != jnp.float32:
        notes.append(f"XLA's CPU compiler runs {dt.name} products and cache updates in float32, converting whole "
                     "operands (weights, KV cache): temp_bytes holds float32 copies that a GPU or TPU compile does "
                     "not make (params, heads, KV cache and state are the same on every platform; the --dtype "
                     "float32 plan's temporaries bound the activations)")
    return notes


def plan(hf_config_or_preset: Any, mesh: str = "1x1", dtype: str = "bfloat16", max_len: int = 4096,
         batch: int = 8, medusa_heads: int = 4, tree_nodes: Optional[int] = None,
         acceptance: str = "greedy") -> Dict[str, Any]:
    """Per-device memory of one decoding step, from XLA's compilation of it; nothing is allocated.

    Args:
      hf_config_or_preset: a preset name (`PRESETS`), a path to an HF ``config.json`` (or a directory
        holding one), or an HF config dict.
      mesh: ``"DATAxMODEL"`` (`sharding.parse_mesh`); needs data * model devices (see the module
        docstring; in a process whose backend has started, they must exist already).
      dtype: "float32", "bfloat16" or "float16": params, heads, KV cache and activations.
      max_len: S, KV cache slots per row, in [T, max_position_embeddings] (T: tree tokens).
      batch: B >= 1 rows (split on 'data' when B divides by it, else replicated).
      medusa_heads: K >= 0 Medusa heads (one residual block each, the backbone's lm_head shared);
        0: plain decoding.
      tree_nodes: T, tree tokens with the root (`plan_tree`); None: the default tree.
      acceptance: "greedy" (temperature 0), "exact" or "typical" (sampling; more temporaries:
        the tree's [B, T, V] log-probabilities).
    Returns:
      A JSON-serialisable dict. Per device, ints in bytes: ``params_bytes`` (backbone shards),
      ``heads_bytes`` (the heads decoding keeps: the first tree-depth of them), ``kv_cache_bytes``
      (k and v shards), ``state_bytes`` (logits, hidden, keys, temperature, top_p, top_k, cache lengths and
      token ids), ``output_bytes`` / ``alias_bytes`` (XLA's outputs and the part of them that reuses donated
      inputs), ``unaliased_output_bytes``, ``temp_bytes`` (XLA's temporaries), ``argument_bytes``
      (XLA's arguments: equals params + heads + KV cache + state), ``total_bytes`` (params + heads +
      KV cache + state + unaliased outputs + temporaries); ``params_global_bytes`` (the whole
      backbone, unsharded); ``compile_s`` (seconds); ``notes`` (list of str: caveats, e.g. XLA:CPU's
      float32 copies in a bfloat16 plan's temporaries); and the echo of the inputs: ``config``,
      ``arch``, ``num_layers``, ``hidden_size``, ``intermediate_size``, ``vocab_size``,
      ``num_heads``, ``num_kv_heads``, ``head_dim``, ``mesh``, ``data``, ``model``, ``devices``,
      ``platform``, ``dtype``, ``batch``, ``max_len``, ``medusa_heads``, ``heads_used``,
      ``tree_nodes``, ``tree_depth``, ``acceptance``.
    Raises:
      ValueError: an unknown preset or missing / unreadable config file (naming the presets), an
        unsupported architecture, a malformed mesh, a model axis that does not divide the attention
        heads (naming the sizes that work), fewer devices than the mesh needs, a dtype outside
        `DTYPES`, batch < 1, max_len outside [T, max_position_embeddings], or a bad tree size.
      RuntimeError: XLA's compiler for the platform gives no memory analysis.
    """


    cfg, label = _model_config(hf_config_or_preset)
    data, model = sharding.parse_mesh(mesh)
    sharding.check_model_axis(cfg, model)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dt = jnp.dtype(dtype)
    if int(batch) < 1:
        raise ValueError(f"--batch must be >= 1 row, got {batch}")
    acc = _acceptance(acceptance)
    tree = plan_tree(int(medusa_heads), tree_nodes)
    B, S = int(batch), int(max_len)
    ctx = cfg.max_position_embeddings
    if not tree.size <= S <= ctx:
        raise ValueError(f"--max-len {S} must be in [{tree.size}, {ctx}]: at least the tree's {tree.size} tokens "
                         f"and at most the model's context (max_position_embeddings {ctx}), as decoding refuses "
                         "a larger cache")
    mesh_obj = sharding.make_mesh(data, model, _mesh_devices(data * model))
    params = _abstract_params(cfg, mesh_obj, dt)
    heads_cfg, head_params = _abstract_heads(cfg, mesh_obj, dt, int(medusa_heads), tree.max_depth)
    state = _abstract_state(cfg, mesh_obj, dt, B, S)
    cache = state.cache

    t0 = time.perf_counter()
    with jax.set_mesh(mesh_obj):
        compiled = step.lower(StepConfig(cfg, heads_cfg, drafter_for(tree), acc), params, head_params, state).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is None:
        raise RuntimeError(f"XLA's {mesh_obj.devices.flat[0].platform} compiler gives no memory analysis")

    params_b = shard_bytes(params)
    heads_b = shard_bytes(head_params) if head_params is not None else 0
    kv_b = shard_bytes((cache.k, cache.v))
    state_b = shard_bytes((cache.lengths, cache.tokens, state.logits, state.hidden, state.key, state.temperature,
                           state.top_p, state.top_k))
    out_b, alias_b = int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes)
    unaliased = max(out_b - alias_b, 0)
    temp_b = int(mem.temp_size_in_bytes)
    dev = mesh_obj.devices.flat[0]
    return {
        "config": label, "arch": cfg.arch, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "mesh": f"{data}x{model}", "data": data, "model": model, "devices": data * model, "platform": dev.platform,
        "dtype": dt.name, "batch": B, "max_len": S, "medusa_heads": int(medusa_heads),
        "heads_used": tree.max_depth, "tree_nodes": tree.size, "tree_depth": tree.max_depth,
        "acceptance": acceptance,
        "params_bytes": params_b, "heads_bytes": heads_b, "kv_cache_bytes": kv_b, "state_bytes": state_b,
        "unaliased_output_bytes": unaliased, "temp_bytes": temp_b,
        "total_bytes": params_b + heads_b + kv_b + state_b + unaliased + temp_b,
        "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": out_b, "alias_bytes": alias_b,
        "params_global_bytes": tree_bytes(params), "compile_s": round(compile_s, 2),
        "notes": _plan_notes(data, B, dev.platform, dt),
    }


_GIB = 1024 ** 3


def format_plan(r: Mapping[str, Any]) -> str:
    """The readable report of a `plan` result: a header line and a per-device table (GiB with two
    decimals, and bytes)."""
    heads = (f"{r['medusa_heads']} Medusa heads ({r['heads_used']} used by the tree)" if r["medusa_heads"]
             else "plain decoding")
    head = (f"memory plan of one decoding step: {r['config']} on a {r['mesh']} mesh ({r['devices']} "
            f"{r['platform']} device{'s' if r['devices'] > 1 else ''}), {r['dtype']}, batch {r['batch']}, "
            f"max-len {r['max_len']}, tree {r['tree_nodes']} node{'s' if r['tree_nodes'] > 1 else ''} "
            f"(depth {r['tree_depth']}), {heads}, {r['acceptance']} acceptance; compiled in {r['compile_s']:.1f} s")
    rows = [("backbone params", r["params_bytes"]), ("Medusa heads", r["heads_bytes"]),
            ("KV cache", r["kv_cache_bytes"]), ("decode state", r["state_bytes"]),
            ("outputs (not aliased)", r["unaliased_output_bytes"]), ("XLA temporaries", r["temp_bytes"]),
            ("total", r["total_bytes"])]
    lines = [head, f"{'per device':<24}{'GiB':>10}{'bytes':>18}"]
    for i, (name, b) in enumerate(rows):
        if i == len(rows) - 1:
            lines.append("-" * 52)
        lines.append(f"  {name:<22}{b / _GIB:>10.2f}{b:>18,}")
    inputs = r["params_bytes"] + r["heads_bytes"] + r["kv_cache_bytes"] + r["state_bytes"]
    lines.append(f"cross-check: XLA's arguments {r['argument_bytes']:,} bytes, the inputs' shards above "
                 f"{inputs:,} bytes; whole backbone {r['params_global_bytes'] / _GIB:.2f} GiB")
    lines.extend(f"note: {n}" for n in r.get("notes", ()))
    return "\n".join(lines)
