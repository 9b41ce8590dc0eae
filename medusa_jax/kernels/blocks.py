"""Weights kept as a GGUF file stores them: blocks of 32 values with float16 scales (issue 32).

`BlockWeight` is a [N, K] weight held as its blocks (``[N, K / 32 * bytes]`` uint8, `BLOCK_BYTES`)
and a format name. It is a JAX pytree (the blocks its one leaf, the format static), so it goes
through ``jax.device_put``, ``jax.jit`` and ``tree_map`` like an array, and it stands wherever the
decoding layout holds a weight (`models.layout.decoding_params`): `kernels.matmul_nt` multiplies by
it with the ``medusa_matmul_nt_<fmt>`` kernel, which dequantizes each block in registers, and an
embedding held this way is read a row at a time (`BlockWeight.rows`). Dequantized, its values are
the ``gguf`` package's float32 weights bit for bit (`dequantize_blocks`), so a model decoded from its
blocks is the model that the float32 copy holds.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

#: GGUF block formats the product kernel reads as a file stores them: bytes per block of 32 weights
#: (ggml's Q8_0: float16 d, 32 int8; Q4_0: float16 d, 16 bytes of 4-bit values; Q4_1: float16 d
#: and m, 16 bytes of 4-bit values).
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def block_format(fmt: str) -> int:
    """Bytes per block of `fmt`. Raises ValueError for a format not in `BLOCK_BYTES`."""
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(BLOCK_BYTES)}")
    return BLOCK_BYTES[fmt]


def dequantize_blocks(blocks: jax.Array, fmt: str) -> jax.Array:
    """GGUF blocks as float32 weights, computed as the ``gguf`` package computes them (bit for bit):
    Q8_0 ``float(q) * d``, Q4_0 ``d * float(q - 8)``, Q4_1 ``(d * float(q)) + m``.

    Args:
      blocks: [..., K / 32 * bytes per block] uint8, each row K / 32 blocks (`BLOCK_BYTES`).
      fmt: "q8_0", "q4_0" or "q4_1".
    Returns: [..., K] float32.
    Raises: ValueError for an unknown format or rows that are not whole blocks.
    """
    nbytes = block_format(fmt)
    *lead, R = blocks.shape
    if R % nbytes:
        raise ValueError(f"dequantize_blocks: rows of {R} bytes are not whole {fmt} blocks of {nbytes} bytes")
    b = blocks.reshape(*lead, R // nbytes, nbytes)
    half = lambda lo: jax.lax.bitcast_convert_type(  # noqa: E731
        jax.lax.bitcast_convert_type(b[..., lo:lo + 2], jnp.uint16), jnp.float16).astype(jnp.float32)[..., None]
    d = half(0)
    if fmt == "q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
        return (q * d).reshape(*lead, -1)
    qs = b[..., 2 if fmt == "q4_0" else 4:]
    q = jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)                   # values 0-15, then 16-31
    if fmt == "q4_0":
        return (d * (q.astype(jnp.int8) - 8).astype(jnp.float32)).reshape(*lead, -1)
    return ((d * q.astype(jnp.float32)) + half(2)).reshape(*lead, -1)


@jax.tree_util.register_pytree_node_class
class BlockWeight:
    """A [N, K] float32 weight held as GGUF blocks (module docstring).

    Attributes:
      blocks: [N, K / 32 * BLOCK_BYTES[fmt]] uint8 (numpy or jax), row n the K / 32 blocks of
        output n (the ``[out, in]`` layout the product kernels stream).
      fmt: "q8_0", "q4_0" or "q4_1".
    ``shape`` is (N, K) and ``dtype`` float32: the weight it stands for; ``nbytes`` the blocks'.
    Raises ValueError (at construction) for an unknown format or blocks that are not 2-D rows of
    whole blocks.
    """

    def __init__(self, blocks, fmt: str):
        nbytes = block_format(fmt)
        if getattr(blocks, "ndim", None) != 2 or blocks.shape[1] % nbytes or blocks.dtype != np.uint8:
            raise ValueError(f"BlockWeight: {fmt} blocks must be uint8 [N, K / 32 * {nbytes}], got "
                             f"{getattr(blocks, 'dtype', type(blocks).__name__)} {tuple(getattr(blocks, 'shape', ()))}")
        self.blocks = blocks
        self.fmt = fmt

    def tree_flatten(self):
        return (self.blocks,), self.fmt

    @classmethod
    def tree_unflatten(cls, fmt, children):
        obj = object.__new__(cls)  # children may be tracers or placeholders: no checks
        obj.blocks, obj.fmt = children[0], fmt
        return obj

    @property
    def shape(self) -> Tuple[int, int]:
        return (int(self.blocks.shape[0]), int(self.blocks.shape[1]) // BLOCK_BYTES[self.fmt] * 32)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self) -> jax.Array:
        """The weight as [N, K] float32 (`dequantize_blocks`)."""
        return dequantize_blocks(jnp.asarray(self.blocks), self.fmt)

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` ([...] int) of the weight as [..., K] float32: an embedding lookup that
        dequantizes only the rows it reads."""
        return dequantize_blocks(jnp.take(jnp.asarray(self.blocks), ids, axis=0), self.fmt)

    def __repr__(self) -> str:
        shape = self.shape if hasattr(self.blocks, "shape") else self.blocks  # (tree_map may put anything there)
        return f"BlockWeight({self.fmt}, {shape})"


def take_rows(table, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an embedding table: ``jnp.take(table, ids, axis=0)`` for an array [V, D]
    (-> [..., D] in its dtype), `BlockWeight.rows` (-> [..., D] float32) for GGUF blocks."""
    if isinstance(table, BlockWeight):
        return table.rows(ids)
    return jnp.take(table, ids, axis=0)
