"""The P/D sidecar over real sockets: `kvgate pd-sidecar` in front of a decode `kvgate worker`, a
prefill worker, both with transfer agents (Mooncake over loopback, the fleet's secret).

A split request is prefilled on the prefill node (max_tokens 1, do_remote_decode), its KV pulled
by the decode engine through the transfer agents and verified, then decoded; the client sees one
ordinary answer whatever fails on the way.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.conftest import free_port
from tests.support.http import get_json, request
from tests.support.procs import Proc, python_module, rss_bytes, start_echo, wait_for_port
from tests.support.transfer import secret_file

MODEL = "deepseek-chat"
PROMPT = [(i * 7919) % 120000 for i in range(2000)]  # 125 blocks of 16


def worker(name: str, tmp, secret: str, procs: list[Proc]) -> str:
    http, transfer = free_port(), free_port()
    p = python_module(
        f"worker-{name}", "workers.engine",
        ["--port", str(http), "--model", MODEL, "--node-id", name, "--profile", "llama-3.1-8b-h100",
         "--time-scale", "0.01", "--transfer-port", str(transfer), "--transfer-secret-file", secret, "--debug-headers"],
        tmp,
    )  # fmt: skip
    procs.append(p)
    wait_for_port(http, proc=p.popen, timeout_s=30)
    wait_for_port(transfer, proc=p.popen, timeout_s=30)
    return f"127.0.0.1:{http}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd-sidecar")
    stranger_dir = tmp / "stranger"
    stranger_dir.mkdir()
    (stranger_dir / "transfer-secret").write_bytes(b"not-the-fleet-secret-at-all-0123")
    procs: list[Proc] = []
    try:
        nodes = {
            "prefill": worker("p1", tmp, secret_file(tmp), procs),
            "decode": worker("d1", tmp, secret_file(tmp), procs),
            "stranger": worker("x1", tmp, str(stranger_dir / "transfer-secret"), procs),  # another fleet's secret
        }
        slow, plain = free_port(), free_port()
        procs.append(start_echo("slow", slow, tmp, delay_s=5.0))
        procs.append(start_echo("plain", plain, tmp))  # answers without kv_transfer_params
        nodes["slow"], nodes["plain"], nodes["down"] = f"127.0.0.1:{slow}", f"127.0.0.1:{plain}", f"127.0.0.1:{free_port()}"
        for mode in ("deep", "endless"):  # answer 200 with garbage
            garbage = free_port()
            procs.append(python_module(f"prefiller-{mode}", "tests.support.hostile_prefiller", ["--port", str(garbage), "--mode", mode], tmp))
            wait_for_port(garbage, proc=procs[-1].popen)
            nodes[mode] = f"127.0.0.1:{garbage}"
        port = free_port()
        procs.append(python_module(
            "pd-sidecar", "gateway.cli",
            ["pd-sidecar", "--port", str(port), "--engine", f"http://{nodes['decode']}", "--prefill-timeout-s", "1.0", "--any-prefiller"],
            tmp,
        ))  # fmt: skip
        wait_for_port(port, proc=procs[-1].popen, timeout_s=30)
        nodes["sidecar"], nodes["sidecar_pid"] = f"127.0.0.1:{port}", str(procs[-1].popen.pid)
        echoing = free_port()  # a sidecar in front of the echo node: says what reached the engine
        procs.append(python_module(
            "pd-sidecar-echoing", "gateway.cli", ["pd-sidecar", "--port", str(echoing), "--engine", f"http://{nodes['plain']}", "--any-prefiller"], tmp,
        ))  # fmt: skip
        wait_for_port(echoing, proc=procs[-1].popen, timeout_s=30)
        nodes["echoing"] = f"127.0.0.1:{echoing}"
        guarded = free_port()  # a sidecar that calls only the fleet's prefill node
        procs.append(python_module(
            "pd-sidecar-guarded", "gateway.cli",
            ["pd-sidecar", "--port", str(guarded), "--engine", f"http://{nodes['decode']}", "--prefiller", nodes["prefill"]],
            tmp,
        ))  # fmt: skip
        wait_for_port(guarded, proc=procs[-1].popen, timeout_s=30)
        nodes["guarded"] = f"127.0.0.1:{guarded}"
        yield nodes
    finally:
        for p in reversed(procs):
            p.stop()


def ask(
    fleet: dict[str, str], prefiller: str | None, prompt: list[int] = PROMPT, *, sidecar: str = "sidecar", stream: bool = False
) -> tuple[int, dict[str, str], Any]:
    headers = {"content-type": "application/json"}
    if prefiller is not None:
        headers["x-prefiller-host-port"] = fleet[prefiller]
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "stream": stream}).encode()
    status, head, raw = request(f"http://{fleet[sidecar]}/v1/completions", method="POST", body=body, headers=headers, timeout=30)
    return status, head, raw.decode() if stream else json.loads(raw)


def sidecar_metric(fleet: dict[str, str], name: str, reason: str = "", sidecar: str = "sidecar") -> float:
    _, _, raw = request(f"http://{fleet[sidecar]}/pd-sidecar/metrics")
    label = f'{{reason="{reason}"}}' if reason else ""
    m = re.search(rf"^{name}_total{re.escape(label)} (\S+)$", raw.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def blocks_held(address: str) -> int:
    return len(get_json(f"http://{address}/debug/blocks")[1]["blocks"])


def test_a_split_request_is_prefilled_there_and_its_kv_pulled_verified_here(fleet) -> None:
    prompt = [t + 1 for t in PROMPT]  # a prompt neither node has seen
    before = sidecar_metric(fleet, "kvgate_pd_sidecar_split")
    status, head, body = ask(fleet, "prefill", prompt)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8 and "kv_transfer_params" not in body  # an ordinary answer
    assert head["x-kvgate-node"] == "d1"
    assert head["x-kvgate-pull"] == "ok"
    pulled = int(head["x-kvgate-pulled-blocks"])
    assert pulled == (len(prompt) - 1) // 16  # every block the engine does not recompute came over
    assert int(head["x-kvgate-cached-tokens"]) == pulled * 16  # and was used as a cache hit
    assert sidecar_metric(fleet, "kvgate_pd_sidecar_split") == before + 1
    assert blocks_held(fleet["prefill"]) >= pulled  # the prefill node computed the prompt


def test_without_the_header_the_request_passes_through(fleet) -> None:
    held = blocks_held(fleet["prefill"])
    status, head, body = ask(fleet, None, [t + 2 for t in PROMPT])
    assert status == 200, body
    assert "x-kvgate-pull" not in head and head["x-kvgate-cached-tokens"] == "0"  # computed here
    assert blocks_held(fleet["prefill"]) == held


@pytest.mark.parametrize(
    "prefiller,reason",
    [("down", "prefill_error"), ("slow", "prefill_timeout"), ("plain", "no_transfer_params")],
)
def test_a_failing_prefill_node_leaves_the_request_served_whole(fleet, prefiller: str, reason: str) -> None:
    before = sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", reason)
    status, head, body = ask(fleet, prefiller, [t + 3 for t in PROMPT])
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8
    assert "x-kvgate-pull" not in head  # no transfer parameters: computed on the decode node
    assert sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", reason) == before + 1


def test_kv_from_outside_the_fleets_secret_is_never_used(fleet) -> None:
    # the stranger prefills and names its own transfer agent; it is not signed with this
    # fleet's secret, so the decode engine's pull fails and the prompt is recomputed
    status, head, body = ask(fleet, "stranger", [t + 4 for t in PROMPT])
    assert status == 200, body
    assert head["x-kvgate-pull"] == "failed:refused"  # the stranger's agent cannot check this fleet's signature
    assert head["x-kvgate-cached-tokens"] == "0" and body["usage"]["completion_tokens"] == 8
    metrics = request(f"http://{fleet['decode']}/metrics")[2].decode()
    assert re.search(r'kvgate_engine_pulls_total\{model_name="deepseek-chat",result="failed"\} [1-9]', metrics)


def test_a_streamed_split_request_streams_from_the_decode_node(fleet) -> None:
    status, head, text = ask(fleet, "prefill", [t + 5 for t in PROMPT], stream=True)
    assert status == 200 and head["content-type"].startswith("text/event-stream")
    assert head["x-kvgate-pull"] == "ok" and head["x-kvgate-node"] == "d1"
    assert text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 3


def test_a_guarded_sidecar_calls_only_its_prefill_nodes(fleet) -> None:
    before = sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "untrusted_prefiller", sidecar="guarded")
    status, head, body = ask(fleet, "stranger", [t + 6 for t in PROMPT], sidecar="guarded")
    assert status == 200 and "x-kvgate-pull" not in head  # the stranger was never asked
    assert sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "untrusted_prefiller", sidecar="guarded") == before + 1
    status, head, body = ask(fleet, "prefill", [t + 7 for t in PROMPT], sidecar="guarded")
    assert status == 200 and head["x-kvgate-pull"] == "ok"


@pytest.mark.parametrize("prefiller", ["deep", "endless"])
def test_a_prefill_node_answering_garbage_leaves_the_request_served_whole(fleet, prefiller: str) -> None:
    """Before: a prefill node answering 200 with JSON nested 100,000 deep gave the client a 500
    (RecursionError in the sidecar); one answering 200 with an endless body was read into memory
    until the prefill timeout (measured with a 10 s timeout: the sidecar peaked at 2.3 GiB and the
    client waited 10.4 s). Now: the sidecar reads at most ``MAX_PREFILL_ANSWER_BYTES`` of the
    answer, the request is served whole on the decode node at once (same run: 39 MiB, 0.0 s) and
    ``prefill_error`` is counted."""
    pid = fleet["sidecar_pid"]
    before_rss = rss_bytes(int(pid))
    before = sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "prefill_error")
    status, head, body = ask(fleet, prefiller, [t + 8 for t in PROMPT])
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8 and "x-kvgate-pull" not in head  # computed here
    grown = rss_bytes(int(pid)) - before_rss
    assert grown < 32 << 20, f"the sidecar grew by {grown >> 20} MiB reading the prefill node's answer"
    assert sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "prefill_error") == before + 1


def test_a_request_body_nested_too_deep_for_the_sidecar_is_the_engines_to_answer(fleet) -> None:
    """msgspec (kvgate) and Python's ``json`` (the sidecar) stop at nearly the same depth (~990
    levels), so a body nested a little too deep for the sidecar can reach it with a prefill node
    named. Before: the sidecar itself answered 500 "Server got itself in trouble". Now: it passes
    the body on unchanged and the engine answers it (here the echo node: 200, every byte seen)."""
    deep = b'{"model": "%s", "prompt": [1, 2, 3], "extra": %s%s}' % (MODEL.encode(), b"[" * 5000, b"]" * 5000)
    headers = {"content-type": "application/json", "x-prefiller-host-port": fleet["prefill"]}
    status, _, raw = request(f"http://{fleet['echoing']}/v1/completions", method="POST", body=deep, headers=headers, timeout=30)
    assert status == 200, raw[:200]
    assert json.loads(raw)["body_len"] == len(deep)


@pytest.mark.parametrize("spelling", ["{node}/stolen#", "user@{node}", "{node}/stolen?"])
def test_a_header_naming_more_than_a_host_and_port_is_never_called(fleet, spelling: str) -> None:
    """A client reaching the sidecar's port past Envoy (which strips the header) sends
    ``x-prefiller-host-port: <host:port>/stolen#``. Before: with ``--any-prefiller`` (before, the
    default) the sidecar POSTed the client's request to ``http://<host:port>/stolen#/v1/completions``,
    a path of the client's choice on a host of its choice. Now only a plain ``host:port`` is ever
    called: the request is served whole here and ``untrusted_prefiller`` is counted."""
    plain = fleet["plain"]
    before = sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "untrusted_prefiller")
    headers = {"content-type": "application/json", "x-prefiller-host-port": spelling.format(node=plain)}
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    status, _, _ = request(f"http://{fleet['sidecar']}/v1/completions", method="POST", body=body, headers=headers, timeout=30)
    seen = [r["path"] for r in get_json(f"http://{plain}/_stats")[1]["seen"]]
    assert status == 200
    assert "/stolen" not in seen, f"the sidecar called {seen[-1]!r} on the named host"
    assert sidecar_metric(fleet, "kvgate_pd_sidecar_fallbacks", "untrusted_prefiller") == before + 1


def test_a_sidecar_is_told_which_prefill_nodes_it_may_call(tmp_path) -> None:
    """Before: without ``--prefiller`` the sidecar called whatever host the header named. Now it
    refuses to start until the fleet's prefill nodes are named (or ``--any-prefiller`` says so)."""
    import subprocess
    import sys

    for extra, says in (([], "--prefiller HOST:PORT"), (["--prefiller", "10.0.0.1:8000/x"], "must be HOST:PORT")):
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "pd-sidecar", "--port", str(free_port()),
                               "--engine", "http://127.0.0.1:1", *extra], capture_output=True, text=True, timeout=30)  # fmt: skip
        assert done.returncode != 0 and says in done.stderr, (done.returncode, done.stderr[-300:])


def test_a_split_request_asking_n_answers_prefills_one_and_decodes_n_here(fleet) -> None:
    def generated(address: str) -> float:
        _, _, raw = request(f"http://{address}/metrics")
        m = re.search(r"^vllm:generation_tokens_total\S* (\S+)$", raw.decode(), re.M)
        return float(m.group(1)) if m else 0.0

    prompt = [t + 31 for t in PROMPT]  # a prompt no other test sends
    before = generated(fleet["prefill"]), generated(fleet["decode"])
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "n": 3}).encode()
    headers = {"content-type": "application/json", "x-prefiller-host-port": fleet["prefill"]}
    status, head, raw = request(f"http://{fleet['sidecar']}/v1/completions", method="POST", body=body, headers=headers, timeout=30)
    answer = json.loads(raw)
    assert status == 200 and head["x-kvgate-pull"] == "ok", answer
    assert len(answer["choices"]) == 3 and answer["usage"]["completion_tokens"] == 24
    assert generated(fleet["prefill"]) - before[0] == 1  # the prefill node sampled one first token
    assert generated(fleet["decode"]) - before[1] == 24
