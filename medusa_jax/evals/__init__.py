"""Measurements behind the commands: lossless output (`lossless`: Medusa against plain, the near-tie
rule), speed (`speed`: timed generation, per-category tables) and memory (`memory`: the plan of a
decoding step on a mesh)."""
from medusa_jax.evals.lossless import TIE_GAPS, Comparison, compare
from medusa_jax.evals.memory import format_plan, plan
from medusa_jax.evals.speed import summarize

__all__ = ["TIE_GAPS", "Comparison", "compare", "format_plan", "plan", "summarize"]
