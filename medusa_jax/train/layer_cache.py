"""Medusa-2 on the top N layers: the residual stream entering layer L - N, computed once per training
sequence (the frozen bottom layers never change) and kept on disk, so that a joint step runs
forward and backward through the N trained layers and the heads only.

The cache is one float32 array of [sum of the sequences' lengths, D] rows (a sparse memory-mapped
``.npy``: only the sequences a run visits are computed and written) and a [N] bool array of the
sequences done, keyed by a fingerprint of the model, data and layer (another fingerprint starts it
afresh).
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from medusa_jax.models.config import ModelConfig
from medusa_jax.models.llama import LlamaModel
from medusa_jax.train.config import TrainConfig
from medusa_jax.train.hidden import (Backbone, Pair, bucket_len, examples_checksum, length_batches, padded_sequences,
                                     sequence_positions, weights_stamp)

#: Version of the layout; a cache of another version is recomputed.
CACHE_FORMAT = 1

#: Seconds between saves of the finished sequences while computing (a killed run resumes from them).
SAVE_EVERY_S = 60


@functools.lru_cache(maxsize=4)
def _inputs_fn(cfg: ModelConfig, layer: int):
    @jax.jit
    def fn(params, tokens):
        return LlamaModel(cfg).apply({"params": params}, tokens, sequence_positions(tokens), layer,
                                     method=LlamaModel.layer_inputs)
    return fn


class LayerInputs:
    """The residual stream entering decoder layer `layer` for each of `examples`, cached.

    Args:
      tc: the training config (max_seq_len, hidden_batch_tokens, hidden_dir, data, seed).
      backbone: the frozen `Backbone` (its params compute the inputs).
      examples: (ids [T] int32, loss_mask [T] bool) pairs, cut to ``tc.max_seq_len`` tokens.
      layer: the first trained layer, L - train_layers.
      out_dir: the run directory (the cache goes to ``hidden_dir`` or ``out_dir/hidden``; in a
        multi-process run each process keeps its own file, ``.p<index>`` after the first's name).
    """

    def __init__(self, tc: TrainConfig, backbone: Backbone, examples: Sequence[Pair], layer: int, out_dir: str):
        self.tc, self.backbone, self.examples, self.layer = tc, backbone, examples, layer
        self.lengths = np.array([min(len(ids), tc.max_seq_len) for ids, _ in examples], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        D = backbone.cfg.hidden_size
        key = {"model": backbone.path, "weights": weights_stamp(backbone.path), "cfg": repr(backbone.cfg),
               "data": tc.data, "layer": layer,
               "random": [tc.seed, tc.random_init_std] if backbone.path == "random" else None,
               "n": len(examples), "sum": examples_checksum(examples), "max_seq_len": tc.max_seq_len,
               "format": CACHE_FORMAT}
        proc = jax.process_index()
        base = os.path.join(tc.hidden_dir or os.path.join(out_dir, "hidden"),
                            f"layer{layer}_inputs" + (f".p{proc}" if proc else ""))
        self.path, self._done_path = base + ".npy", base + ".done.npy"
        shape = (int(self.offsets[-1]), D)
        meta = base + ".json"
        if os.path.isfile(meta) and os.path.isfile(self.path) and os.path.isfile(self._done_path):
            with open(meta) as f:
                if json.load(f) == key:
                    self.rows = np.load(self.path, mmap_mode="r+")
                    self.done = np.load(self._done_path)
                    return
        os.makedirs(os.path.dirname(base), exist_ok=True)
        self.rows = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float32, shape=shape)  # sparse on disk
        self.done = np.zeros(len(examples), bool)
        self._save()
        with open(meta, "w") as f:
            json.dump(key, f)

    def ensure(self, indices, progress: bool = True) -> int:
        """Compute the inputs of every sequence in `indices` not cached yet (sorted by length, in
        batches of about hidden_batch_tokens tokens padded to a bucket, jitted); returns how many
        sequences were computed."""
        todo = sorted({int(i) for i in indices if not self.done[int(i)]})
        if not todo:
            return 0
        fn = _inputs_fn(self.backbone.cfg, self.layer)
        bar = tqdm(total=int(self.lengths[todo].sum()), desc=f"layer {self.layer} inputs", unit="tok", leave=False,
                   disable=not progress)
        saved = time.monotonic()
        for _, nrows, group in length_batches(self.examples, self.tc.max_seq_len, self.tc.hidden_batch_tokens, todo):
            tokens, _ = padded_sequences([self.examples[i] for i in group], nrows, self.tc.max_seq_len)
            x = np.asarray(fn(self.backbone.params, jnp.asarray(tokens)), np.float32)
            for r, i in enumerate(group):
                self.rows[self.offsets[i]:self.offsets[i + 1]] = x[r, :self.lengths[i]]
                self.done[i] = True
            bar.update(int(self.lengths[group].sum()))
            if time.monotonic() - saved > SAVE_EVERY_S:  # a killed run keeps what it computed
                self._save()
                saved = time.monotonic()
        bar.close()
        self._save()
        return len(todo)

    def _save(self) -> None:
        self.rows.flush()
        tmp = self._done_path + ".tmp.npy"
        np.save(tmp, self.done)
        os.replace(tmp, self._done_path)

    def batch(self, indices, rows: int) -> np.ndarray:
        """x [rows, T, D] float32 for the sequences `indices` (computed if needed), zero-padded to
        the bucketed length T of `hidden.padded_sequences` over the same sequences (and zero rows
        up to `rows`), so that it lines up with that function's tokens."""
        indices = [int(i) for i in indices]
        self.ensure(indices, progress=False)
        T = bucket_len(int(max(len(self.examples[i][0]) for i in indices)), self.tc.max_seq_len)
        out = np.zeros((rows, T, self.rows.shape[1]), np.float32)
        for r, i in enumerate(indices):
            n = min(int(self.lengths[i]), T)
            out[r, :n] = self.rows[self.offsets[i]:self.offsets[i] + n]
        return out


def first_trained_layer(tc: TrainConfig, mcfg: ModelConfig) -> Optional[int]:
    """The first decoder layer that trains: L - train_layers in joint mode with train_layers > 0,
    else None (the whole backbone, or none in frozen mode). Raises ValueError when train_layers > L."""
    if tc.mode != "joint" or not tc.train_layers:
        return None
    if tc.train_layers > mcfg.num_layers:
        raise ValueError(f"train_layers={tc.train_layers}, but the model has {mcfg.num_layers} layers; set "
                         f"train_layers <= {mcfg.num_layers} (0 = the whole backbone)")
    return mcfg.num_layers - tc.train_layers


def top_layers(params: dict, first: int, num_layers: int) -> dict:
    """The params of decoder layers first .. num_layers - 1 (``layers_{i}``): what trains with
    train_layers > 0. The arrays are shared, not copied."""
    return {f"layers_{i}": params[f"layers_{i}"] for i in range(first, num_layers)}


def merged_backbone(base: dict, trained: dict, first: Optional[int]) -> dict:
    """The whole trained backbone: `trained` itself when the whole backbone trained (first None),
    else `base` with the trained top layers in place of its own (shared arrays, no copies)."""
    return trained if first is None else {**base, **trained}
