"""How a node's recently served prompts (``HotPrefix``) are stored: one member per prompt, scored by
when it was last served, the same bytes in every backend.

A member is msgpack ``[model, tokens]``: serving the same prompt again only moves its score.
Earlier turns of a conversation are prefixes of its latest and stay as their own members; a drain
drops them (``gateway.drain.distinct_prefixes``), the directory does not look inside.
"""

from __future__ import annotations

import msgspec

from directory_client.types import HotPrefix

MAX_HOT_TOKENS = 32768  # a recorded prompt is cut to this many tokens (128 KiB): a copied prefix still warms its
# conversation, and a node's record stays under keep × 128 KiB in the directory however long its prompts
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(tuple[str, bytes]).decode


def check_hot(model: str, tokens: bytes, keep: int, ttl_s: float) -> bytes:
    """The member for a prompt; ``ValueError`` on arguments no backend should store."""
    if not isinstance(model, str) or not model:
        raise ValueError("a hot prefix needs its model name")
    if not isinstance(tokens, bytes) or len(tokens) % 4:
        raise ValueError("a hot prefix's tokens are little-endian uint32 bytes")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
    return _encode((model, tokens[: 4 * MAX_HOT_TOKENS]))


def hot_prefix(member: bytes, at: float) -> HotPrefix | None:
    """A stored member back; None for bytes that are not one (the directory is shared)."""
    try:
        model, tokens = _decode(member)
    except (msgspec.DecodeError, ValueError):
        return None
    if len(tokens) % 4:
        return None
    return HotPrefix(model, tokens, at)
