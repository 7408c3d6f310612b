"""Command-line options that choose a workload, shared by ``replay``, ``simulate`` and the demo."""

from __future__ import annotations

import argparse

from loadtest.workloads.as_text import as_text
from loadtest.workloads.base import Workload
from loadtest.workloads.chat import chat_workload
from loadtest.workloads.memory_bound import agentic_workload, memchat_workload
from loadtest.workloads.mixed import mixed_workload
from loadtest.workloads.shared_prefix import shared_prefix_workload
from loadtest.workloads.trace import load_trace, trace_workload
from tokenizer import PromptTokenizer

WORKLOADS = ("chat", "shared-prefix", "trace", "memchat", "agentic", "mixed")
TOKEN_ID_WORKLOADS = ("trace", "memchat", "agentic", "mixed")  # built without the tokenizer


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="chat")
    g.add_argument("--model", default="kvgate-sim", help="model name the engines serve")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--rate", type=float, default=None,
                   help="arrivals/s: new chats (chat, default 0.5; memchat, default 2), prompts (shared-prefix, "
                        "default 4), agents (agentic, default 2) or sessions (mixed, default 6)")
    g.add_argument("--sessions", type=int, default=None,
                   help="memchat: conversations (default 3000); agentic: agents (default 2000); mixed: sessions (default 400)")
    g.add_argument("--multi-share", type=float, default=None,
                   help="mixed: fraction of sessions asking n=2-4 answers a turn (default 0.1; 0: none)")
    g.add_argument("--as-text", action="store_true",
                   help="memchat, agentic: send every prompt as chat text (one word a token) rather than token IDs, "
                        "so text-only routers (sglang) run the same sessions")
    g.add_argument("--max-tokens", type=int, default=96, help="reply budget per request (chat, shared-prefix)")
    g.add_argument("--conversations", type=int, default=32, help="chat: number of conversations")
    g.add_argument("--turns", type=int, default=5, help="chat: turns per conversation")
    g.add_argument("--doc-tokens", type=int, nargs=2, default=(4000, 8000), metavar=("LOW", "HIGH"))
    g.add_argument("--think", type=float, nargs=2, default=(1.0, 3.0), metavar=("LOW", "HIGH"), help="chat: seconds")
    g.add_argument("--groups", type=int, default=8, help="shared-prefix: groups")
    g.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix: prompts per group")
    g.add_argument("--prefix-tokens", type=int, default=6000, help="shared-prefix: common prefix length")
    g.add_argument("--trace", default=None, help="trace: JSONL(.gz) path (default: the shipped Mooncake trace)")
    g.add_argument("--trace-limit", type=int, default=None, help="trace: first N records")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="trace: multiply timestamps by this")
    g.add_argument("--max-output", type=int, default=None, help="trace: cap each reply at this many tokens")
    g.add_argument("--max-input", type=int, default=None, help="trace: drop prompts longer than this")


def build_workload(args: argparse.Namespace, tokenizer: PromptTokenizer | None) -> Workload:
    """The workload the options describe (chat and shared-prefix need the tokenizer to size text)."""
    if args.workload in ("memchat", "agentic"):
        make = memchat_workload if args.workload == "memchat" else agentic_workload
        count = {"conversations" if args.workload == "memchat" else "agents": args.sessions} if args.sessions else {}
        rate = {"rate_per_s": args.rate} if args.rate else {}
        built = make(model=args.model, max_tokens=args.max_tokens, seed=args.seed, **count, **rate)
        if not getattr(args, "as_text", False):
            return built
        if tokenizer is None:
            raise ValueError("--as-text renders prompts with the tokenizer's vocabulary: load it")
        return as_text(built, tokenizer)
    if args.workload == "mixed":
        sized = {"sessions": args.sessions} if args.sessions else {}
        if getattr(args, "multi_share", None) is not None:
            sized["multi_share"] = args.multi_share
        return mixed_workload(model=args.model, seed=args.seed, **sized, **({"rate_per_s": args.rate} if args.rate else {}))
    if args.workload == "trace":
        records = load_trace(args.trace, limit=args.trace_limit)
        return trace_workload(
            records, model=args.model, time_scale=args.trace_time_scale,
            max_output=args.max_output, max_input=args.max_input,
        )
    assert tokenizer is not None, "chat and shared-prefix workloads need the tokenizer"

    def count(text: str) -> int:
        return len(tokenizer.encode_text(text, add_special_tokens=False))

    if args.workload == "chat":
        return chat_workload(
            conversations=args.conversations, turns=args.turns, count_tokens=count, model=args.model,
            rate_per_s=args.rate or 0.5, doc_tokens=tuple(args.doc_tokens), think_s=tuple(args.think),
            max_tokens=args.max_tokens, seed=args.seed,
        )
    return shared_prefix_workload(
        groups=args.groups, prompts_per_group=args.prompts_per_group, count_tokens=count, model=args.model,
        prefix_tokens=args.prefix_tokens, rate_per_s=args.rate or 4.0, max_tokens=args.max_tokens, seed=args.seed,
    )
