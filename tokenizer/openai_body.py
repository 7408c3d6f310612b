"""Validate an OpenAI-style request body and say what must be tokenized for it.

Only what routing needs is checked: the fields that decide the prompt's tokens (and ``model`` /
``cache_salt``, which decide the key namespace). Everything else is the engine's business. Errors
are worded like the OpenAI/vLLM API's own ("'messages' is a required property").

``/v1/completions`` accepts a text, a list of token IDs, or a batch (a list of texts or of token-ID
lists). A batch is routed by its **first** prompt: one request goes to one node, and the first
prompt is what a client sharing a prefix across a batch would share. Only the first prompt is
validated in full; the others must have the same kind.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenizer.errors import InvalidPrompt
from tokenizer.vllm_compat import normalize_tools

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Messages to render with the chat template, and the rendering options from the body."""

    messages: list[Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already has BOS (vLLM's default for chat)
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True  # vLLM's default for /v1/completions


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    token_ids: np.ndarray  # uint32, validated against the vocabulary


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    prompt: ChatPrompt | TextPrompt | TokenPrompt
    cache_salt: str | None = None


def _optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidPrompt(f"'{name}' must be a boolean")
    return value


def token_ids_array(ids: list[Any], *, vocab_size: int, where: str) -> np.ndarray:
    """A list of token IDs as uint32, refusing non-integers (bools, floats) and out-of-vocabulary IDs.

    One C pass (``array('I', …)``) converts and refuses floats, strings, negatives and IDs past
    2**32 at once; bools (which it would take as 0 and 1) are looked for only where a 0 or a 1 is.
    Checking every element's type in Python first cost several times more for a 128k-token prompt.
    """
    if not ids:
        raise InvalidPrompt(f"{where} must not be empty")
    try:
        arr = np.frombuffer(array("I", ids), dtype=np.uint32)
    except (TypeError, OverflowError):
        raise _refusal(ids, vocab_size=vocab_size, where=where) from None
    # JSON true/false are bools, not IDs
    first_bool = next((i for i in np.flatnonzero(arr <= 1).tolist() if type(ids[i]) is not int), len(ids))
    out_of_vocab = arr >= vocab_size
    if first_bool < len(ids) or out_of_vocab.any():
        raise _refusal(ids[: first_bool + 1], vocab_size=vocab_size, where=where)  # names the first bad one
    return arr


def _refusal(ids: list[Any], *, vocab_size: int, where: str) -> InvalidPrompt:
    """The error naming the first element that is not an integer, or not an ID."""
    for i, v in enumerate(ids):
        if type(v) is not int:  # type(), not isinstance: JSON true/false are bools, not IDs
            return InvalidPrompt(f"{where}[{i}] must be an integer token ID, got {v!r}")
        if not 0 <= v < vocab_size:
            return InvalidPrompt(f"{where}[{i}] is not a valid token ID: {v} (vocabulary size {vocab_size})")
    return InvalidPrompt(f"{where} must be an array of token IDs")


def _decoded_ids(ids: np.ndarray, *, vocab_size: int, where: str) -> np.ndarray:
    """A prompt the gateway decoded as uint32 itself (``gateway.token_memo``: JSON non-negative
    integers only), checked against the vocabulary as ``token_ids_array`` checks a list."""
    if not len(ids):
        raise InvalidPrompt(f"{where} must not be empty")
    out_of_vocab = ids >= vocab_size
    if out_of_vocab.any():
        i = int(np.argmax(out_of_vocab))
        raise InvalidPrompt(f"{where}[{i}] is not a valid token ID: {int(ids[i])} (vocabulary size {vocab_size})")
    return ids


def _chat_prompt(body: dict[str, Any]) -> ChatPrompt:
    if "messages" not in body:
        raise InvalidPrompt("'messages' is a required property")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise InvalidPrompt("'messages' must be a non-empty array")
    add_generation_prompt = _optional_bool(body, "add_generation_prompt", True)
    continue_final_message = _optional_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        # add_generation_prompt defaults to true: vLLM (transformers) refuses the pair even then
        raise InvalidPrompt("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                            "(add_generation_prompt defaults to true: set it to false)")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise InvalidPrompt("'chat_template_kwargs' must be an object")
    kwargs = dict(kwargs)
    tools = body.get("tools")
    if tools is not None:
        kwargs.setdefault("tools", normalize_tools(tools))
    return ChatPrompt(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=_optional_bool(body, "add_special_tokens", False),
        template_kwargs=kwargs,
    )


def _completion_prompt(body: dict[str, Any], vocab_size: int) -> TextPrompt | TokenPrompt:
    if "prompt" not in body:
        raise InvalidPrompt("'prompt' is a required property")
    prompt = body["prompt"]
    add_special_tokens = _optional_bool(body, "add_special_tokens", True)
    where = "'prompt'"
    if isinstance(prompt, np.ndarray):  # a JSON array of token IDs, decoded by the gateway without a list
        return TokenPrompt(_decoded_ids(prompt, vocab_size=vocab_size, where=where))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        kind = type(prompt[0])
        for i, item in enumerate(prompt):
            if not isinstance(item, kind):
                raise InvalidPrompt(f"'prompt'[{i}] must be a {'string' if kind is str else 'token ID array'} like 'prompt'[0]")
        prompt, where = prompt[0], "'prompt'[0]"
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidPrompt(f"{where} must not be empty")
        return TextPrompt(prompt, add_special_tokens)
    if isinstance(prompt, list):
        return TokenPrompt(token_ids_array(prompt, vocab_size=vocab_size, where=where))
    raise InvalidPrompt("'prompt' must be a string, an array of token IDs, or an array of either")


def parse_request(path: str, body: Any, *, vocab_size: int) -> ParsedRequest:
    """What to tokenize for ``body`` sent to ``path``; ``InvalidPrompt`` for anything malformed."""
    route = path.split("?", 1)[0].rstrip("/")
    if not isinstance(body, dict):
        raise InvalidPrompt("request body must be a JSON object")
    if "model" not in body:
        raise InvalidPrompt("'model' is a required property")
    model = body["model"]
    if not isinstance(model, str):
        raise InvalidPrompt("'model' must be a string")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidPrompt("'cache_salt' must be a non-empty string if provided")
    if route == CHAT_PATH:
        prompt: ChatPrompt | TextPrompt | TokenPrompt = _chat_prompt(body)
    elif route == COMPLETIONS_PATH:
        prompt = _completion_prompt(body, vocab_size)
    else:
        raise InvalidPrompt(f"unsupported path {path!r}: expected {CHAT_PATH} or {COMPLETIONS_PATH}")
    return ParsedRequest(model=model, prompt=prompt, cache_salt=cache_salt)
