"""Chat templates: `messages` ([{role, content}]) rendered to prompt text the way
transformers' `apply_chat_template(tokenize=False, add_generation_prompt=True)` does.

The template comes from the checkpoint's tokenizer_config.json (`chat_template`: a string,
or a list of {name, template} of which "default" is used) or chat_template.jinja beside
it, or from a file given on the command line. It is rendered by jinja2 in transformers'
environment: sandboxed and immutable, trim_blocks and lstrip_blocks, the loop controls,
a `tojson` filter that keeps non-ASCII characters and escapes no HTML, the globals
`raise_exception` and `strftime_now`, a `{% generation %}` block that renders its body,
and the variables `messages`, `tools` / `documents` (None), `add_generation_prompt`, the
named special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
mask_token, as strings) and the line's `chat_template_kwargs` (`tools` among them), which
win over all of these.
The rendered text carries its own special tokens (a BOS, the role markers), so it is
encoded without adding any. jinja2 is imported on the first render.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Optional

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


class ChatError(ValueError):
    """Why a chat template cannot be read or a conversation cannot be rendered."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja template
    special_tokens: tuple = ()  # ((name, text), ...) passed to the template
    origin: str = ""  # where the template was read, for messages

    def render(self, messages, kwargs: Optional[dict] = None) -> str:
        """The prompt text of `messages` with the assistant's turn opened; `kwargs`: extra
        template variables (e.g. {"enable_thinking": False})."""
        check_messages(messages)
        import jinja2

        kwargs = kwargs or {}
        if not isinstance(kwargs, dict):
            raise ChatError("chat_template_kwargs must be an object")
        if "messages" in kwargs:
            raise ChatError("chat_template_kwargs cannot set messages")
        variables = {"tools": None, "documents": None, "add_generation_prompt": True,
                     **dict(self.special_tokens), **kwargs}
        try:
            return _compile(self.source).render(messages=messages, **variables)
        except jinja2.TemplateError as e:  # raise_exception() included
            raise ChatError(f"the chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}] must be an object with a string role")
        if "content" in m and not isinstance(m["content"], (str, list, type(None))):
            raise ChatError(f"messages[{i}].content must be a string or a list of parts")


_COMPILED: dict = {}  # template source -> jinja2.Template


def _compile(source: str):
    if source not in _COMPILED:
        _COMPILED[source] = _environment().from_string(source)
    return _COMPILED[source]


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's text for
        training masks; rendering only needs its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ChatError(f"{path}: unreadable: {e}") from None
    if not isinstance(obj, dict):
        raise ChatError(f"{path}: not a JSON object")
    return obj


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(path: str) -> tuple:
    """((name, text), ...) of the named special tokens in `path`'s tokenizer_config.json
    and special_tokens_map.json (which wins where both name one, as in transformers)."""
    out = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the latter wins
        cfg = _read_json(os.path.join(path, name))
        for key in SPECIAL_TOKENS:
            text = _token_text(cfg.get(key))
            if text is not None:
                out[key] = text
    return tuple(sorted(out.items()))


def _pick(value, origin: str) -> Optional[str]:
    """tokenizer_config.json's chat_template: a string, or [{name, template}] -> "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatError(f"{origin}: chat_template lists no \"default\" template "
                        f"(it has {sorted(map(str, named))})")
    raise ChatError(f"{origin}: chat_template must be a string or a list of "
                    "{name, template}")


def load_chat_template(path: str, override: Optional[str] = None) -> Optional[ChatTemplate]:
    """The chat template of the checkpoint in `path` (None when it has none), or the one in
    the file `override`, rendered with the checkpoint's special tokens."""
    if override is not None:
        try:
            with open(override, encoding="utf-8") as f:
                return ChatTemplate(f.read(), special_tokens(path), override)
        except OSError as e:
            raise ChatError(f"cannot read chat template {override}: {e.strerror or e}") \
                from None
    origin = os.path.join(path, "tokenizer_config.json")
    source = _pick(_read_json(origin).get("chat_template"), origin)
    if source is None:
        origin = os.path.join(path, TEMPLATE_FILE)
        try:
            with open(origin, encoding="utf-8") as f:
                source = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ChatError(f"{origin}: unreadable: {e}") from None
    return ChatTemplate(source, special_tokens(path), origin)


__all__ = ["ChatError", "ChatTemplate", "check_messages", "load_chat_template",
           "special_tokens"]
