"""Which conversation a request belongs to, when the client says so.

A conversation's next turn usually extends its prompt, and the directory finds it by prefix. But
edited history, summarised context and tool loops that rewrite earlier messages break the prefix,
and the conversation would wander to whichever node is cheapest for a cold prompt. A client (or
the API gateway in front of kvgate) can name the conversation: the ``x-session-id`` header, else
the OpenAI body's ``safety_identifier``, else its ``user``. kvgate records the node each session
was last routed to, with a TTL, and the policy prefers that node while it costs little more than
the cheapest (``session_slack`` of the ``kvgate`` policy).
"""

from __future__ import annotations

from typing import Any

import xxhash

SESSION_HEADER = "x-session-id"
BODY_FIELDS = ("safety_identifier", "user")


def session_id(header: str, body: dict[str, Any]) -> str:
    """The conversation's name as the client gave it; "" when it gave none."""
    if header:
        return header
    for name in BODY_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def session_key(session: str, model: str, cache_salt: str | None) -> str:
    """The directory's key of a session: hashed, so the directory never holds a client's user ID,
    and namespaced like the block keys, so two tenants' equal IDs are different sessions."""
    return xxhash.xxh3_128_hexdigest("\0".join((model, cache_salt or "", session)).encode())
