"""Chat templates: render `messages` with a jinja template, encode the result without special-token injection.

The text of system and user messages is always plain text. Before rendering, every special-token string inside
such a message is swapped for a sentinel that carries a per-call random nonce of digits (so user text cannot forge
one, and case filters leave it whole); the rendered text is then cut at the special tokens the *template* wrote
(those become special ids) and each piece is encoded as ordinary text after the sentinels are swapped back. So
`<|separator|>` typed by a user stays text.

Assistant messages are the model's own earlier turns, and templates read them: Qwen3's and DeepSeek-R1's drop an
earlier turn's reasoning where its content holds `</think>`, tool-call templates look for their tags. So their
content reaches the template as it is, and its special-token strings become special ids, as in HF
`apply_chat_template` (a sentinel there kept the reasoning in the prompt, QA). The client writes those turns anyway.

Worked example (Grok-style default template, user content `"hi<|eos|>"`):
    rendered:  "Human: hi\\ue000<nonce>2\\ue001<|separator|>\\n\\nAssistant:"
    pieces:    "Human: hi<|eos|>" (ordinary text) | <|separator|> (special id) | "\\n\\nAssistant:" (text)
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specdec.errors import ConfigError, InvalidInput

DEFAULT_TEMPLATE_NAME = "default_chat_template.jinja"
ASSISTANT = "assistant"  # the role whose content the template sees as it is (see the module docstring)


def default_chat_template_source() -> str:
    """Grok-style: `System: ...<|separator|>\\n\\n`, `Human: ...`, `Assistant: ...`; prompt `Assistant:`."""
    return resources.files(__package__).joinpath(DEFAULT_TEMPLATE_NAME).read_text(encoding="utf-8")


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    template: jinja2.Template
    special_tokens: dict[str, int]
    template_variables: dict[str, str]  # bos_token, eos_token, ... as the template sees them

    @classmethod
    def compile(
        cls, source: str, special_tokens: dict[str, int], template_variables: dict[str, str], origin: str
    ) -> ChatTemplate:
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{origin}: chat template does not compile ({exc})") from exc
        return cls(source, template, dict(special_tokens), dict(template_variables))

    def render(self, messages: list[dict], add_generation_prompt: bool, nonce: str = "") -> str:
        """The template's text; with a nonce, special-token strings inside system and user messages are
        sentinels. Whatever the template raises (its `raise_exception`, a TypeError on an odd message, the
        sandbox's limits) is the request's InvalidInput, not the service's error."""
        escape = self._escape_text(nonce)
        escaped = [message if message["role"] == ASSISTANT else _escape_message(message, escape)
                   for message in _checked(messages)]
        variables = {"tools": None, "documents": None, **self.template_variables}  # as HF passes them
        try:
            return self.template.render(messages=escaped, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # (its message may quote a message: with the user's text, QA)
            raise InvalidInput(f"chat template failed: {self._unescape_text(str(exc), nonce)}") from exc
        except Exception as exc:  # noqa: BLE001 - a template is code from the model dir, run on the request's data
            raise InvalidInput(f"chat template failed: {type(exc).__name__}: "
                               f"{self._unescape_text(str(exc), nonce)}") from exc

    def pieces(self, messages: list[dict], add_generation_prompt: bool) -> list[str | int]:
        """The rendered chat cut where the template wrote special tokens: their ids, and between them the texts
        to encode as ordinary text. (Counting them bounds the chat's tokens before any is encoded.)"""
        nonce = f"{secrets.randbelow(10**16):016d}"  # digits: `upper`, `lower` and `title` leave a sentinel whole
        rendered = self.render(messages, add_generation_prompt, nonce)
        out: list[str | int] = []
        for index, piece in enumerate(self._marker_pattern().split(rendered)):
            if index % 2:  # a special token written by the template itself
                out.append(self.special_tokens[piece])
            elif piece:
                out.append(self._unescape_text(piece, nonce))
        # any message's own marks (an assistant's too: its U+E000 was taken for a cut sentinel, QA)
        marked = any(mark in m["content"] for m in messages for mark in _MARKS)
        # the template sliced a message: a part of a sentinel would reach the prompt, different each call (QA)
        if any(isinstance(piece, str) and _cut_sentinel(piece, nonce, marked) for piece in out):
            raise InvalidInput("chat template failed: it cut a system or user message's text that holds special-"
                               "token text (a slice or a filter of it), which this gateway keeps plain; send that "
                               "text without special-token strings, or use a template that keeps messages whole")
        return out

    def _escape_text(self, nonce: str) -> Callable[[str], str]:
        if not nonce or not self.special_tokens:
            return lambda text: text
        index_by_name = {name: index for index, name in enumerate(self.special_tokens)}
        pattern = self._marker_pattern()
        return lambda text: pattern.sub(lambda m: _sentinel(nonce, index_by_name[m.group(0)]), text)

    def _unescape_text(self, text: str, nonce: str) -> str:
        if "\ue000" not in text:
            return text
        names = list(self.special_tokens)
        return re.sub(f"\ue000{nonce}(\\d+)\ue001", lambda m: names[int(m.group(1))], text)

    def _marker_pattern(self) -> re.Pattern[str]:
        return _alternation(tuple(self.special_tokens))


def encode_pieces(pieces: list[str | int], encode_ordinary: Callable[[str], list[int]]) -> list[int]:
    """Token ids of `ChatTemplate.pieces`."""
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
        else:
            ids.extend(encode_ordinary(piece))
    return ids


def _sentinel(nonce: str, index: int) -> str:
    return f"\ue000{nonce}{index}\ue001"


_MARKS = ("\ue000", "\ue001")  # a sentinel's ends (private-use characters)


def _cut_sentinel(text: str, nonce: str, marked: bool) -> bool:
    """Whether `text` (sentinels swapped back) holds a piece of a sentinel: any of its end characters where no
    message holds one (`marked`); else an opening with the nonce's first digits or the nonce's
    last digits closing one (user text cannot guess 16 random digits)."""
    if not marked:
        return any(mark in text for mark in _MARKS)
    return f"\ue000{nonce[:4]}" in text or re.search(f"{nonce[-4:]}\\d*\ue001", text) is not None


_PATTERN_CACHE: dict[tuple[str, ...], re.Pattern[str]] = {}


def _alternation(names: tuple[str, ...]) -> re.Pattern[str]:
    """`(a|b|...)`, longest first, so `split` keeps the matched token; never matches when there are none."""
    if names not in _PATTERN_CACHE:
        body = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True)) or "(?!)"
        _PATTERN_CACHE[names] = re.compile(f"({body})")
    return _PATTERN_CACHE[names]


def _checked(messages: list[dict]) -> list[dict]:
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput(f"message {index}: needs a string 'role'")
        if not isinstance(message.get("content"), str):
            raise InvalidInput(f"message {index}: 'content' must be a string")
    return messages


def _escape_message(message: dict, escape: Callable[[str], str]) -> dict:
    return {key: escape(value) if isinstance(value, str) else value for key, value in message.items()}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's `tojson` filter (its keywords too: templates pass `separators`, `sort_keys`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: HF marks assistant tokens with it for training
    masks; rendering a prompt needs none (templates that use it were refused at start)."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment HF `apply_chat_template` uses, so model-dir templates render the same."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlocks]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
