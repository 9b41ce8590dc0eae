"""The engine: requests in, tokens out. `engine` (the continuous-batching `Engine`: admission,
prefill, regrouping, the speculation choice, dispatch and read-back, streaming), `chooser` (the
tree per step from the measured step costs), `rows` (the host's view of a batch row), `batch`
(the jitted batched step and row moves), `loop` (N steps in one on-device loop) and `generate`
(the entry points: `generate`, `generate_stream`, `generate_device`, `generate_batch`). Uses
`medusa_jax.decoding` for the step and `medusa_jax.drafts` for the drafters; imports nothing of the
server or the commands. (The function `generate` is not re-exported here, where it would hide the
module of that name: take it from `medusa_jax` or `medusa_jax.engine.generate`.)"""
from medusa_jax.engine.engine import Engine
from medusa_jax.engine.generate import (BatchStats, DeviceResult, GenerationResult, generate_batch, generate_device,
                                        generate_stream)

__all__ = ["BatchStats", "DeviceResult", "Engine", "GenerationResult", "generate_batch", "generate_device",
           "generate_stream"]
