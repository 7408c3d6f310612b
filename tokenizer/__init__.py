"""Prompt → token IDs exactly as the serving engine does it, and token IDs → chained block keys.

``PromptTokenizer`` and friends are imported on first use: ``tokenizer.keys`` is imported by
the directory and the KV-event bridge, which must not pay for ``tokenizers`` and ``jinja2``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenizer.keys import BlockKey, block_keys, namespace_seed

if TYPE_CHECKING:
    from tokenizer.errors import InvalidPrompt, PromptTooLarge
    from tokenizer.lru import CacheStats
    from tokenizer.prompt_tokenizer import PreparedPrompt, PromptHead, PromptTokenizer, TokenizedPrompt

_LAZY = {
    "InvalidPrompt": "tokenizer.errors",
    "PromptTooLarge": "tokenizer.errors",
    "CacheStats": "tokenizer.lru",
    "PreparedPrompt": "tokenizer.prompt_tokenizer",
    "PromptHead": "tokenizer.prompt_tokenizer",
    "PromptTokenizer": "tokenizer.prompt_tokenizer",
    "TokenizedPrompt": "tokenizer.prompt_tokenizer",
}

__all__ = [
    "BlockKey", "CacheStats", "InvalidPrompt", "PreparedPrompt", "PromptHead", "PromptTokenizer", "PromptTooLarge", "TokenizedPrompt",
    "block_keys", "namespace_seed",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenizer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
