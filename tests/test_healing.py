"""Token healing: the healed prefix on a real BPE tokenizer, the engine's first-token mask
(greedy and sampled, every method equal to `none`), the result's text, and the generate
CLI (on by default for text prompts, off with --no-token-healing, prompt_ids untouched)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SamplingParams, SpecConfig
from mtp_jax.engine import Engine, Request
from mtp_jax.healing import Healer, Healing, heal_line, strip_healed
from mtp_jax.layers import causal_attend

from spec_models import markov_model

CODE = [
    "def f(x):\n    return x\n",
    "def g(y):\n    y = y + 1\n    return y\n",
    "class A:\n    def h(self):\n        return 1\n",
    "import os\n\n\ndef main():\n    pass\n",
]
VOCAB = 100


def code_tokenizer():
    """A byte-level BPE trained on a little code, so `'\\n    '` is one token; one special
    token. At most VOCAB ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False, initial_alphabet=[],
                                  special_tokens=["<|end|>"])
    tok.train_from_iterator(CODE * 20, trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


@pytest.fixture(scope="module")
def tok():
    return code_tokenizer()


def test_healed_prefix_on_a_bpe_tokenizer(tok):
    healer = Healer(tok)
    nl, indent = tok.token_to_id("\u010a"), tok.token_to_id("\u010a\u0120\u0120\u0120\u0120")
    assert nl is not None and indent is not None  # '\n' and '\n    ' are tokens
    ids = tok.encode("def f(x):\n").ids
    assert ids[-1] == nl
    healed, h = healer.heal(ids)
    assert healed == ids[:-1] and h.text == "\n"
    assert nl in h.allowed and indent in h.allowed
    assert all(healer.vocab[i].startswith("\n") for i in h.allowed)
    assert sorted(h.allowed) == [i for i, t in enumerate(healer.vocab) if t.startswith("\n")]
    assert healer.allowed(nl) is h.allowed  # cached per token
    # the record's text: the continuation of the original prompt
    assert strip_healed(tok.decode([indent] + tok.encode("return x").ids), h) == \
        "    return x"
    # nothing to heal: a one-token prompt, a special token, a token no other extends
    assert healer.heal([nl]) == ([nl], None)
    end = tok.token_to_id("<|end|>")
    assert healer.heal(ids + [end]) == (ids + [end], None)
    longest = max(range(tok.get_vocab_size()), key=lambda i: len(healer.vocab[i]))
    assert healer.heal(ids[:2] + [longest]) == (ids[:2] + [longest], None)
    # only text prompts heal; off without a healer
    line = {"prompt": "def f(x):\n"}
    assert heal_line(healer, line, ids)[1] is not None
    assert heal_line(None, line, ids) == (ids, None)
    assert heal_line(healer, {"prompt_ids": ids}, ids) == (ids, None)
    assert heal_line(healer, {"messages": []}, ids) == (ids, None)


# ------------------------------------------------------------------------------ engine
MAX_LEN = 48
ENGINE = EngineConfig(max_batch=3, max_model_len=MAX_LEN, page_size=8, prefill_chunk=16,
                      steps_per_dispatch=4)
PROMPTS = [[5, 9, 14, 3, 22, 7], [40, 2, 33, 18, 11, 60, 1, 8, 27], [12, 30, 4]]
METHODS = [("none", 0), ("chain", 3), ("window", 2), ("eagle", 2), ("per_step", 2)]


@pytest.fixture(scope="module")
def model():
    return markov_model("mimo", target_noise=0.5, mtp_noise=0.2, seed=1)


_engines: dict = {}


def engine(model, method, k) -> Engine:
    if (method, k) not in _engines:
        _engines[method, k] = Engine(model, SpecConfig(method, num_speculative_tokens=k),
                                     ENGINE)
    return _engines[method, k]


def last_logits(model, prompt) -> np.ndarray:
    seq = jnp.asarray([prompt], jnp.int32)
    pos = jnp.arange(seq.shape[1])[None]
    m = model.module()
    normed, _ = m.target(seq, pos, causal_attend(pos))
    return np.asarray(m.target.head(normed))[0, -1]


def constrained(model, prompt, n=8) -> Healing:
    """A Healing whose allowed ids leave out the unconstrained argmax: the n next best."""
    order = np.argsort(-last_logits(model, prompt))
    return Healing("x", np.sort(order[1: n + 1]).astype(np.int32))


def test_first_token_honours_the_mask_greedy_and_sampled(model):
    eng = engine(model, "none", 0)
    free = eng.generate([Request(i, p, SamplingParams(max_tokens=6))
                         for i, p in enumerate(PROMPTS)])
    heals = [constrained(model, p) for p in PROMPTS]
    # rows 0 and 2 healed, row 1 not: its output is unchanged
    got = eng.generate([Request(i, p, SamplingParams(max_tokens=6), heals[i] if i != 1 else None)
                        for i, p in enumerate(PROMPTS)])
    for i, (g, f) in enumerate(zip(got, free)):
        if i == 1:
            assert g.token_ids == f.token_ids and g.healed is None
            assert g.num_prompt_tokens == len(PROMPTS[1])
            continue
        logits = last_logits(model, PROMPTS[i])
        assert g.token_ids[0] != f.token_ids[0]  # the unconstrained argmax is not allowed
        assert g.token_ids[0] in heals[i].allowed
        allowed = heals[i].allowed
        assert g.token_ids[0] == allowed[np.argmax(logits[allowed])]  # greedy over the set
        assert g.healed == "x" and g.num_prompt_tokens == len(PROMPTS[i]) + 1
    sampled = eng.generate([Request(s, PROMPTS[0], SamplingParams(
        max_tokens=2, temperature=1.5, seed=s), heals[0]) for s in range(12)])
    firsts = {r.token_ids[0] for r in sampled}
    assert firsts <= set(heals[0].allowed.tolist()) and len(firsts) > 1


def test_every_method_equals_none_with_healing(model):
    """Rows 0 and 2 healed, row 1 not; also a prefill batch of all three rows."""
    reqs = lambda: [Request(i, p, SamplingParams(max_tokens=10),  # noqa: E731
                            constrained(model, p) if i != 1 else None)
                    for i, p in enumerate(PROMPTS)]
    want = [r.token_ids for r in engine(model, "none", 0).generate(reqs())]
    for method, k in METHODS[1:]:
        got = [r.token_ids for r in engine(model, method, k).generate(reqs())]
        assert got == want, (method, k)
    batched = Engine(model, SpecConfig("chain", num_speculative_tokens=3),
                     dataclasses.replace(ENGINE, prefill_batch=4))
    assert [r.token_ids for r in batched.generate(reqs())] == want
    # sampled with coupled acceptance (adaptive K): the seed's output, as `none` gives it
    hot = lambda: [Request(i, p, SamplingParams(  # noqa: E731
        max_tokens=10, temperature=0.8, seed=i), constrained(model, p))
        for i, p in enumerate(PROMPTS)]
    want = [r.token_ids for r in engine(model, "none", 0).generate(hot())]
    adaptive = Engine(model, SpecConfig("chain"), ENGINE)
    assert [r.token_ids for r in adaptive.generate(hot())] == want


# --------------------------------------------------------------------------------- CLI
def test_cli_heals_text_prompts_by_default(tmp_path, tok):
    from cli_fixtures import make_checkpoint
    from mtp_jax.generate import main

    path = tmp_path / "m"
    make_checkpoint(str(path), num_mtp=0, tokenizer=False)
    tok.save(str(path / "tokenizer.json"))
    ids = tok.encode("def f(x):\n").ids
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "text", "prompt": "def f(x):\n"}) + "\n"
                   + json.dumps({"id": "ids", "prompt_ids": ids}) + "\n")
    runs = {}
    for flag in ([], ["--no-token-healing"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        assert main(["--model", str(path), "--input", str(inp), "--output", str(out),
                     "--max-tokens", "4", "--max-batch", "2", "--max-model-len", "32",
                     *flag]) == 0
        runs[bool(flag)] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    healed, plain = runs[False], runs[True]
    assert healed["text"]["healed"] == "\n"
    assert healed["text"]["num_prompt_tokens"] == len(ids)
    first = healed["text"]["token_ids"][0]
    assert tok.decode([first]).startswith("\n")
    assert healed["text"]["text"] == tok.decode(healed["text"]["token_ids"])[1:]
    assert "healed" not in healed["ids"] and "healed" not in plain["text"]
    assert healed["ids"]["token_ids"] == plain["ids"]["token_ids"] == plain["text"]["token_ids"]
    assert plain["text"]["text"] == tok.decode(plain["text"]["token_ids"])
