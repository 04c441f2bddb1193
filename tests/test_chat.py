"""mtp_jax.chat against transformers: the fixture (tests/fixtures/make_chat_fixture.py)
holds what `apply_chat_template(tokenize=False, add_generation_prompt=True)` gives for
three template styles; rendering here must equal it character for character, and the text
encoded without added special tokens must give its token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtp_jax.chat import ChatError, ChatTemplate, load_chat_template, special_tokens

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "chat"
DATA = json.loads((FIXTURE / "chat_cases.json").read_text())


def checkpoint_dir(tmp_path, name: str, form: str = "string") -> Path:
    """A folder with the fixture's tokenizer.json and the template `name` stored in
    tokenizer_config.json as `form`: "string", "list" ([{name, template}]) or "jinja"
    (chat_template.jinja beside a config without one)."""
    t = DATA["templates"][name]
    cfg = dict(t["special_tokens"])
    if form == "string":
        cfg["chat_template"] = t["chat_template"]
    elif form == "list":
        cfg["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('no') }}"},
                                {"name": "default", "template": t["chat_template"]}]
    else:
        (tmp_path / "chat_template.jinja").write_text(t["chat_template"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(FIXTURE / "tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


@pytest.mark.parametrize("form", ["string", "list", "jinja"])
@pytest.mark.parametrize("case", range(len(DATA["cases"])))
def test_render_equals_transformers(tmp_path, case, form):
    from tokenizers import Tokenizer

    c = DATA["cases"][case]
    path = checkpoint_dir(tmp_path, c["template"], form)
    chat = load_chat_template(str(path))
    text = chat.render(c["messages"], c["kwargs"])
    assert text == c["text"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.encode(text, add_special_tokens=False).ids == c["ids"]


@pytest.mark.parametrize("err", DATA["errors"], ids=lambda e: e["template"])
def test_raise_exception_is_a_chat_error(tmp_path, err):
    chat = load_chat_template(str(checkpoint_dir(tmp_path, err["template"])))
    with pytest.raises(ChatError, match=err["error"]):
        chat.render(err["messages"])


def test_special_tokens_map_wins_and_added_token_dicts(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<a>", "special": True}, "eos_token": "<e>"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<b>"}))
    assert dict(special_tokens(str(tmp_path))) == {"bos_token": "<b>", "eos_token": "<e>"}


def test_no_template_override_and_globals(tmp_path):
    assert load_chat_template(str(tmp_path)) is None  # no tokenizer_config.json at all
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_chat_template(str(tmp_path)) is None
    f = tmp_path / "t.jinja"
    f.write_text("{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
                 "{% if add_generation_prompt %}>{% endif %}")
    chat = load_chat_template(str(tmp_path), override=str(f))
    assert chat.render([{"role": "user", "content": "<é>"}]) == \
        '<s>[{"role": "user", "content": "<é>"}]|4>'
    with pytest.raises(ChatError, match="cannot read chat template"):
        load_chat_template(str(tmp_path), override=str(tmp_path / "missing.jinja"))


def test_bad_messages_and_templates(tmp_path):
    chat = ChatTemplate("{{ messages[0].content }}")
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ChatError):
            chat.render(bad)
    with pytest.raises(ChatError, match="cannot set messages"):
        chat.render([{"role": "user", "content": "x"}], {"messages": []})
    with pytest.raises(ChatError, match="must be an object"):
        chat.render([{"role": "user", "content": "x"}], [1])
    with pytest.raises(ChatError, match="the chat template failed"):
        ChatTemplate("{% for %}").render([{"role": "user", "content": "x"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "rag", "template": "x"}]}))
    with pytest.raises(ChatError, match='no "default"'):
        load_chat_template(str(tmp_path))


def test_record_text_leaves_special_tokens_out():
    """Records' text comes from requests.finished's tokenizer.decode(ids)."""
    from tokenizers import Tokenizer

    from mtp_jax.requests import match_stop_string

    tok = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    ids = tok.encode("hello<|im_end|>\n<|im_start|>user", add_special_tokens=False).ids
    assert tok.decode(ids) == "hello\nuser"
    assert match_stop_string(tok, ids, ("o\nu",))[1] == "hell"  # across the special tokens
