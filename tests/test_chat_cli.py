"""Chat requests, generation_config.json and stop strings through the command line: the
pieces in-process (no compile), then one `python -m mtp_jax.generate` run on a small
random checkpoint carrying a chat template and a generation config."""

from __future__ import annotations

import json

import pytest

from cli_fixtures import make_checkpoint, make_tokenizer
from mtp_jax.chat import ChatTemplate
from mtp_jax.checkpoint import CheckpointError
from mtp_jax.checkpoint.tokenizer import load_generation_config
from mtp_jax.cli import LineError, build_request, sampling_defaults
from mtp_jax.config import SamplingParams
from mtp_jax.requests import match_stop_string
from test_generate_cli import ENGINE_ARGS, records, run_cli

# Only characters of the test tokenizer's corpus (it has no byte alphabet).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.content }}, {% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}two {% endif %}"
            "{% if add_generation_prompt %}hello{% endif %}")
CHAT = [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant",
                                                              "content": "jumps"}]


def test_build_request_messages():
    tok, chat = make_tokenizer(), ChatTemplate(TEMPLATE, (("bos_token", "one"),))
    ids, sp = build_request({"messages": CHAT}, tok, SamplingParams(), chat)
    assert ids == tok.encode("onethe quick brown fox, jumps, hello",
                             add_special_tokens=False).ids
    ids, _ = build_request({"messages": CHAT, "chat_template_kwargs": {
        "enable_thinking": False}}, tok, SamplingParams(), chat)
    assert ids == tok.encode("onethe quick brown fox, jumps, two hello").ids
    for line, msg in [({"messages": CHAT}, "no chat template"),
                      ({"messages": CHAT, "prompt": "hi"}, "not both prompt and messages"),
                      ({"prompt": "hi", "chat_template_kwargs": {}}, "messages only"),
                      ({"messages": []}, "non-empty list"),
                      ({"messages": CHAT, "chat_template_kwargs": 3}, "must be an object")]:
        with pytest.raises(LineError, match=msg):
            build_request(line, tok, SamplingParams(), None if "prompt" not in line and
                          msg == "no chat template" else chat)
    with pytest.raises(LineError, match="no tokenizer.json"):
        build_request({"messages": CHAT}, None, SamplingParams(), chat)


def test_sampling_defaults_precedence():
    sp, line = sampling_defaults({"top_k": 3}, {"temperature": 0.6, "top_k": 20},
                                 "generation_config.json", seed=1, max_tokens=5)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.max_tokens) == (0.6, 3, 1.0, 1, 5)
    assert line == ("sampling defaults: temperature=0.6 (generation_config.json); top_p=1.0 "
                    "(built-in); top_k=3 (command line)")
    sp, line = sampling_defaults({}, {}, "")
    assert sp == SamplingParams() and line.endswith("(built-in)") and line.count("(") == 1


@pytest.mark.parametrize("gen,eos,sampling", [
    ({"eos_token_id": 7, "do_sample": False, "temperature": 0.6}, (7,), {"temperature": 0.0}),
    ({"eos_token_id": [7, 8, 7], "do_sample": True, "top_p": 0.9}, (7, 8),
     {"temperature": 1.0, "top_p": 0.9}),
    ({"temperature": 0.7, "top_k": 20, "top_p": None}, (), {"temperature": 0.7, "top_k": 20}),
])
def test_generation_config(tmp_path, gen, eos, sampling):
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    g = load_generation_config(str(tmp_path))
    assert g.eos_token_ids == eos and dict(g.sampling) == sampling


def test_generation_config_absent_or_bad(tmp_path):
    assert load_generation_config(str(tmp_path)) is None
    for bad, msg in [({"top_p": 0}, "top_p"), ({"eos_token_id": "x"}, "eos_token_id"),
                     ([1], "JSON object")]:
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=msg):
            load_generation_config(str(tmp_path))


def test_stop_string_across_token_boundaries():
    tok = make_tokenizer()
    toks = tok.encode("hello world, hello jax").ids
    pieces = [tok.decode([t]) for t in toks]
    stop = "o w"  # inside no single token: it spans "hello" and " world"
    assert not any(stop in p for p in pieces)
    got, text = match_stop_string(tok, toks, (stop,))
    assert text == "hell"
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A checkpoint with a chat template and a generation config whose eos id is the third
    token greedy decoding of [1, 2, 3] gives, and whose sampling default is top_k 5."""
    from mtp_jax.reference import generate_reference

    path = tmp_path_factory.mktemp("chat") / "m"
    model = make_checkpoint(str(path))
    want, _ = generate_reference(model, [1, 2, 3], SamplingParams(max_tokens=6), max_len=64)
    want = [int(t) for t in want]
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "one", "special": True}}))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [want[2]], "do_sample": True, "top_k": 5, "temperature": 0.0}))
    return path, want


def test_cli_chat_and_generation_config(chat_ckpt, tmp_path):
    path, want = chat_ckpt
    tok = make_tokenizer()
    other = tmp_path / "other.jinja"
    other.write_text("{% for m in messages %}{{ m.content }} {% endfor %}hello")
    lines = [{"id": "chat", "messages": CHAT, "max_tokens": 4},
             {"id": "nothink", "messages": CHAT, "max_tokens": 4,
              "chat_template_kwargs": {"enable_thinking": False}},
             {"id": "eos", "prompt_ids": [1, 2, 3], "max_tokens": 6},
             {"id": "bad", "messages": [{"role": "user"}, 3]}]
    stdin = "".join(json.dumps(x) + "\n" for x in lines).encode()
    proc = run_cli(["--model", path, "--input", "-", "--output", "-", "--method", "none",
                    "--top-p", "0.5", *ENGINE_ARGS], stdin=stdin)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    recs = {r["id"]: r for r in records(proc.stdout)}
    assert recs["chat"]["num_prompt_tokens"] == len(
        tok.encode("onethe quick brown fox, jumps, hello").ids)
    assert recs["nothink"]["num_prompt_tokens"] == len(
        tok.encode("onethe quick brown fox, jumps, two hello").ids)
    # generation_config.json's eos ends the request (its temperature 0: greedy)
    eos = want.index(want[2]) + 1
    assert recs["eos"]["token_ids"] == want[:eos] and recs["eos"]["finish_reason"] == "stop"
    assert "messages[1]" in recs["bad"]["error"]
    err = proc.stderr.decode()
    assert ("sampling defaults: temperature=0.0 top_k=5 (generation_config.json); "
            "top_p=0.5 (command line)") in err
    # --generation-config none: no eos from the file, built-in defaults; --chat-template
    proc = run_cli(["--model", path, "--input", "-", "--output", "-", "--method", "none",
                    "--generation-config", "none", "--chat-template", other, *ENGINE_ARGS],
                   stdin=stdin)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    recs = {r["id"]: r for r in records(proc.stdout)}
    assert recs["eos"]["token_ids"] == want and recs["eos"]["finish_reason"] == "length"
    assert recs["chat"]["num_prompt_tokens"] == len(
        tok.encode("the quick brown fox jumps hello").ids)
    assert "sampling defaults: temperature=0.0 top_p=1.0 top_k=0 (built-in)" in \
        proc.stderr.decode()
    bad = run_cli(["--model", path, "--input", "-", "--output", "-",
                   "--chat-template", tmp_path / "missing.jinja"], stdin=stdin)
    assert bad.returncode == 1 and b"cannot read chat template" in bad.stderr


def test_load_exposes_chat_and_generation_and_orbax_keeps_them(chat_ckpt, tmp_path):
    from mtp_jax import load, save_hf, save_orbax

    path, want = chat_ckpt
    model = load(str(path))
    assert model.generation_defaults == {"temperature": 0.0, "top_k": 5}
    assert model.stop_token_ids == (want[2],)
    assert model.chat_template.render(CHAT).startswith("onethe quick")
    save_orbax(model, str(tmp_path / "o"))
    save_hf(model, str(tmp_path / "h"))
    (tmp_path / "h" / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    for folder in ("o", "h"):
        again = load(str(tmp_path / folder))
        assert again.generation_defaults == model.generation_defaults, folder
        assert again.stop_token_ids == model.stop_token_ids, folder
        assert again.chat_template.source == TEMPLATE, folder
