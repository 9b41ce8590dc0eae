"""Decoding: the tree (`tree`, `tree_arrays`, `lookup`; chosen per step: `dynamic`), one static-shape
step (`draft`, `acceptance`, `step`),
prefill, the on-device loop and the entry points (`generate`: `generate`, `generate_stream`,
`generate_device`, `generate_batch`). Imports nothing of `train`, `tuning`, `evals` or `convert`.
(The function `generate` is not re-exported here, where it would hide the module of that name:
take it from `medusa_jax` or `medusa_jax.decoding.generate`.)"""
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import PromptTooLongError
from medusa_jax.decoding.generate import (
                                          BatchStats,
                                          DeviceResult,
                                          GenerationResult,
                                          generate_batch,
                                          generate_device,
                                          generate_stream,
)
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.state import DecodeState, StepOutput
from medusa_jax.decoding.step import medusa_step
from medusa_jax.decoding.tree import TreeBuffers, build_tree, dynamic_tree, get_tree, with_lookup

__all__ = ["Acceptance", "BatchStats", "DecodeState", "DeviceResult", "GenerationResult", "PromptLookup",
           "PromptTooLongError", "StepOutput", "TreeBuffers", "build_tree", "dynamic_tree", "generate_batch", "generate_device",
           "generate_stream", "get_tree", "medusa_step", "start_state", "with_lookup"]
