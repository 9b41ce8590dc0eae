"""The training sequences: self-distilled chats or a synthetic set, split into training and
validation, and the proposal vocabulary drawn from them."""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

import numpy as np

from medusa_jax.heads.medusa import frequent_tokens
from medusa_jax.train import data as D
from medusa_jax.train.distill import META_FILE, same_source
from medusa_jax.train.config import TrainConfig
from medusa_jax.train.hidden import Pair


def synthetic_examples(tc: TrainConfig, vocab_size: int) -> List[Pair]:
    """Sequences of a random permutation f of the vocabulary: x[t+1] = f(x[t]), x[0] random.

    Token t+k+2 is then f^(k+2)(token t), a deterministic function of token t. The first
    ``synthetic_prompt_len`` tokens are masked out (like a prompt). Returns `data.Example`s
    (ids int32 [T], loss_mask bool [T], id "synthetic-<i>").
    """
    rng = np.random.default_rng([tc.seed, 12345])
    f = rng.permutation(vocab_size)
    out = []
    for i in range(tc.synthetic_num_sequences):
        ids = np.empty(tc.synthetic_seq_len, np.int32)
        ids[0] = rng.integers(vocab_size)
        for t in range(1, len(ids)):
            ids[t] = f[ids[t - 1]]
        out.append(D.Example(ids, np.arange(len(ids)) >= tc.synthetic_prompt_len, id=f"synthetic-{i}"))
    return out


def load_examples(tc: TrainConfig, vocab_size: int) -> Tuple[List[Pair], List[Pair]]:
    """(train, val) examples, truncated to max_seq_len. Raises ValueError for out-of-vocabulary ids
    or an empty training split; FileNotFoundError for a missing data directory."""
    examples = synthetic_examples(tc, vocab_size) if tc.data == "synthetic" else D.load_distilled(tc.data)
    top = max((int(np.max(i)) for i, _ in examples if len(i)), default=-1)
    if top >= vocab_size:
        raise ValueError(f"{tc.data}: token id {top} is outside the backbone's vocabulary ({vocab_size}); "
                         "the data was made with another tokenizer")
    train, val = D.split_train_val(examples, tc.val_fraction, tc.seed)  # by example id: stable
    if not train:
        raise ValueError(f"{tc.data}: no training sequences (val_fraction={tc.val_fraction})")
    cut = lambda exs: [(np.asarray(i, np.int32)[:tc.max_seq_len], np.asarray(m, bool)[:tc.max_seq_len])
                       for i, m in exs]
    return cut(train), cut(val)


def proposal_vocabulary(tc: TrainConfig, train_ex, vocab_size: int) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(proposal_ids [N] int32, remap [V] int64) for ``tc.proposal_vocab`` = N > 0: the N most
    frequent tokens of the training sequences (`heads.medusa.frequent_tokens`, as `medusa_jax.cli.tune
    --proposal-vocab` picks them) and each token id's index among them (-1 outside); (None, None)
    for 0. Raises ValueError when N exceeds the vocabulary."""
    if not tc.proposal_vocab:
        return None, None
    if tc.proposal_vocab > vocab_size:
        raise ValueError(f"proposal_vocab={tc.proposal_vocab} exceeds the backbone's vocabulary ({vocab_size})")

    ids = frequent_tokens((i for i, _ in train_ex), tc.proposal_vocab, vocab_size)
    remap = np.full(vocab_size, -1, np.int64)
    remap[ids] = np.arange(len(ids))
    return ids, remap


def distilled_for_another_model(data_dir: str, model_path: str) -> Optional[str]:
    """A note when ``data_dir``'s ``meta.json`` (written by `medusa_jax.train.distill`) names another
    model than ``model_path`` (`distill.same_source`); None when they agree, or when
    there is no readable meta.json (synthetic data, data made elsewhere). Heads learn the answers
    in the data, so data distilled from another model teaches them tokens this one does not choose
    (decoding stays lossless; fewer drafts are accepted)."""
    try:
        with open(os.path.join(data_dir, META_FILE), encoding="utf-8") as f:
            made_by = json.load(f).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    name = lambda p: os.path.basename(os.path.normpath(str(p)))  # noqa: E731
    if not made_by or same_source(made_by, os.path.abspath(str(model_path))):
        return None
    made, this = name(made_by), name(model_path)
    if made == this:  # two models of one name (/a/final, /b/final): their paths tell them apart
        made, this = str(made_by), os.path.abspath(str(model_path))
    return (f"{data_dir} was distilled from {made}, and these heads are trained for {this}: heads learn the "
            f"answers in their data, so they will propose {made}'s tokens (decoding stays exact; fewer drafts are "
            f"accepted). If {this} is another model, distill its own answers: medusa-distill --model {model_path} "
            "--out DIR")
