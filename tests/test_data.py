"""Training data: assistant-only loss masks (real SmolLM2 tokenizer), Medusa targets, splits, batching."""
import json

import numpy as np
import pytest

from medusa_jax.train import data as Dt
from medusa_jax.train.distill import EvalSetError


@pytest.fixture(scope="module")
def tokenizer():
    from medusa_jax.convert.load import DefaultModelNotInstalledError, default_model_path, load_tokenizer

    try:
        path = default_model_path()
    except DefaultModelNotInstalledError as e:
        pytest.skip(f"real model not available: {e}")
    return load_tokenizer(path)


CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


def _spans(mask):
    """[(start, end)] of the True runs of a 1-D bool array."""
    m = np.concatenate([[False], mask, [False]]).astype(int)
    d = np.diff(m)
    return list(zip(np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]))


@pytest.mark.real_model
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer, system):
    msgs = ([{"role": "system", "content": system}] if system else []) + CHAT
    ids, mask = Dt.chat_to_example(tokenizer, msgs, id="c1")
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tokenizer.decode(ids) == full
    if system is None:
        assert "You are a helpful AI assistant" in full  # the template's default system prompt: masked out
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spans = _spans(mask)
    answers = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert len(spans) == len(answers)
    for (s, e), text in zip(spans, answers):
        assert tokenizer.decode(ids[s:e]) == text + "<|im_end|>"
        assert ids[e - 1] == im_end
        assert tokenizer.decode(ids[:s]).endswith("<|im_start|>assistant\n")  # header excluded
    assert mask.sum() == sum(len(tokenizer.encode(a, add_special_tokens=False)) + 1 for a in answers)


@pytest.mark.real_model
def test_chat_errors(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        Dt.chat_to_example(tokenizer, [])
    with pytest.raises(ValueError, match="role"):
        Dt.chat_to_example(tokenizer, [{"role": "user"}])
    ids, mask = Dt.chat_to_example(tokenizer, CHAT[:1])  # no assistant turn: nothing to learn
    assert len(ids) > 0 and not mask.any()


def test_head_targets_by_hand():
    tokens = np.array([[10, 11, 12, 13, 14, 15],
                       [20, 21, 22, 23, 0, 0]])
    mask = np.array([[0, 0, 1, 1, 1, 1],
                     [0, 1, 1, 1, 0, 0]], bool)
    labels, valid = Dt.head_targets(tokens, mask, 3)
    assert labels.shape == valid.shape == (3, 2, 6) and labels.dtype == np.int32
    # head 0: t -> t+2; head 1: t -> t+3; head 2: t -> t+4
    exp_labels = np.array([
        [[12, 13, 14, 15, 0, 0], [22, 23, 0, 0, 0, 0]],
        [[13, 14, 15, 0, 0, 0], [23, 0, 0, 0, 0, 0]],
        [[14, 15, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    ])
    exp_valid = np.array([
        [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
        [[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]],
        [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
    ], bool)
    np.testing.assert_array_equal(valid, exp_valid)
    np.testing.assert_array_equal(labels, exp_labels)
    b_labels, b_valid = Dt.base_targets(tokens, mask)
    np.testing.assert_array_equal(b_labels, [[0, 12, 13, 14, 15, 0], [21, 22, 23, 0, 0, 0]])
    np.testing.assert_array_equal(b_valid, [[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    # row 1 has no valid label for head 2 (its target would be a masked or padded token)
    assert not valid[2, 1].any()
    pos = Dt.trainable_positions(valid)
    np.testing.assert_array_equal(pos, [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1]])
    hidden = np.arange(2 * 6 * 2).reshape(2, 6, 2)
    h, lab, val = Dt.gather_positions(hidden, labels, valid, pos)
    assert h.shape == (6, 2) and lab.shape == val.shape == (3, 6)
    np.testing.assert_array_equal(h[-1], hidden[1, 1])
    np.testing.assert_array_equal(lab[:, -1], [23, 0, 0])
    assert val.any(axis=0).all()


def test_head_with_no_valid_label_in_batch():
    tokens = np.array([[1, 2, 3, 4]])
    mask = np.array([[0, 0, 1, 1]], bool)
    labels, valid = Dt.head_targets(tokens, mask, 4)
    assert valid[0].sum() == 2 and valid[1].sum() == 1
    assert not valid[2].any() and not valid[3].any()  # beyond the sequence
    assert (labels[2:] == 0).all()


def test_split_is_deterministic_by_id():
    exs = [Dt.Example([i, i + 1], [0, 1], id=f"e{i}") for i in range(400)]
    tr, va = Dt.split_train_val(exs, 0.1, seed=0)
    assert len(tr) + len(va) == 400 and 20 <= len(va) <= 65
    tr2, va2 = Dt.split_train_val(list(reversed(exs)), 0.1, seed=0)
    assert {e.id for e in va} == {e.id for e in va2}
    _, va3 = Dt.split_train_val(exs[:200], 0.1, seed=0)  # a subset: same decisions
    assert {e.id for e in va3} == {e.id for e in va if int(e.id[1:]) < 200}
    _, va4 = Dt.split_train_val(exs, 0.1, seed=1)
    assert {e.id for e in va4} != {e.id for e in va}
    # plain (ids, mask) tuples without ids: split by content
    plain = [(np.array([i, 7]), np.array([0, 1], bool)) for i in range(50)]
    assert Dt.split_train_val(plain, 0.3, 5)[1] == Dt.split_train_val(plain, 0.3, 5)[1]
    with pytest.raises(ValueError):
        Dt.split_train_val(exs, 1.5)


def test_pad_batch_shapes_and_truncation():
    exs = [([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7, 8, 9], [0, 0, 1, 1, 1, 1]), ([7], [1])]
    tokens, mask, lengths = Dt.pad_batch(exs, 4, pad_id=-1)
    assert tokens.shape == mask.shape == (3, 4) and tokens.dtype == np.int32 and mask.dtype == bool
    np.testing.assert_array_equal(lengths, [3, 4, 1])
    np.testing.assert_array_equal(tokens, [[1, 2, 3, -1], [4, 5, 6, 7], [7, -1, -1, -1]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 0]])


def test_pack_segments_positions_and_targets():
    exs = [([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7, 8], [0, 0, 1, 1, 1]), ([9, 10], [1, 1]), (list(range(20, 30)), [1] * 10)]
    tokens, mask, seg, pos = Dt.pack(exs, 6)
    assert tokens.shape == mask.shape == seg.shape == pos.shape == (3, 6)
    np.testing.assert_array_equal(tokens[0], [1, 2, 3, 9, 10, 0])
    np.testing.assert_array_equal(seg[0], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(mask[0], [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(tokens[1], [4, 5, 6, 7, 8, 0])
    np.testing.assert_array_equal(tokens[2], [20, 21, 22, 23, 24, 25])  # truncated
    labels, valid = Dt.head_targets(tokens, mask, 2, segment_ids=seg)
    # row 0: position 1 would label token 9 (next segment) for head 0: invalid
    # (t = 3 would label padding)
    np.testing.assert_array_equal(valid[0, 0], [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(labels[0, 0], [3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(valid[0, 2], [1, 1, 1, 1, 0, 0])  # row 2: one segment, no padding
    b_labels, b_valid = Dt.base_targets(tokens, mask, segment_ids=seg)
    np.testing.assert_array_equal(b_valid[0], [1, 1, 0, 1, 0, 0])


def test_load_distilled(tmp_path):
    recs = [{"id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 2], "finish": "eos"},
            {"id": "b", "prompt_ids": [7], "response_ids": [8, 9], "finish": "length"}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"id": "c", "pro')
    exs = Dt.load_distilled(str(tmp_path))
    assert [e.id for e in exs] == ["a", "b"]
    ids, mask = exs[0]
    np.testing.assert_array_equal(ids, [1, 2, 3, 4, 5, 2])
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])
    assert ids.dtype == np.int32 and mask.dtype == bool
    with pytest.raises(FileNotFoundError):
        Dt.load_distilled(str(tmp_path / "nope"))


def test_read_chat_jsonl_refuses_eval_sets(tmp_path):
    p = tmp_path / "mt_bench_chats.jsonl"
    p.write_text('{"messages": []}\n')
    with pytest.raises(EvalSetError):
        list(Dt.read_chat_jsonl(str(p)))


def test_data_distilled_from_another_model_is_noted(tmp_path, monkeypatch):
    from medusa_jax.train.examples import distilled_for_another_model
    assert distilled_for_another_model(str(tmp_path), "/m/ModelB") is None  # no meta.json: nothing to compare
    (tmp_path / "meta.json").write_text(json.dumps({"model": "/models/ModelA", "max_new_tokens": 8}))
    assert distilled_for_another_model(str(tmp_path), "/models/ModelA/") is None  # the same path
    assert distilled_for_another_model(str(tmp_path), "/models/../models/ModelA") is None
    # another model of the same name (fine-tunes share names: final, checkpoint-500): the paths tell
    other = distilled_for_another_model(str(tmp_path), "/elsewhere/ModelA")
    assert "distilled from /models/ModelA, and these heads are trained for /elsewhere/ModelA" in other
    (tmp_path / "meta.json").write_text(json.dumps({"model": "ModelA", "max_new_tokens": 8}))
    assert distilled_for_another_model(str(tmp_path), "/installed/ModelA") is None  # the packaged model, by name
    # a model given relative to the working directory is that directory's, not a bare name
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    (tmp_path / "meta.json").write_text(json.dumps({"model": str(tmp_path / "a" / "final")}))
    assert "/b/final" in distilled_for_another_model(str(tmp_path), "final")
    assert distilled_for_another_model(str(tmp_path), "../a/final") is None
    (tmp_path / "meta.json").write_text(json.dumps({"model": "/models/ModelA", "max_new_tokens": 8}))
    note = distilled_for_another_model(str(tmp_path), "/m/ModelB")
    assert "distilled from ModelA" in note and "trained for ModelB" in note and "--model /m/ModelB" in note
    (tmp_path / "meta.json").write_text("[1, 2]")  # not the distiller's meta: no note rather than an error
    assert distilled_for_another_model(str(tmp_path), "/m/ModelB") is None
