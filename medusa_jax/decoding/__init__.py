"""Decoding: the pure, jittable parts of a speculative step: the tree (`tree`, `tree_arrays`, the
settings of prompt lookup and of a tree chosen per step: `lookup`, `dynamic_spec`), what a step
verifies (`proposal`: the `Drafter` interface; its drafters are `medusa_jax.drafts`), the step
(`step`, `acceptance`, `sampling`, `processors`, `logprobs`), the decode state and prefill. Imports
nothing of `drafts`, `engine`, `train`, `tuning`, `evals` or `convert`; the entry points
(`generate`, `generate_batch`, ...) are `medusa_jax.engine`'s."""
from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.args import PromptTooLongError
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.state import DecodeState, StepOutput
from medusa_jax.decoding.step import medusa_step
from medusa_jax.decoding.tree import TreeBuffers, build_tree, dynamic_tree, get_tree, with_lookup

__all__ = ["Acceptance", "DecodeState", "DraftInputs", "Drafter", "PromptLookup", "PromptTooLongError", "Proposal",
           "StepOutput", "TreeBuffers", "build_tree", "dynamic_tree", "get_tree", "medusa_step", "start_state",
           "with_lookup"]
