"""OpenAI/vLLM request options and response shapes: pure functions, no I/O.

The prompt itself is validated and tokenized by kvgate's ``tokenizer`` (the same code the gateway
runs). What is checked here is the rest the engine needs: the model name, the generation
options, and the length limit. Errors are worded and shaped as vLLM's OpenAI server words them:
``{"object": "error", "message": ..., "type": "BadRequestError", "param": null, "code": 400}``.

Sampling options (temperature, top_p, seed, ...) are accepted and ignored: the simulated engine's
reply depends on the prompt only (see ``sampling``), which is what makes multi-turn replay exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_ANSWERS = 256  # the most answers (``n``) one request may ask of the simulated engine

DEFAULT_MAX_TOKENS = 16
"""Reply length when a request gives no ``max_tokens``: OpenAI's completions default. (vLLM's chat
default is "the rest of the context", which would make a simulated node decode for minutes.)"""


class APIError(Exception):
    """An error answered to the client as vLLM answers it."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return {"object": "error", "message": self.message, "type": self.err_type, "param": None, "code": self.status}


def bad_request(message: str) -> APIError:
    return APIError(400, message)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "NotFoundError")


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """What the engine does with one request besides its prompt."""

    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int
    answers: int = 1  # ``n``: answers generated side by side


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {value!r}")
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {value!r}")
    return value


def check_model(body: Any, served_model: str) -> None:
    """404 for a model this engine does not serve (the body's shape is the tokenizer's to judge)."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"] != served_model:
        raise model_not_found(body["model"])


def generation_options(
    body: dict[str, Any], *, chat: bool, prompt_tokens: int, max_model_len: int, default_max_tokens: int
) -> GenerationOptions:
    """Validate the generation options of a body whose prompt has ``prompt_tokens`` tokens."""
    n = _int_field(body, "n")
    if n is not None and not 1 <= n <= MAX_ANSWERS:
        raise bad_request(f"n must be in [1, {MAX_ANSWERS}], got {n}.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise bad_request("the simulated engine serves one prompt per request; got a batch of prompts")
    if body.get("stop") not in (None, [], ""):
        raise bad_request("'stop' sequences are not supported by the simulated engine")
    if prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
        )
    max_tokens = _int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_model_len - prompt_tokens)
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.")
    if prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens})."
        )
    min_tokens = _int_field(body, "min_tokens") or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
    stream = _bool_field(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object")
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.")
        include_usage = _bool_field(opts, "include_usage", False)
    return GenerationOptions(max_tokens, stream, include_usage, _bool_field(body, "ignore_eos", False), min_tokens, n or 1)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict[str, Any], answers: int = 1
) -> dict[str, Any]:
    """The answer to a completion; ``answers`` choices (``n``), each the same text: the simulated
    reply depends on the prompt only."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": k, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            for k in range(answers)
        ],
        "usage": usage_,
    }


def chat_response(
    rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict[str, Any], answers: int = 1
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": k,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            for k in range(answers)
        ],
        "usage": usage_,
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None, include_usage: bool, index: int = 0
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None, include_usage: bool,
    index: int = 0,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, *, chat: bool, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def models_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "kvgate",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
        ],
    }
