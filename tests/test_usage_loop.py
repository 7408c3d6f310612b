"""The closed loop from responses: kvgate reads ``usage.prompt_tokens_details.cached_tokens`` where
it sees the answer, beside what it predicted for the node.

Real Envoy, ``kvgate serve`` (ext_proc, ``usage_sample: 1``) and two simulated engines that report
``cached_tokens`` like vLLM (in the JSON body; in the last SSE chunk when the stream asked for
``stream_options.include_usage``). The figures kvgate records equal what the client saw, the
client's answers pass unchanged (a long answer is not held back), and an answer without usage
is counted as unread. The same against real vLLM is in test_vllm_conformance.py.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ext_proc.usage import TAIL_BYTES, UsageTail
from loadtest.local_fleet import FleetOptions, Gateway, LocalFleet, http
from loadtest.prom import counter_value

MODEL = "usage-sim"


def test_the_tail_reads_the_last_usage_and_never_generated_text() -> None:
    tail = UsageTail()
    text = json.dumps({"choices": [{"text": 'say "cached_tokens": 999 and "prompt_tokens": 5'}],
                       "usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}).encode()  # fmt: skip
    for i in range(0, len(text), 7):  # any chunking
        tail.feed(text[i : i + 7])
    assert (tail.usage().prompt_tokens, tail.usage().cached_tokens) == (300, 256)
    only_text = UsageTail()
    only_text.feed(json.dumps({"choices": [{"text": '"cached_tokens": 999'}], "usage": None}).encode())
    assert only_text.usage() is None  # escaped inside a string: never read as usage
    sse = UsageTail()
    sse.feed(b'data: {"usage": null, "choices": [{"delta": {"content": "x"}}]}\n\n' * 1000)
    sse.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n')
    sse.feed(b"data: [DONE]\n\n")
    assert sse.usage().cached_tokens == 32 and len(sse._tail) <= TAIL_BYTES  # bounded, whatever the answer's size


class UsageFleet(LocalFleet):
    def serve_settings(self) -> dict[str, object]:
        return {"usage_sample": 1.0, "engine_scrape_interval_s": 0}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with UsageFleet(FleetOptions(nodes=2, model=MODEL, time_scale=0), tmp_path_factory.mktemp("usage")) as fleet:
        with fleet.gateway("kvgate", policy="kvgate") as gw:
            yield gw


def _post(gw: Gateway, body: dict) -> bytes:
    req = urllib.request.Request(gw.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def _observed(gw: Gateway) -> dict[str, float]:
    assert gw.metrics_url is not None
    text = http(gw.metrics_url)[1].decode()
    names = ("kvgate_node_observed_responses", "kvgate_node_observed_cached_tokens", "kvgate_node_expected_cached_tokens",
             "kvgate_node_observed_expected_cached_tokens", "kvgate_usage_unread")  # fmt: skip
    return {name + "_total": counter_value(text, name) for name in names}


def test_kvgate_records_what_the_client_saw(gateway: Gateway) -> None:
    before = _observed(gateway)
    prompt = "The harbour authority recorded a steady rise in traffic near Ashford. " * 20
    seen = 0
    for _ in range(3):  # the first fills a node's cache; the next two hit it
        answer = json.loads(_post(gateway, {"model": MODEL, "prompt": prompt, "max_tokens": 4}))
        seen += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        time.sleep(0.3)  # the node's KV events reach kvgate's directory
    stream = _post(gateway, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True,
                             "stream_options": {"include_usage": True}}).decode()  # fmt: skip
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    seen += chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert stream.rstrip().endswith("data: [DONE]") and len(chunks) >= 9  # passed through whole
    long = json.loads(_post(gateway, {"model": MODEL, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True}))
    assert long["usage"]["completion_tokens"] == 3000 and len(long["choices"][0]["text"]) > TAIL_BYTES
    seen += long["usage"]["prompt_tokens_details"]["cached_tokens"]
    deadline = time.monotonic() + 5  # each answer is counted by the time Envoy closes its ext_proc stream
    while (after := _observed(gateway))["kvgate_node_observed_responses_total"] - before["kvgate_node_observed_responses_total"] < 5:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert seen >= 4 * 8 * 16  # every answer after the first hit
    assert after["kvgate_node_observed_responses_total"] - before["kvgate_node_observed_responses_total"] == 5
    assert after["kvgate_node_observed_cached_tokens_total"] - before["kvgate_node_observed_cached_tokens_total"] == seen
    predicted = after["kvgate_node_observed_expected_cached_tokens_total"] - before["kvgate_node_observed_expected_cached_tokens_total"]
    # every request was sampled, so the predictions read beside usage are all kvgate made
    assert predicted == after["kvgate_node_expected_cached_tokens_total"] - before["kvgate_node_expected_cached_tokens_total"]
    assert 0 < predicted <= seen, (predicted, seen)  # kvgate predicted hits, and the engine delivered at least those

    _post(gateway, {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True})  # no usage asked: unread
    deadline = time.monotonic() + 5
    while (last := _observed(gateway))["kvgate_usage_unread_total"] == after["kvgate_usage_unread_total"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert last["kvgate_node_observed_responses_total"] == after["kvgate_node_observed_responses_total"]


class HalfSampledFleet(LocalFleet):
    def serve_settings(self) -> dict[str, object]:
        return {"usage_sample": 0.5, "engine_scrape_interval_s": 0}


def test_streams_not_sampled_are_never_counted_as_resets(tmp_path: Path) -> None:
    """A sampled stream asks Envoy for its response headers itself; before, that taught kvgate
    that every stream gets them, so each unsampled answer counted as a reset against its node
    (5 in a row eject a healthy node)."""
    with HalfSampledFleet(FleetOptions(nodes=2, model=MODEL, time_scale=0), tmp_path) as fleet:
        with fleet.gateway("kvgate", policy="kvgate") as gw:
            for i in range(24):
                _post(gw, {"model": MODEL, "prompt": f"request {i} " * 40, "max_tokens": 2})
            assert gw.metrics_url is not None
            text = http(gw.metrics_url)[1].decode()
    read = counter_value(text, "kvgate_node_observed_responses")
    assert 0 < read < 24  # some answers were sampled, some not
    assert counter_value(text, "kvgate_node_failures") == 0 and counter_value(text, "kvgate_node_ejections") == 0
