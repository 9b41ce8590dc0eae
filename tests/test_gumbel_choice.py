"""`decoding.sampling.gumbel_choice`, the sampler of every sampled token: the distribution over a
vocabulary of several blocks is softmax(logits) (chi-square), -inf tokens and empty blocks are never
chosen, and logits that differ by float round-off almost never change the choice, where an inverse
CDF at one uniform (the sampler before it) changes it often."""
import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import chi2

from medusa_jax.decoding import sampling

V = 3 * sampling.CHOICE_BLOCK + 57  # four blocks, the last one partial


def _choices(logits, n, seed=0):
    keys = sampling.position_keys(sampling.row_keys(seed, 1), jnp.arange(n)[None])[0]  # [n, 2]
    return np.asarray(jax.jit(sampling.gumbel_choice)(jnp.broadcast_to(logits, (n,) + logits.shape), keys))


def test_the_choice_follows_softmax_across_blocks():
    rng = np.random.default_rng(0)
    logits = np.full(V, -np.inf, np.float32)
    hot = np.array([3, 250, 300, 511, 600, V - 1])              # tokens in every block
    logits[hot] = rng.normal(size=len(hot)) * 0.7
    logits[rng.choice(V, 200, replace=False)] = -3.0           # a tail beside them
    logits[2 * sampling.CHOICE_BLOCK:3 * sampling.CHOICE_BLOCK] = -np.inf  # a block with no mass at all
    logits[hot] = np.maximum(logits[hot], -2.0)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    n = 20000
    got = _choices(jnp.asarray(logits), n)
    assert np.all(np.isfinite(logits[got])), "a token of probability 0 was chosen"
    cells = [t for t in np.argsort(-p) if p[t] * n >= 5]
    observed = np.array([np.sum(got == t) for t in cells] + [n - np.isin(got, cells).sum()])
    expected = np.array([p[t] * n for t in cells] + [n - sum(p[t] * n for t in cells)])
    stat = ((observed - expected) ** 2 / expected).sum()
    assert chi2.sf(stat, len(cells)) > 1e-3, (observed, expected.round(1))


def test_round_off_in_the_logits_rarely_changes_the_choice():
    """Logits of SmolLM's vocabulary size perturbed by 1e-5 (what another batch shape's products do
    to the real model's logits): the Gumbel-max choice changes for at most one of 1,000 draws; one
    uniform against the cumulative probabilities (an inverse CDF) changes for about one in a hundred
    (the rate a seeded answer changed with the server's load before), the CDF's steps being as small
    as the round-off in the tail."""
    rng = np.random.default_rng(1)
    big = 49152
    logits = (rng.normal(size=big) * 2.5).astype(np.float32)
    noisy = logits + rng.normal(size=big).astype(np.float32) * 1e-5
    n = 1000
    changed = np.sum(_choices(jnp.asarray(logits), n) != _choices(jnp.asarray(noisy), n))
    assert changed <= 1, changed

    def inverse_cdf(x, u):
        c = np.cumsum(np.exp(x - x.max()).astype(np.float32))
        return np.searchsorted(c, u * c[-1], side="right")

    u = rng.uniform(size=n).astype(np.float32)
    flips = sum(inverse_cdf(logits, v) != inverse_cdf(noisy, v) for v in u)
    assert flips >= 5, (flips, changed)
