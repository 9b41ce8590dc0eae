"""The Drafter interface (`decoding.proposal`, `medusa_jax.drafts`): each tree gets its drafter, and
the step verifies whatever a drafter proposes, without knowing which one it is: a drafter written
here (not one of the package's) still gives exactly plain greedy output, and a perfect one is
accepted in full."""
from dataclasses import dataclass
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax.decoding.acceptance import Acceptance
from medusa_jax.decoding.lookup import PromptLookup
from medusa_jax.decoding.prefill import start_state
from medusa_jax.decoding.proposal import DraftInputs, Drafter, Proposal
from medusa_jax.decoding.step import StepConfig, step
from medusa_jax.decoding.tree import PLAIN_TREE, build_tree, chain_tree, dynamic_tree, with_lookup
from medusa_jax.drafts import DynamicDrafter, HeadsDrafter, LookupDrafter, drafter_for

PROMPT = [5, 9, 3, 17, 4, 33, 8]
STEPS = 12


@dataclass(frozen=True)
class ChainDrafter(Drafter):
    """A drafter of this test's own: after each row's root, the next k tokens of `script` at the
    row's positions (the true continuation: an oracle), or, with ``script`` empty, tokens drawn
    from the position (wrong almost always)."""
    script: Tuple[int, ...] = ()

    def propose(self, x: DraftInputs) -> Proposal:
        k = self.tree.size - 1
        pos = x.state.cache.lengths[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None]  # [B, k]
        if self.script:
            table = jnp.asarray(self.script + (0,) * (k + 1), jnp.int32)
            guess = table[jnp.clip(pos - len(PROMPT), 0, table.shape[0] - 1)]
        else:
            guess = jax.random.randint(jax.random.PRNGKey(7), pos.shape, 0, x.cfg.vocab_size) ^ pos % x.cfg.vocab_size
        return Proposal(self.tree, jnp.concatenate([x.root[:, None], guess.astype(jnp.int32)], axis=1), False)


def _decode(cfg, params, drafter: Drafter, steps: int = STEPS):
    """(tokens emitted by `steps` greedy steps of `drafter` after PROMPT, tokens per step)."""
    state = start_state(cfg, params, [PROMPT], 64, progress=False)
    out_tokens, per_step = [], []
    for _ in range(steps):
        out, state = step(StepConfig(cfg, None, drafter, Acceptance()), params, None, state)
        n = int(out.num_tokens[0])
        out_tokens += [int(t) for t in np.asarray(out.tokens[0, :n])]
        per_step.append(n)
    return out_tokens, per_step


@pytest.fixture(scope="module")
def model():
    cfg, params = tiny_decoding_model()
    plain, per_step = _decode(cfg, params, drafter_for(PLAIN_TREE), steps=STEPS * 4)
    assert per_step == [1] * (STEPS * 4)
    return cfg, params, plain


def test_each_tree_gets_its_drafter():
    static = build_tree([(0,), (1,), (0, 0)], topk=2)
    dyn = dynamic_tree(6, 3, topk=4)
    lookup = PromptLookup(3, 3, 2)
    cases = [(PLAIN_TREE, HeadsDrafter), (static, HeadsDrafter), (with_lookup(static, lookup), LookupDrafter),
             (dyn, DynamicDrafter), (with_lookup(dyn, lookup), DynamicDrafter)]
    for tree, kind in cases:
        d = drafter_for(tree)
        assert type(d) is kind and d.tree == tree, (tree, d)
        assert hash(d) == hash(drafter_for(tree)) and d == drafter_for(tree)  # a jit static
        assert d.max_accepted == tree.max_accepted
    assert HeadsDrafter(static) != LookupDrafter(static)


def test_a_wrong_drafter_of_our_own_gives_plain_greedy(model):
    cfg, params, plain = model
    out, per_step = _decode(cfg, params, ChainDrafter(chain_tree(3)))
    assert out == plain[:len(out)] and len(out) >= STEPS


def test_a_perfect_drafter_is_accepted_in_full(model):
    cfg, params, plain = model
    out, per_step = _decode(cfg, params, ChainDrafter(chain_tree(3), tuple(plain)))
    assert per_step == [4] * STEPS  # root + all 3 drafted tokens, every step
    assert out == plain[:4 * STEPS]


def test_the_base_drafter_says_it_cannot_propose(model):
    cfg, params, _ = model
    with pytest.raises(NotImplementedError, match="Drafter does not implement propose"):
        _decode(cfg, params, Drafter(chain_tree(2)), steps=1)
