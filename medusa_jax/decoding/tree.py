"""Medusa candidate trees: ``medusa_choices`` -> static buffers for tree attention (numpy only).

A tree is given by its non-root nodes, each a path of ranks ``(r_0, ..., r_{d-1})``: ``r_i`` is the
rank of the token in head ``i``'s top-k. The root (depth 0, the base model's own next token) is
implicit. Nodes are ordered root first, then paths sorted by ``(depth, ranks)``; any prefix of that
order is prefix-closed (a parent has a smaller depth, so it comes first). ``T = 1 + len(choices)``.

Candidates are gathered from a flat vector ``[root, head0 top-k, head1 top-k, ...]``, so node at
depth ``d >= 1`` with last rank ``r`` reads index ``1 + (d-1)*topk + r``.

Source: Cai et al. 2024, "Medusa", Sec. 2.1.2 (tree attention) and Sec. 3.3.1 (optimised tree
construction); conventions follow ``generate_medusa_buffers`` in FasterDecoding/Medusa
(medusa/model/utils.py), except that retrieve rows are padded with node 0 plus a ``valid`` mask.

Parent-dependent candidates (Hydra heads, Ankner et al. 2024, Sec. 3): a node's children are the
top-k of head ``d`` evaluated on that node's own path, so the draft runs depth by depth over the
nodes that have children ("expanded" nodes). Their static lists are ``expand_nodes`` (by depth,
``expand_offsets``), ``node_paths`` (each node's path root..node), and ``parent_tree_indices``:
node i's index into the flat vector ``[root, expanded node 0's top-k, expanded node 1's top-k, ...]``
(``1 + slot(parent) * topk + rank``), the per-parent counterpart of ``tree_indices``.

A tree may instead be chosen per step (`dynamic_tree`, ``"dynamic:T"``; `medusa_jax.drafts.dynamic`,
its settings `medusa_jax.decoding.dynamic_spec`):
T nodes picked from the heads' proposals by cumulative draft probability every step, the ancestor
mask, positions and paths built on the device. Its static buffers are then those of its deepest
path (a chain of D nodes: what a static shape needs, such as the heads to prepare), while ``size``
(T), ``num_paths`` (T: every node ends a path) and ``step_size`` describe the tree a step verifies.

A tree may also carry prompt-lookup settings (`with_lookup`, `medusa_jax.decoding.lookup`): a step then
verifies a chain copied from the context instead of the heads' tree whenever the context's last
n-gram occurred before (a dynamic tree takes the copied chains as more branches within its budget:
`drafts.dynamic.add_chain_tokens`). Tree files keep them under ``"prompt_lookup"``.
"""
from __future__ import annotations

import functools
import json
import os
import random
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import yaml

from medusa_jax.decoding.dynamic_spec import DEFAULT_DYNAMIC_WIDTH, DynamicSpec, dynamic_spec
from medusa_jax.decoding.lookup import PromptLookup

Path = tuple[int, ...]


# Official 63-node sparse tree for Vicuna-7B (FasterDecoding/Medusa medusa/model/medusa_choices.py),
# listed roughly by estimated acceptance probability.
MC_SIM_7B_63: tuple[Path, ...] = tuple(tuple(p) for p in [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0],
    [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]])


def prefix_closed_head(paths: Sequence[Path], num_choices: int) -> tuple[Path, ...]:
    """First ``num_choices`` paths of a priority list whose parent is already taken."""
    out: list[Path] = []
    for p in paths:
        if len(out) >= num_choices:
            break
        if len(p) == 1 or p[:-1] in out:
            out.append(p)
    return tuple(out)


#: Preset trees. ``small_N`` has N tree tokens (T = N, i.e. N-1 choices): the first N-1 nodes of
#: ``mc_sim_7b_63`` in its listed (acceptance) order. ``chainN`` is the top-1 chain of depth N.
PRESETS: dict[str, tuple[Path, ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    **{f"chain{n}": tuple((0,) * d for d in range(1, n + 1)) for n in range(1, 6)},
    **{f"small_{n}": prefix_closed_head(MC_SIM_7B_63, n - 1) for n in (4, 8, 16, 32)},
}


def _ro(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False, repr=False)
class TreeBuffers:
    """Static buffers of one Medusa tree; hashable on ``(medusa_choices, topk)`` (a jit static arg).

    Arrays (read-only numpy), with T nodes, max depth D and P root-to-leaf paths:
      ancestor_mask   [T, T] bool   node i attends to node j iff j == i or j is an ancestor of i
      depth           [T]    int32  root 0; also the position offset of each node
      tree_indices    [T]    int32  index into the flat candidate vector (0 for the root)
      parents         [T]    int32  parent node index, -1 for the root
      retrieve_indices[P, D+1] int32 node indices root..leaf per leaf, padded with 0
      valid           [P, D+1] bool  False on the padding
    For parent-dependent candidates (hydra heads; see the module docstring), with M nodes that have
    children:
      node_paths      [T, D+1] int32 node indices root..node per node (row i, entries 0..depth[i]),
                                     padded with 0
      expand_nodes    [M]    int32  the nodes with children, in node order (hence by depth)
      expand_offsets  [D+1]  int32  depth d's expanded nodes are expand_nodes[off[d]:off[d+1]]
                                     (every depth < D has at least one)
      parent_tree_indices [T] int32 index into ``[root, top-k of expanded node 0, of node 1, ...]``
                                     (``1 + slot(parent) * topk + rank``; 0 for the root)
    """
    medusa_choices: tuple[Path, ...]
    topk: int
    ancestor_mask: np.ndarray
    depth: np.ndarray
    tree_indices: np.ndarray
    parents: np.ndarray
    retrieve_indices: np.ndarray
    valid: np.ndarray
    node_paths: np.ndarray
    expand_nodes: np.ndarray
    expand_offsets: np.ndarray
    parent_tree_indices: np.ndarray
    lookup: PromptLookup | None = None
    dynamic: DynamicSpec | None = None

    @property
    def size(self) -> int:
        """T: number of tree tokens, root included (a dynamic tree's budget)."""
        return self.dynamic.budget if self.dynamic is not None else len(self.medusa_choices) + 1

    @property
    def max_depth(self) -> int:
        """D: depth of the deepest node (0 for the trivial tree)."""
        return int(self.depth.max())

    @property
    def num_paths(self) -> int:
        """P: number of root-to-leaf paths (= leaves; a dynamic tree: T, every node ends a path)."""
        return self.dynamic.budget if self.dynamic is not None else int(self.retrieve_indices.shape[0])

    @property
    def step_size(self) -> int:
        """The most tokens one step's forward runs: T, or the prompt-lookup chain's k + 1 when
        longer (the cache room a step needs); a dynamic tree's copied chain shares its T slots."""
        if self.lookup is None or self.dynamic is not None:  # a dynamic tree's chain is inside its budget
            return self.size
        return max(self.size, self.lookup.num_tokens + 1)

    @property
    def max_accepted(self) -> int:
        """The most candidates one step can accept: D, or the prompt-lookup draft's k when longer
        (at most T - 1 in a dynamic tree; a step emits at most max_accepted + 1 tokens)."""
        if self.lookup is None:
            return self.max_depth
        return max(self.max_depth, min(self.lookup.num_tokens, self.size - 1) if self.dynamic is not None
                   else self.lookup.num_tokens)

    @property
    def lookup_settings(self) -> dict | None:
        """The prompt-lookup settings as a dict (tree files, the tools' JSON), or None without."""
        return self.lookup._asdict() if self.lookup is not None else None

    def _key(self) -> tuple:
        return (self.medusa_choices, self.topk, self.lookup, self.dynamic)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeBuffers):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self.lookup is None else f", lookup={tuple(self.lookup)}"
        if self.dynamic is not None:
            extra += f", dynamic (width {self.dynamic.width})"
        return (f"TreeBuffers(T={self.size}, D={self.max_depth}, P={self.num_paths}, "
                f"topk={self.topk}{extra})")


def check_depth(depth: int, num_heads: int, what: str = "tree") -> None:
    """Raise ValueError when a tree (or path) of `depth` needs more than the `num_heads` heads there
    are: the package's one depth check, called by the tools before the model loads, by the
    generation entry points and by the step."""
    if depth > num_heads:
        if what.startswith("--"):  # a command's flag
            raise ValueError(f"{what} has depth {depth} but the heads have only {num_heads}; give a shallower "
                             f"{what} (a preset such as chain{max(num_heads, 1)}, dynamic:T, or a medusa_choices "
                             f"file at most {num_heads} deep) or heads with more heads")
        raise ValueError(f"{what} has depth {depth} but the heads have only {num_heads}; use a shallower tree (a "
                         f"preset such as chain{max(num_heads, 1)}, truncate_tree, or a medusa_choices file) or "
                         "more heads (heads from resolve_heads or prepare_heads keep only their tree's depth: pass "
                         "the tree you decode with to resolve_heads(tree_spec=...))")


def normalise_choices(medusa_choices: Iterable[Any], topk: int, num_heads: int | None) -> tuple[Path, ...]:
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer))
                                  or num_heads < 0):
        raise ValueError(f"num_heads must be a non-negative integer or None, got {num_heads!r}")
    if isinstance(medusa_choices, (str, bytes)) or not isinstance(medusa_choices, Iterable):
        raise ValueError("medusa_choices must be a sequence of paths (sequences of integer ranks), "
                         f"got {type(medusa_choices).__name__}")
    paths: list[Path] = []
    for raw in medusa_choices:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, (Sequence, np.ndarray)):
            raise ValueError(f"each path must be a sequence of integer ranks, got {raw!r}; "
                             "write a depth-1 node as (r,) or [r], not r")
        if len(raw) == 0:
            raise ValueError("empty path in medusa_choices: the root is implicit, do not list it")
        for r in raw:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise ValueError(f"path {list(raw)!r} has a non-integer entry {r!r}; ranks must be ints")
        path = tuple(int(r) for r in raw)
        for r in path:
            if r < 0 or r >= topk:
                raise ValueError(f"path {path} has rank {r} outside [0, topk={topk}); "
                                 "use ranks below topk or raise topk")
        if num_heads is not None:
            check_depth(len(path), num_heads, what=f"path {path}")
        paths.append(path)
    seen: set[Path] = set()
    for p in paths:
        if p in seen:
            raise ValueError(f"duplicate path {p} in medusa_choices; list each node once")
        seen.add(p)
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"path {p} has no parent {p[:-1]} in medusa_choices; the tree must be "
                             "prefix-closed: add the parent or remove the node")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def build_tree(medusa_choices: Iterable[Sequence[int]], topk: int = 10,
               num_heads: int | None = None) -> TreeBuffers:
    """Build the static tree-attention buffers (Medusa Sec. 2.1.2; ``generate_medusa_buffers``).

    Args:
      medusa_choices: paths of ranks, any order; ``[]`` is the trivial tree (plain decoding:
        T=1, D=0, P=1, retrieve ``[[0]]``).
      topk: candidates per head; every rank must be ``< topk``.
      num_heads: number of Medusa heads, when given no path may be deeper.
    Returns: TreeBuffers (see its docstring for shapes and dtypes).
    Raises: ValueError for a non-integer entry, an empty path, a rank outside ``[0, topk)``, a path
      deeper than ``num_heads``, a duplicate path, or a node whose parent path is missing.
    """
    choices = normalise_choices(medusa_choices, topk, num_heads)
    t = len(choices) + 1
    index: dict[Path, int] = {(): 0}
    for i, p in enumerate(choices):
        index[p] = i + 1
    depth = np.zeros(t, np.int32)
    parents = np.full(t, -1, np.int32)
    tree_indices = np.zeros(t, np.int32)
    mask = np.eye(t, dtype=bool)
    has_child = np.zeros(t, bool)
    for i, p in enumerate(choices, start=1):
        par = index[p[:-1]]  # sorted by depth: the parent's row is already complete
        depth[i], parents[i] = len(p), par
        tree_indices[i] = 1 + (len(p) - 1) * topk + p[-1]
        mask[i] |= mask[par]
        has_child[par] = True
    leaves = np.flatnonzero(~has_child)
    d = int(depth.max())
    retrieve = np.zeros((len(leaves), d + 1), np.int32)
    valid = np.zeros((len(leaves), d + 1), bool)
    for row, leaf in enumerate(leaves):
        node, k = int(leaf), int(depth[leaf])
        valid[row, :k + 1] = True
        while node >= 0:
            retrieve[row, k] = node
            node, k = int(parents[node]), k - 1
    node_paths = np.zeros((t, d + 1), np.int32)
    for i in range(1, t):
        node_paths[i] = node_paths[parents[i]]
        node_paths[i, depth[i]] = i
    expand = np.flatnonzero(has_child).astype(np.int32)  # node order: by depth, root first
    offsets = np.searchsorted(depth[expand], np.arange(d + 1)).astype(np.int32)
    slot = np.full(t, -1, np.int32)
    slot[expand] = np.arange(len(expand), dtype=np.int32)
    parent_idx = np.zeros(t, np.int32)
    for i, p in enumerate(choices, start=1):
        parent_idx[i] = 1 + slot[parents[i]] * topk + p[-1]
    return TreeBuffers(choices, int(topk), _ro(mask), _ro(depth), _ro(tree_indices), _ro(parents),
                       _ro(retrieve), _ro(valid), _ro(node_paths), _ro(expand), _ro(offsets), _ro(parent_idx))


def dynamic_tree(budget: int, depth: int, topk: int = 10, width: int = DEFAULT_DYNAMIC_WIDTH,
                 confidence: Any = None, lookup_confidence: Sequence | None = None,
                 lookup_ngram_confidence: Any = None) -> TreeBuffers:
    """A tree of `budget` nodes (root included) chosen per step from the first `depth` heads' top-`topk`
    proposals by cumulative draft probability (`medusa_jax.drafts.dynamic`; EAGLE-2, Li et al. 2024,
    Sec. 4; for hydra heads `width` parents are expanded per depth; `confidence`: `DynamicSpec`'s,
    as a pair of sequences or a ``{"knots": [...], "values": [[...], ...]}`` dict; `lookup_confidence`:
    its rows, or one flat row for the latest match; `lookup_ngram_confidence`: ``{n: row}`` or
    ``(n, row)`` pairs, keys may be strings as JSON writes them). Its static
    buffers are the chain of `depth` nodes (module docstring).
    Raises: ValueError for a budget below 2, a width below 1, more nodes than the heads draft, or a
      malformed confidence."""
    spec = dynamic_spec(budget, width, confidence, lookup_confidence, lookup_ngram_confidence).check(depth, topk)
    chain = build_tree([(0,) * d for d in range(1, depth + 1)], topk)
    return replace(chain, dynamic=spec._replace(budget=int(spec.budget), width=int(spec.width)))


def _resized(tree: TreeBuffers, budget: int, depth: int, topk: int | None = None) -> TreeBuffers:
    """A dynamic tree's spec at another budget, depth or topk (its lookup settings not included)."""
    d = tree.dynamic
    return dynamic_tree(budget, depth, tree.topk if topk is None else topk, d.width, d.confidence, d.lookup_confidence,
                        d.lookup_ngram_confidence)


def _dynamic_from_name(name: str, topk: int | None, num_heads: int | None) -> TreeBuffers:
    """``dynamic:T`` or ``dynamic:T:W`` (budget T, width W), as deep as the heads (4 when unknown)."""
    parts = name.split(":")[1:]
    try:
        if not 1 <= len(parts) <= 2:
            raise ValueError
        budget, width = int(parts[0]), int(parts[1]) if len(parts) > 1 else DEFAULT_DYNAMIC_WIDTH
    except ValueError:
        raise ValueError(f"bad dynamic tree {name!r}: write dynamic:T or dynamic:T:W (T nodes per step, root "
                         "included; W parents expanded per depth), e.g. dynamic:16") from None
    depth = num_heads if num_heads is not None else 4
    return dynamic_tree(budget, min(depth, max(budget - 1, 1)), 10 if topk is None else topk, width)


def _load_choices_file(path: str) -> tuple[Any, int | None, Any]:
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        with open(path) as f:
            data = yaml.safe_load(f) if is_yaml else json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError, UnicodeDecodeError (not text), YAML's errors
        mark = getattr(e, "problem_mark", None)
        detail = (f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
                  if mark is not None and getattr(e, "problem", None) else " ".join(str(e).split()))
        raise ValueError(f"{path}: not valid {'YAML' if is_yaml else 'JSON'}: {detail}") from None
    topk = lookup = None
    if isinstance(data, Mapping) and "dynamic" in data:
        d = data["dynamic"]
        if not isinstance(d, Mapping) or "budget" not in d:
            raise ValueError(f"{path}: 'dynamic' must be a dict such as {{\"budget\": 16, \"width\": 4}}")
        return d, data.get("topk"), data.get("prompt_lookup")
    if isinstance(data, Mapping):
        if "medusa_choices" not in data:
            raise ValueError(f"{path}: a dict tree file needs the key 'medusa_choices'")
        topk = data.get("topk")
        lookup = data.get("prompt_lookup")
        if lookup is not None and not isinstance(lookup, Mapping):
            raise ValueError(f"{path}: 'prompt_lookup' must be a dict such as "
                             "{\"num_tokens\": 3, \"max_ngram\": 3, \"min_ngram\": 2}")
        data = data["medusa_choices"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of paths or a dict with 'medusa_choices'")
    return data, topk, lookup


def get_tree(spec: Any, topk: int | None = None, num_heads: int | None = None) -> TreeBuffers:
    """Resolve a tree spec to TreeBuffers.

    ``spec``: a TreeBuffers (returned as is when topk agrees), a preset name from ``PRESETS``, a
    path to a ``.json``/``.yaml``/``.yml`` file holding a list of paths or a dict with key
    ``medusa_choices`` (and optionally ``topk`` and ``prompt_lookup``, `with_lookup`), or a sequence
    of paths; or ``dynamic:T[:W]``, a tree of T nodes chosen per step (`dynamic_tree`, as deep as
    `num_heads`), which a tree file gives as ``{"dynamic": {"budget": T, "width": W}}`` (and optionally
    ``"confidence"``: `dynamic_tree`). ``topk`` defaults to the file's ``topk``, else 10.
    Raises: ValueError for an unknown name (the message lists the presets) and every
      ``build_tree`` error.
    """
    if isinstance(spec, TreeBuffers):
        if spec.dynamic is not None:
            k = spec.topk if topk is None else topk
            depth = spec.max_depth if num_heads is None else min(spec.max_depth, num_heads)
            if (k, depth) == (spec.topk, spec.max_depth):
                return spec
            return with_lookup(_resized(spec, spec.dynamic.budget, depth, k), spec.lookup)
        if topk is not None and topk != spec.topk:
            return with_lookup(build_tree(spec.medusa_choices, topk, num_heads), spec.lookup)
        if num_heads is not None:
            normalise_choices(spec.medusa_choices, spec.topk, num_heads)
        return spec
    if isinstance(spec, (str, os.PathLike)):
        name = os.fspath(spec)
        if name.startswith("dynamic:"):
            return _dynamic_from_name(name, topk, num_heads)
        if name in PRESETS:
            return build_tree(PRESETS[name], 10 if topk is None else topk, num_heads)
        if os.path.isfile(name):
            choices, file_topk, lookup = _load_choices_file(name)
            k = topk if topk is not None else (file_topk if file_topk is not None else 10)
            try:
                if isinstance(choices, Mapping):  # {"budget": T, "width": W}
                    depth = num_heads if num_heads is not None else 4
                    tree = dynamic_tree(choices["budget"], min(depth, max(int(choices["budget"]) - 1, 1)), k,
                                        choices.get("width", DEFAULT_DYNAMIC_WIDTH), choices.get("confidence"),
                                        choices.get("lookup_confidence"), choices.get("lookup_ngram_confidence"))
                    return with_lookup(tree, lookup)
                return with_lookup(build_tree(choices, k, num_heads), lookup)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name}: {e}") from None
        raise ValueError(f"unknown tree {name!r}: not a file; presets are {', '.join(sorted(PRESETS))}")
    return build_tree(spec, 10 if topk is None else topk, num_heads)


def tree_to_json(tree: TreeBuffers | Sequence[Sequence[int]], path: str | os.PathLike | None = None,
                 topk: int | None = None) -> str:
    """Serialise a tree as ``{"medusa_choices": [[...], ...], "topk": k}`` (readable by get_tree),
    with ``"prompt_lookup": {...}`` when the tree carries prompt-lookup settings.

    Writes the text to ``path`` when given; returns it either way.
    """
    lookup = None
    if isinstance(tree, TreeBuffers):
        choices, k, lookup = tree.medusa_choices, tree.topk, tree.lookup_settings
    else:
        choices = normalise_choices(tree, topk or 10, None)
        k = topk or 10
    if isinstance(tree, TreeBuffers) and tree.dynamic is not None:
        dyn = tree.dynamic
        data = {"dynamic": {"budget": int(dyn.budget), "width": int(dyn.width)}, "topk": int(k)}
        if dyn.confidence is not None:
            data["dynamic"]["confidence"] = {"knots": list(dyn.confidence[0]),
                                             "values": [list(v) for v in dyn.confidence[1]]}
        if dyn.lookup_confidence is not None:
            data["dynamic"]["lookup_confidence"] = [list(r) for r in dyn.lookup_confidence]
        if dyn.lookup_ngram_confidence is not None:
            data["dynamic"]["lookup_ngram_confidence"] = {str(n): list(r) for n, r in dyn.lookup_ngram_confidence}
    else:
        data = {"medusa_choices": [list(p) for p in choices], "topk": int(k)}
    if lookup is not None:
        data["prompt_lookup"] = lookup
    text = json.dumps(data)
    if path is not None:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def random_tree(num_nodes: int, max_depth: int, topk: int, seed: int = 0) -> tuple[Path, ...]:
    """A random prefix-closed tree with ``num_nodes`` tree tokens (root included), sorted.

    Raises: ValueError if ``num_nodes < 1`` or the tree cannot be that large with this depth/topk.
    """
    capacity = sum(topk ** d for d in range(max_depth + 1))
    if num_nodes < 1 or num_nodes > capacity:
        raise ValueError(f"num_nodes must be in [1, {capacity}] for max_depth={max_depth}, "
                         f"topk={topk}, got {num_nodes}")
    rng = random.Random(seed)
    nodes: list[Path] = [()]
    taken: set[Path] = {()}
    while len(nodes) < num_nodes:
        parent = rng.choice(nodes)
        if len(parent) >= max_depth:
            continue
        free = [r for r in range(topk) if parent + (r,) not in taken]
        if free:
            child = parent + (rng.choice(free),)
            nodes.append(child)
            taken.add(child)
    return tuple(sorted(nodes[1:], key=lambda p: (len(p), p)))


def truncate_tree(tree: TreeBuffers, max_depth: int) -> TreeBuffers:
    """Keep the nodes of depth <= ``max_depth`` (fewer heads than depth, or near the cache end).

    ``max_depth=0`` gives the trivial tree. Raises: ValueError if ``max_depth < 0``.
    """
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if max_depth >= tree.max_depth:
        return tree
    if tree.dynamic is not None and max_depth > 0:
        w = tree.dynamic.width
        return _resized(tree, min(tree.size, 1 + tree.topk * (1 + (max_depth - 1) * w)), max_depth)
    return build_tree([p for p in tree.medusa_choices if len(p) <= max_depth], tree.topk)


def tree_with_budget(tree: TreeBuffers, max_nodes: int) -> TreeBuffers:
    """Keep the first ``max_nodes`` tree tokens (root included) in node order.

    Node order is (depth, ranks), so any prefix of it is prefix-closed. To keep a priority order
    instead (e.g. greedy_tree_search's), slice that list and call build_tree.
    Raises: ValueError if ``max_nodes < 1``.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (the root), got {max_nodes}")
    if max_nodes >= tree.size:
        return tree
    if tree.dynamic is not None:
        if max_nodes == 1:
            return build_tree([], tree.topk)
        return _resized(tree, max_nodes, min(tree.max_depth, max_nodes - 1))
    return build_tree(tree.medusa_choices[:max_nodes - 1], tree.topk)


def with_lookup(tree: TreeBuffers, lookup: PromptLookup | Mapping[str, int] | None) -> TreeBuffers:
    """`tree` with prompt-lookup drafting (`medusa_jax.decoding.lookup`): `lookup` a `PromptLookup`, a dict
    of its fields, or None (none). Raises ValueError for invalid settings or unknown keys."""
    if isinstance(lookup, Mapping):
        unknown = set(lookup) - set(PromptLookup._fields)
        if unknown:
            raise ValueError(f"unknown prompt_lookup keys {sorted(unknown)}; known: {', '.join(PromptLookup._fields)}")
        lookup = PromptLookup(**{k: int(v) for k, v in lookup.items()})
    if lookup is not None:
        lookup = PromptLookup(*(int(x) for x in lookup)).check()
        if lookup.matches > 1 and tree.dynamic is None:
            raise ValueError(f"prompt lookup offers {lookup.matches} matches only inside a tree chosen per step "
                             "(--tree dynamic:T): a static tree verifies one copied chain; use matches 1")
    return replace(tree, lookup=lookup)


@functools.lru_cache(maxsize=None)
def chain_tree(num_tokens: int):
    """The tree a prompt-lookup draft is verified on: a chain of `num_tokens` nodes below the root
    (`build_tree` of ``(0,), (0, 0), ...`` with topk 1), cached."""
    return build_tree([(0,) * d for d in range(1, num_tokens + 1)], topk=1)


PLAIN_TREE: TreeBuffers = build_tree([], topk=1)
