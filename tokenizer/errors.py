"""The one error the request path maps to an HTTP status: a body that is not a valid request."""

from __future__ import annotations


class InvalidPrompt(ValueError):
    """The body is not a valid inference request; the gateway answers 400 with this message.

    Raised for client mistakes only (missing fields, wrong types, out-of-vocabulary token IDs,
    a chat template that refuses the messages). Problems of kvgate itself raise other errors so
    the gateway can fail open instead of blaming the client.
    """

    status: int = 400


class PromptTooLarge(Exception):
    """The rendered prompt is longer than the caller agreed to tokenize (``max_text_bytes``).

    Not a client mistake as such (the engine may still take it), so the gateway passes the
    request through unjudged; the cap exists so a hostile body cannot buy seconds of CPU.
    """
