"""The admin API of a real ``kvgate serve`` process (embedded directory, two real upstreams):
health, readiness, metrics, and the token-guarded debug endpoints.

Decisions are made through kvgate's ext_authz port, called exactly as Envoy calls it; the request
path through Envoy itself is covered in test_observability_e2e.py and test_dashboard.py.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

import pytest

from tests.conftest import free_port
from tests.support.http import eventually, get_json, post_json, request
from tests.support.procs import start_echo, start_kvgate

MODEL = "admin-model"
TOKEN = "admin-test-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Gateway:
    def __init__(self, tmp, *, debug: bool) -> None:
        self.nodes = {"n1": free_port(), "n2": free_port()}
        self.echos = [start_echo(n, p, tmp) for n, p in self.nodes.items()]
        self.admin, self.authz = free_port(), free_port()
        config = {
            "listen_host": "127.0.0.1",
            "ext_proc_enabled": False,
            "ext_authz_port": self.authz,
            "admin_port": self.admin,
            "models": [MODEL],
            "fleet": [{"node_id": n, "address": f"127.0.0.1:{p}"} for n, p in self.nodes.items()]
            + [{"node_id": "n3", "address": f"127.0.0.1:{free_port()}"}],  # configured, never up
            "directory": {"heartbeat_ttl_s": 3.0},
        }
        if debug:
            config["admin"] = {"debug": True, "token": TOKEN, "decision_log_size": 16}
        self.proc = start_kvgate(config, tmp, name="kvgate-debug" if debug else "kvgate-plain")
        eventually(lambda: get_json(self.url("/readyz"))[1].get("live_nodes") == 2, timeout_s=20)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin}{path}"

    def decide(self, body: dict, request_id: str, path: str = "/v1/chat/completions") -> tuple[int, dict]:
        status, headers, _ = request(
            f"http://127.0.0.1:{self.authz}/kvgate/authz{path}", method="POST", body=json.dumps(body).encode(),
            headers={"content-type": "application/json", "x-request-id": request_id},
        )  # fmt: skip
        return status, headers

    def metric(self, name: str, labels: str = "") -> float:
        text = request(self.url("/metrics"))[2].decode()
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> None:
        for p in (self.proc, *self.echos):
            p.stop()


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = Gateway(tmp_path_factory.mktemp("admin"), debug=True)
    yield g
    g.stop()


def chat(topic: str) -> dict:
    doc = " ".join(f"Entry {i} of the {topic} ledger records {i * 17 % 89} crates." for i in range(120))
    return {"model": MODEL, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Totals?"}]}


def test_debug_endpoints_need_the_bearer_token(gw: Gateway) -> None:
    for path in ("/debug/decisions", "/debug/nodes", "/debug/timeline"):
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN}):
            status, resp_headers, _ = request(gw.url(path), headers=headers)
            assert status == 401, (path, headers)
            assert resp_headers["www-authenticate"].startswith("Bearer")
        assert request(gw.url(path), headers=AUTH)[0] == 200
    status, _, _ = request(gw.url("/debug/explain"), method="POST", body=json.dumps(chat("x")).encode())
    assert status == 401
    # the page itself holds no data: it loads without the token and asks for it
    status, headers, html = request(gw.url("/dashboard/"))
    assert status == 200 and headers["content-type"].startswith("text/html") and b"app.js" in html
    status, headers, js = request(gw.url("/dashboard/app.js"))
    assert status == 200 and headers["content-type"].startswith("text/javascript") and b"/debug/nodes" in js
    status, _, css = request(gw.url("/dashboard/app.css"))
    assert status == 200 and b".bar-fill" in css
    # no CDN, nothing external: every asset and every call is relative to the admin server
    assert re.findall(rb'(?:src|href)\s*=\s*"([^"]*)"', html) == [b"app.css", b"app.js"]
    assert re.findall(rb'getJson\("([^"]*)"', js) == [b"/debug/nodes", b"/debug/timeline", b"/debug/decisions?limit=30"]
    assert not re.search(rb"url\(|@import", css)


def test_readyz_reports_the_tokenizer_and_the_directory(gw: Gateway) -> None:
    status, body = get_json(gw.url("/readyz"))
    assert status == 200 and body["ready"] is True
    assert body["tokenizer"]["loaded"] is True and body["tokenizer"]["vocab"] > 100_000
    assert body["tokenizer"]["source"].endswith("tokenizer.json")
    assert body["tokenizer"]["chat_template"] == "default (deepseek_chat.jinja)"  # the template kvgate renders with
    assert body["directory"] == "ok" and body["live_nodes"] == 2
    assert get_json(gw.url("/healthz")) == (200, {"status": "ok"})


def test_decisions_list_the_last_requests_with_costs_and_reasons(gw: Gateway) -> None:
    ids = [f"adm-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    chosen = []
    for i, rid in enumerate(ids):
        status, headers = gw.decide(chat(f"topic-{i}"), rid)
        assert status == 200
        chosen.append(headers["x-gateway-destination-endpoint"])
    status, body = get_json_auth(gw.url("/debug/decisions?limit=3"))
    assert status == 200
    got = body["decisions"]
    assert [d["request_id"] for d in got] == ids[::-1]  # newest first
    for d, endpoint in zip(got[::-1], chosen):
        assert d["kind"] == "routed" and d["model"] == MODEL and d["prompt_tokens"] > 100
        assert d["chosen"]["address"] == endpoint
        assert {c["node_id"] for c in d["candidates"]} == {"n1", "n2"}  # every live node was weighed
        assert sum(c["chosen"] for c in d["candidates"]) == 1
        assert all(c["total_s"] >= c["prefill_s"] > 0 for c in d["candidates"])
        assert d["reason"] and d["chosen"]["node_id"] in d["reason"]
    assert len(get_json_auth(gw.url("/debug/decisions?limit=1"))[1]["decisions"]) == 1
    assert get_json_auth(gw.url("/debug/decisions?limit=x"))[0] == 400


def live_inflight(gw: Gateway) -> list[int]:
    return [n["inflight"] for n in get_json_auth(gw.url("/debug/nodes"))[1]["nodes"] if n["live"]]


def test_explain_says_what_would_happen_and_routes_nothing(gw: Gateway) -> None:
    body = chat("explained")
    time.sleep(1.2)  # past the fleet snapshot's max age, so the wait below reads the directory
    # earlier requests' ext_authz holds (their estimated service time, seconds each) have ended
    eventually(lambda: live_inflight(gw) == [0, 0], timeout_s=20)
    recorded = get_json_auth(gw.url("/debug/decisions"))[1]["recorded"]
    total = sum(gw.metric("kvgate_decisions_total", f'{{outcome="{o}",policy="kvgate"}}') for o in ("owner", "recompute"))
    status, got = post_json(gw.url("/debug/explain"), body, headers=AUTH)
    assert status == 200, got
    assert got["would_route"] is True and got["path"] == "/v1/chat/completions"
    assert got["chosen"]["node_id"] in ("n1", "n2") and len(got["candidates"]) == 2
    assert "reserve" not in got["timings_ms"]  # no reservation was taken
    assert got["headers"]["x-gateway-destination-endpoint"] == got["chosen"]["address"]
    assert get_json_auth(gw.url("/debug/decisions"))[1]["recorded"] == recorded
    after = sum(gw.metric("kvgate_decisions_total", f'{{outcome="{o}",policy="kvgate"}}') for o in ("owner", "recompute"))
    assert after == total
    time.sleep(1.2)  # past the fleet snapshot's max age: the next view is read from the directory
    assert live_inflight(gw) == [0, 0]  # a reservation would show until it expired (minutes)
    # a completion body is recognised without ?path=, and a bad body is explained, not counted
    status, got = post_json(gw.url("/debug/explain"), {"model": MODEL, "prompt": [1, 2, 3] * 40}, headers=AUTH)
    assert status == 200 and got["path"] == "/v1/completions" and got["prompt_tokens"] == 120
    rejected = gw.metric("kvgate_rejected_requests_total", '{status="404"}')
    status, got = post_json(gw.url("/debug/explain"), {"model": "nope", "prompt": "hi"}, headers=AUTH)
    assert status == 200 and got["would_route"] is False and got["status"] == 404 and "nope" in got["reason"]
    assert gw.metric("kvgate_rejected_requests_total", '{status="404"}') == rejected


def test_nodes_show_the_fleet_live_and_down(gw: Gateway) -> None:
    status, snap = get_json_auth(gw.url("/debug/nodes"))
    assert status == 200 and snap["error"] == ""
    nodes = {n["node_id"]: n for n in snap["nodes"]}
    assert set(nodes) == {"n1", "n2", "n3"}
    assert nodes["n1"]["live"] and nodes["n2"]["live"] and not nodes["n3"]["live"]
    assert nodes["n1"]["address"] == f"127.0.0.1:{gw.nodes['n1']}" and nodes["n1"]["model"] == MODEL


def test_metrics_cover_stages_tokenizer_directory_and_nodes(gw: Gateway) -> None:
    body = chat("metrics")
    for i in range(3):  # the same chat again: its segments come from the tokenizer cache
        assert gw.decide(body, f"met-{i}")[0] == 200
    text = request(gw.url("/metrics"))[2].decode()
    for stage in ("parse", "tokenize", "lookup", "score", "total", "reserve"):
        assert re.search(rf'^kvgate_decision_seconds_count{{stage="{stage}"}} [1-9]', text, re.M), stage
    assert re.search(r"^kvgate_directory_lookup_seconds_count [1-9]", text, re.M)
    assert 0 < gw.metric("kvgate_tokenizer_cache_hit_ratio") < 1
    assert gw.metric("kvgate_tokenizer_cache_hits_total") >= 2
    assert gw.metric("kvgate_live_nodes") == 2
    assert gw.metric("kvgate_node_live", '{node="n1"}') == 1 and gw.metric("kvgate_node_live", '{node="n3"}') == 0
    assert 'kvgate_node_inflight_requests{node="n2"}' in text
    assert "# TYPE kvgate_bridge_gaps_total counter" in text  # the bridges' registry is exposed too
    assert gw.metric("kvgate_prompt_tokens_total") > 0 and gw.metric("kvgate_expected_cached_tokens_total") >= 0


@pytest.mark.parametrize("method,path", [("GET", "/debug/nodes"), ("POST", "/admin/drain/n1"), ("DELETE", "/admin/drain/n1")])
def test_an_authorization_header_that_is_not_utf8_gets_401(gw: Gateway, method: str, path: str) -> None:
    """Before: ``Authorization: Bearer \\xff\\xfe`` made the guarded endpoints answer 500 (a
    UnicodeEncodeError in the token check, a traceback in kvgate's log per request). Now: 401."""
    with socket.create_connection(("127.0.0.1", gw.admin), timeout=5) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".encode() + b"authorization: Bearer \xff\xfe\r\n\r\n")
        answer = s.recv(200)
    assert answer.startswith(b"HTTP/1.1 401"), answer


def test_debug_endpoints_are_absent_unless_enabled(tmp_path) -> None:
    plain = Gateway(tmp_path, debug=False)
    try:
        for path in ("/debug/decisions", "/debug/nodes", "/dashboard/"):
            assert request(plain.url(path), headers=AUTH)[0] == 404, path
        assert request(plain.url("/debug/explain"), method="POST", body=b"{}", headers=AUTH)[0] == 404
        assert request(plain.url("/metrics"))[0] == 200 and get_json(plain.url("/readyz"))[0] == 200
    finally:
        plain.stop()


def get_json_auth(url: str) -> tuple[int, dict]:
    status, _, raw = request(url, headers=AUTH)
    return status, json.loads(raw)


def test_explain_does_not_answer_for_a_salted_prompt(gw: Gateway) -> None:
    """Issue 15, item 2: ``cache_salt`` keeps one tenant's cache out of another's reach, but
    /debug/explain told anyone with the admin token which node holds how many blocks of a prompt
    under any salt. What the caller gets now: 403 and no node, no block count."""
    body = {**chat("tenant secret"), "cache_salt": "tenant-a-salt"}
    status, got = post_json(gw.url("/debug/explain"), body, headers=AUTH)
    assert status == 403 and "cache_salt" in got["error"]
    assert "chosen" not in got and "candidates" not in got
