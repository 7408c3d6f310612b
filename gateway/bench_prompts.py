"""``kvgate bench overhead --prompt-tokens 1k,8k,32k,128k``: what a prompt's length costs kvgate.

Three kinds of request per size, each sent through plain Envoy and through Envoy + kvgate over
ext_authz (the same bodies; alternating request by request at concurrency 1), at concurrency 1
and with ``concurrency`` in flight:

- ``chat``: a continuing chat — a history of that size seen before (sent once beforehand), plus one
  new short turn. It should cost what the new turn costs, not what the history costs.
- ``fresh``: a prompt of that size never seen (every request is different text).
- ``tokens``: the continuing chat's token IDs given as the prompt (``/v1/completions``).

The text kinds also go through sglang-router (when it is a target), which must read the whole
body to route as kvgate must: the part of a long prompt's cost that is the body's trip through a
buffering proxy shows in both.

Per cell: latency p50/p99 and what kvgate adds over plain Envoy, kvgate's decision p50/p99 (its
``kvgate_decision_seconds{stage="total"}`` histogram, interpolated in its buckets), kvgate's CPU
per request on the request path (the serve process) and in the background worker (its children),
and Envoy's. ``chat_rounds`` then measures continuing chats of the smallest and the largest size
in ``--rounds`` rounds (the sizes taking turns to go first), each round's ratio of their added p50
with the median and spread of the rounds: the ratio of two cells measured minutes apart carried
the drift of plain Envoy's own p50 between them. ``interference`` measures the p99 of continuing
1k chats alone and while fresh prompts of the largest size arrive back to back, through plain
Envoy and through kvgate (in ``--rounds`` rounds, the targets taking turns to go first), per round
and pooled: a fresh prompt must not hold up the others more than the long body itself does.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Sequence

import aiohttp
from rich.console import Console
from rich.table import Table

from gateway.bench_cmd import background_idle, cpu_seconds, percentiles, post, run_requests, scrape
from loadtest.prom import bucket_delta, counter_value, histogram_buckets, histogram_quantile
from tokenizer import PromptTokenizer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CONVERSATIONS = 4
KINDS = ("chat", "fresh", "tokens")


class Bodies:
    """Request bodies of a given prompt length, sized with the gateway's own tokenizer."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.tok = PromptTokenizer()

    @staticmethod
    def _sentence(tag: str, i: int) -> str:
        return f"{tag}: paragraph {i} records that shipment {i * 13 % 997} left port {i % 17} on time."

    def doc(self, tag: str, tokens: int) -> str:
        n = tokens // 20
        for _ in range(2):  # sentence lengths vary with the tag and the numbers in them: sample the range
            sample = " ".join(self._sentence(tag, i) for i in range(0, n, max(n // 50, 1)))
            per_sentence = len(self.tok.encode_text(sample, add_special_tokens=False)) / len(range(0, n, max(n // 50, 1)))
            n = max(int((tokens - 60) / per_sentence), 1)  # room for the template and the new turn
        return " ".join(self._sentence(tag, i) for i in range(n))

    def _messages(self, history: str, turn: int) -> list[dict]:
        return [
            {"role": "system", "content": "You are a careful analyst."},
            {"role": "user", "content": history + "\nSummarise the shipments."},
            {"role": "assistant", "content": "Most shipments left on time; a few ports dominate."},
            {"role": "user", "content": f"Question {turn}: which port shipped most in week {turn}?"},
        ]

    def chat(self, history: str, turn: int) -> bytes:
        return json.dumps({"model": self.model, "messages": self._messages(history, turn), "max_tokens": 8}).encode()

    def fresh(self, tag: str, tokens: int) -> bytes:
        messages = [{"role": "user", "content": self.doc(tag, tokens)}]
        return json.dumps({"model": self.model, "messages": messages, "max_tokens": 8}).encode()

    def token_ids(self, history: str, turn: int) -> bytes:
        ids = self.tok.tokenize_body(CHAT, {"model": self.model, "messages": self._messages(history, turn)}).token_ids
        return json.dumps({"model": self.model, "prompt": ids.tolist(), "max_tokens": 8}).encode()

    def prompt_tokens(self, path: str, body: bytes) -> int:
        return len(self.tok.tokenize_body(path, json.loads(body)).token_ids)


def _decision_ms(before: str, after: str) -> dict[str, float | None]:
    labels = {"stage": "total"}
    name = "kvgate_decision_seconds"
    delta = bucket_delta(histogram_buckets(after, name, labels), histogram_buckets(before, name, labels))
    out: dict[str, float | None] = {}
    for key, q in (("decision_p50_ms", 0.5), ("decision_p99_ms", 0.99)):
        v = histogram_quantile(q, delta)
        out[key] = None if v is None else v * 1000
    return out


async def alternating(s: aiohttp.ClientSession, first: str, second: str, bodies: Sequence[bytes]) -> tuple[list[float], list[float]]:
    """Every body to ``first`` and to ``second``, one request at a time, which goes first swapped
    from body to body; the two lists of latencies. A drift of the machine's load (other processes,
    CPU frequency) over the run then weighs on both alike: measured one after the other, all of it
    went into their difference."""
    a: list[float] = []
    b: list[float] = []
    for i, body in enumerate(bodies):
        if i % 2 == 0:
            a.append(await post(s, first, body))
            b.append(await post(s, second, body))
        else:
            b.append(await post(s, second, body))
            a.append(await post(s, first, body))
    return a, b


async def _cell(
    s: aiohttp.ClientSession, urls: dict[str, str], path: str, bodies: Sequence[bytes], concurrency: int,
    *, kvgate_pid: int, envoy_pid: int, admin_url: str, sglang_pid: int | None,
) -> dict:
    """The same bodies through plain Envoy and through kvgate — alternating at concurrency 1, one
    after the other when many are in flight (they would load each other) — and through
    sglang-router for text prompts (it refuses token IDs); each one's figures and what it adds
    over plain Envoy. Plain Envoy is another process: kvgate's and its Envoy's CPU are theirs."""
    envoy_url, kvgate_url = urls["envoy"] + path, urls["kvgate"] + path
    base_lat = await run_requests(s, envoy_url, bodies, concurrency) if concurrency > 1 else None
    m0 = await scrape(s, admin_url)
    kv0, bg0, e0 = cpu_seconds(kvgate_pid), cpu_seconds(kvgate_pid, children=True), cpu_seconds(envoy_pid)
    if base_lat is None:
        base_lat, lat = await alternating(s, envoy_url, kvgate_url, bodies)
    else:
        lat = await run_requests(s, kvgate_url, bodies, concurrency)
    kv1, e1 = cpu_seconds(kvgate_pid), cpu_seconds(envoy_pid)  # before polling /metrics, which costs kvgate CPU too
    await background_idle(s, admin_url)  # the background work these requests caused, all of it
    bg1 = cpu_seconds(kvgate_pid, children=True)
    m1 = await scrape(s, admin_url)
    base = percentiles(base_lat)
    peer: dict = {}
    if sglang_pid is not None and path == CHAT:
        c0 = cpu_seconds(sglang_pid, children=False)
        got = percentiles(await run_requests(s, urls["sglang"] + path, bodies, concurrency))
        peer = {
            "sglang_p50_ms": got["p50_ms"], "sglang_p99_ms": got["p99_ms"],
            "sglang_added_p50_ms": got["p50_ms"] - base["p50_ms"], "sglang_added_p99_ms": got["p99_ms"] - base["p99_ms"],
            "sglang_cpu_ms_per_request": (cpu_seconds(sglang_pid) - c0) * 1000 / len(bodies),
        }
    n = len(bodies)
    got = percentiles(lat)
    return {
        **got,
        "envoy_p50_ms": base["p50_ms"], "envoy_p99_ms": base["p99_ms"],
        "added_p50_ms": got["p50_ms"] - base["p50_ms"], "added_p99_ms": got["p99_ms"] - base["p99_ms"],
        **_decision_ms(m0, m1),
        "failed_open": counter_value(m1, "kvgate_fail_open") - counter_value(m0, "kvgate_fail_open"),
        "cpu_ms_per_request": (kv1 - kv0) * 1000 / n,
        "background_cpu_ms_per_request": (bg1 - bg0) * 1000 / n,
        "envoy_cpu_ms_per_request": (e1 - e0) * 1000 / n,
        "requests": n,
        **peer,
    }


async def sweep(
    sizes: Sequence[int], *, envoy_url: str, kvgate_url: str, kvgate_pid: int, envoy_pid: int, admin_url: str,
    requests: int, concurrency: int, model: str, sglang_url: str | None = None, sglang_pid: int | None = None,
    rounds: int = 4,
) -> dict:
    """Every kind × size × (1, ``concurrency``), then ``rounds`` rounds of continuing chats of the
    smallest and largest size (``chat_rounds``) and of the interference run; the figures as a dict."""
    make = Bodies(model)
    urls = {"envoy": envoy_url, "kvgate": kvgate_url, "sglang": sglang_url or ""}
    out: dict = {"cells": [], "concurrency": concurrency}
    loaded = max(requests, 3 * concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        warm = [make.chat(make.doc("Warm-up", 1000), i) for i in range(10)]  # connections and caches
        for target in ("envoy", "kvgate", "sglang"):
            if urls[target]:
                await run_requests(s, urls[target] + CHAT, warm, 1)
        by_size = {size: [make.doc(f"Chat {size}-{c}", size) for c in range(CONVERSATIONS)] for size in sizes}
        for size in sizes:
            histories = by_size[size]
            for c, history in enumerate(histories):  # seen before: one earlier turn of each chat
                await post(s, urls["kvgate"] + CHAT, make.chat(history, -1))
                await background_idle(s, admin_url)
            for conc, n in ((1, requests), (concurrency, loaded)):
                kinds = {
                    "chat": (CHAT, [make.chat(histories[i % CONVERSATIONS], i) for i in range(n)]),
                    "fresh": (CHAT, [make.fresh(f"Fresh {size}-{conc}-{i}", size) for i in range(n)]),
                    "tokens": (COMPLETIONS, [make.token_ids(histories[i % CONVERSATIONS], i) for i in range(n)]),
                }
                for kind, (path, bodies) in kinds.items():
                    cell = await _cell(s, urls, path, bodies, conc, kvgate_pid=kvgate_pid, envoy_pid=envoy_pid,
                                       admin_url=admin_url, sglang_pid=sglang_pid)
                    cell.update(kind=kind, size=size, concurrency=conc, prompt_tokens=make.prompt_tokens(path, bodies[0]))
                    out["cells"].append(cell)
        if len(sizes) > 1 and rounds > 0:
            out["chat_rounds"] = await chat_rounds(s, urls, make, {k: by_size[k] for k in (min(sizes), max(sizes))}, requests, rounds)
        out["interference"] = await _interference(s, urls, make, max(sizes), 2 * requests, admin_url, rounds=max(rounds, 1))
    out["goals"] = goals(out)
    return out


def spread(values: Sequence[float]) -> dict:
    """Per-round figures and their median, min and max: how far one round's figure can be trusted."""
    ordered = sorted(values)
    return {"per_round": list(values), "median": statistics.median(ordered) if ordered else None,
            "min": ordered[0] if ordered else None, "max": ordered[-1] if ordered else None}


def goals(result: dict) -> dict[str, float]:
    """The sweep's figures the request-path goals are stated in: what a continuing chat of the
    largest size adds over what one of the smallest adds (goal ≤ 2; the median of the rounds of
    ``chat_rounds`` when measured, else from the cells at concurrency 1), a fresh prompt of the
    largest size's added p99 at concurrency 1 (goal ≤ 50 ms), and how much more the p99 of other
    requests rises through kvgate than through plain Envoy while those arrive (goal ≤ 2 ms; the
    median of the rounds)."""
    alone = {(c["kind"], c["size"]): c for c in result["cells"] if c["concurrency"] == 1}
    sizes = sorted({size for _, size in alone})
    out: dict[str, float] = {}
    small, large = alone.get(("chat", sizes[0])), alone.get(("chat", sizes[-1]))
    ratio = result.get("chat_rounds", {}).get("ratio", {})
    if ratio.get("median") is not None:
        out["chat_largest_added_p50_over_smallest"] = ratio["median"]
        out["chat_largest_added_p50_over_smallest_min"] = ratio["min"]
        out["chat_largest_added_p50_over_smallest_max"] = ratio["max"]
    elif small and large and small["added_p50_ms"] > 0:
        out["chat_largest_added_p50_over_smallest"] = large["added_p50_ms"] / small["added_p50_ms"]
    fresh = alone.get(("fresh", sizes[-1]))
    if fresh:
        out["fresh_largest_added_p99_ms"] = fresh["added_p99_ms"]
    if "interference" in result:
        rise = result["interference"]["rise_over_envoy"]
        out["interference_p99_rise_over_envoy_ms"] = rise["median"]
        out["interference_p99_rise_over_envoy_ms_min"] = rise["min"]
        out["interference_p99_rise_over_envoy_ms_max"] = rise["max"]
        out["interference_pooled_p99_rise_over_envoy_ms"] = result["interference"]["kvgate_p99_rise_over_envoy_ms"]
    return out


async def chat_rounds(
    s: aiohttp.ClientSession, urls: dict[str, str], make: Bodies, histories: dict[int, list[str]], n: int, rounds: int
) -> dict:
    """Continuing chats of the smallest and the largest size (``histories``: each seen before),
    in ``rounds`` rounds, the two sizes taking turns to go first (ABBA…), each batch alternating
    plain Envoy and kvgate request by request. Per round: each size's added p50 and the ratio of
    the largest's to the smallest's. Measured minutes apart, two cells' ratio carried the drift of
    plain Envoy's own p50 between them (0.5–1.0 ms on this machine); here each round's ratio is
    measured within seconds, and the spread of the rounds says how far one figure can be trusted."""
    small, large = min(histories), max(histories)
    pooled: dict[int, tuple[list[float], list[float]]] = {size: ([], []) for size in (small, large)}
    per_round = []
    for r in range(rounds):
        added = {}
        for size in ((small, large) if r % 2 == 0 else (large, small)):
            bodies = [make.chat(histories[size][i % CONVERSATIONS], 100_000 + r * n + i) for i in range(n)]  # new turns
            base, lat = await alternating(s, urls["envoy"] + CHAT, urls["kvgate"] + CHAT, bodies)
            pooled[size][0].extend(base)
            pooled[size][1].extend(lat)
            added[size] = percentiles(lat)["p50_ms"] - percentiles(base)["p50_ms"]
        per_round.append({"added_p50_ms": {str(k): v for k, v in added.items()},
                          "ratio": added[large] / added[small] if added[small] > 0 else None})
    pooled_added = {size: percentiles(lat)["p50_ms"] - percentiles(base)["p50_ms"] for size, (base, lat) in pooled.items()}
    ratios = [r["ratio"] for r in per_round if r["ratio"] is not None]
    return {
        "sizes": [small, large], "requests_per_round": n, "rounds": per_round, "ratio": spread(ratios),
        "pooled_added_p50_ms": {str(k): v for k, v in pooled_added.items()},
        "pooled_ratio": pooled_added[large] / pooled_added[small] if pooled_added[small] > 0 else None,
    }


async def _interference(
    s: aiohttp.ClientSession, urls: dict[str, str], make: Bodies, size: int, n: int, admin_url: str, *, rounds: int = 2
) -> dict:
    """p50/p99 of continuing 1k chats at concurrency 1, alone and while fresh ``size`` prompts
    arrive back to back on other connections — through kvgate and, as the baseline, through plain
    Envoy (the same machine also carries the long bodies there: what kvgate adds is the difference).

    ``rounds`` rounds of ``n // 2`` chats alone and ``n // 2`` beside the flood per target, the
    targets taking turns to go first (Envoy, kvgate, kvgate, Envoy, …): a load that drifts over the
    run weighs on both alike. Per round, the rise of kvgate's p99 over the rise of Envoy's (its
    spread says how far one figure can be trusted); pooled per target as well."""
    history = make.doc("Interference chat", 1000)
    await post(s, urls["kvgate"] + CHAT, make.chat(history, -1))
    half = max(n // 2, 1)
    pooled = {t: {"alone": [], "with_fresh": [], "fresh": []} for t in ("envoy", "kvgate")}
    per_round = []
    turn = 0
    for r in range(rounds):
        rises = {}
        for target in (("envoy", "kvgate") if r % 2 == 0 else ("kvgate", "envoy")):
            url = urls[target] + CHAT
            normal = [make.chat(history, turn + i) for i in range(2 * half)]  # a new turn each: none cached yet
            turn += 2 * half
            alone = await run_requests(s, url, normal[:half], 1)
            stop = asyncio.Event()
            fresh_lat = pooled[target]["fresh"]
            flood_bodies = [make.fresh(f"Flood {target} {r} {i}", size) for i in range(n)]  # built before: the client must not stall

            async def flood() -> None:
                for body in flood_bodies:
                    if stop.is_set():
                        return
                    fresh_lat.append(await post(s, url, body))

            task = asyncio.create_task(flood())
            await asyncio.sleep(0.2)
            try:
                busy = await run_requests(s, url, normal[half:], 1)
            finally:
                stop.set()
                await task
            await background_idle(s, admin_url)
            pooled[target]["alone"] += alone
            pooled[target]["with_fresh"] += busy
            rises[target] = percentiles(busy)["p99_ms"] - percentiles(alone)["p99_ms"]
        per_round.append({"envoy_p99_rise_ms": rises["envoy"], "kvgate_p99_rise_ms": rises["kvgate"],
                          "rise_over_envoy_ms": rises["kvgate"] - rises["envoy"]})
    out: dict = {"fresh_tokens": size, "chats_per_round": half, "rounds": per_round,
                 "rise_over_envoy": spread([r["rise_over_envoy_ms"] for r in per_round])}
    for target, lat in pooled.items():
        alone, busy = percentiles(lat["alone"]), percentiles(lat["with_fresh"])
        out[target] = {"alone": alone, "with_fresh": busy, "fresh": percentiles(lat["fresh"]), "fresh_requests": len(lat["fresh"]),
                       "p99_rise_ms": busy["p99_ms"] - alone["p99_ms"]}
    out["kvgate_p99_rise_over_envoy_ms"] = out["kvgate"]["p99_rise_ms"] - out["envoy"]["p99_rise_ms"]
    return out


def print_sweep(result: dict, console: Console) -> None:
    table = Table(title="prompt-length sweep through Envoy + kvgate ext_authz (added = over plain Envoy, same bodies)")
    cols = ("kind", "tokens", "in flight", "p50 ms", "p99 ms", "added p50", "added p99", "decision p50", "decision p99",
            "kvgate CPU ms/req", "background CPU ms/req", "Envoy CPU ms/req", "sglang added p50", "sglang added p99",
            "sglang CPU ms/req")
    for col in cols:
        table.add_column(col, justify="left" if col == "kind" else "right")
    for c in result["cells"]:
        table.add_row(
            c["kind"], f"{c['prompt_tokens']:,}", str(c["concurrency"]), f"{c['p50_ms']:.2f}", f"{c['p99_ms']:.2f}",
            f"{c['added_p50_ms']:+.2f}", f"{c['added_p99_ms']:+.2f}",
            "" if c["decision_p50_ms"] is None else f"{c['decision_p50_ms']:.2f}",
            "" if c["decision_p99_ms"] is None else f"{c['decision_p99_ms']:.2f}",
            f"{c['cpu_ms_per_request']:.3f}", f"{c['background_cpu_ms_per_request']:.3f}", f"{c['envoy_cpu_ms_per_request']:.3f}",
            *((f"{c['sglang_added_p50_ms']:+.2f}", f"{c['sglang_added_p99_ms']:+.2f}", f"{c['sglang_cpu_ms_per_request']:.3f}")
              if "sglang_p50_ms" in c else ("", "", "")),
        )
    console.print(table)
    i = result["interference"]
    for target in ("envoy", "kvgate"):
        r = i[target]
        console.print(
            f"interference through {target}: 1k continuing chats p50/p99 {r['alone']['p50_ms']:.2f}/{r['alone']['p99_ms']:.2f} ms "
            f"alone, {r['with_fresh']['p50_ms']:.2f}/{r['with_fresh']['p99_ms']:.2f} ms while {r['fresh_requests']} fresh "
            f"{i['fresh_tokens']:,}-token prompts arrived (their p99 {r['fresh']['p99_ms']:.1f} ms): p99 rise {r['p99_rise_ms']:+.2f} ms"
        )
    console.print(f"p99 rise kvgate adds over plain Envoy's: {i['kvgate_p99_rise_over_envoy_ms']:+.2f} ms pooled; per round "
                  + _rounds_text(i["rise_over_envoy"], "{:+.2f}") + " ms")
    if "chat_rounds" in result:
        c = result["chat_rounds"]
        small, large = c["sizes"]
        console.print(f"continuing chat, {large:,} / {small:,} tokens added p50, per round of {c['requests_per_round']} a size: "
                      + _rounds_text(c["ratio"], "{:.2f}")
                      + ("" if c["pooled_ratio"] is None else f"; pooled {c['pooled_ratio']:.2f}"))
    for key, value in result.get("goals", {}).items():
        if value is not None:
            console.print(f"{key}: {value:.2f}")


def _rounds_text(figures: dict, fmt: str) -> str:
    if figures["median"] is None:
        return "(none)"
    shown = ", ".join(fmt.format(v) for v in figures["per_round"])
    return f"{shown} (median {fmt.format(figures['median'])}, {fmt.format(figures['min'])} to {fmt.format(figures['max'])})"
