"""Config: YAML + KVGATE_* environment + overrides; every bad field is named at start."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, KvgateConfig, load_config, parse_size
from gateway.policy import POLICY_NAMES
from gateway.profile import PROFILE_DIR


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVGATE_* variable from the machine may leak into these tests."""
    for name in list(os.environ):
        if name.upper().startswith("KVGATE_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, data, name: str = "kvgate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def errors_of(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return str(info.value)


FLEET = [
    {"node_id": "n1", "address": "10.0.0.1:8000", "transfer_endpoint": "10.0.0.1:9100",
     "events_endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.1:5558"},
    {"node_id": "n2", "address": "10.0.0.2:8000"},
]  # fmt: skip


def test_defaults_are_valid_and_build_a_policy():
    cfg = load_config()
    assert (cfg.listen_host, cfg.ext_proc_port, cfg.admin_port, cfg.block_size) == ("127.0.0.1", 9002, 9003, 16)
    assert cfg.models == [] and cfg.fleet == []
    assert cfg.directory.url == "memory://" and cfg.directory.index_stride is None
    assert cfg.tokenizer.cache_bytes == 256 << 20 and cfg.limits.max_body_bytes == 8 << 20
    assert cfg.policy.name == "kvgate" and cfg.policy.hardware_profile().name == "llama-3.1-8b-h100"
    assert cfg.policy.build().name == "kvgate"
    assert (cfg.log.level, cfg.log.json_lines) == ("INFO", False)


def test_yaml_file_is_loaded(tmp_path):
    path = write(tmp_path, {
        "models": ["llama"],
        "block_size": 32,
        "directory": {"url": "redis://127.0.0.1:6379/0", "index_stride": 4},
        "fleet": FLEET,
        "policy": {"name": "kvgate_nopull", "profile": "qwen2.5-32b-h100", "link": "rdma", "fallbacks": 1},
        "limits": {"max_body_bytes": "16MiB", "max_prompt_tokens": 32768},
        "log": {"level": "debug", "json": True},
    })  # fmt: skip
    cfg = load_config(path)
    assert cfg.models == ["llama"] and cfg.block_size == 32
    assert cfg.directory.url == "redis://127.0.0.1:6379/0" and cfg.directory.index_stride == 4
    assert [n.node_id for n in cfg.fleet] == ["n1", "n2"]
    assert cfg.fleet[0].transfer_endpoint == "10.0.0.1:9100" and cfg.fleet[1].transfer_endpoint == ""
    assert cfg.policy.hardware_profile().name == "qwen2.5-32b-h100"
    assert cfg.limits.max_body_bytes == 16 << 20
    assert (cfg.log.level, cfg.log.json_lines) == ("DEBUG", True)
    assert cfg.policy.options() == {
        "link": "rdma", "min_pull_blocks": 8, "fallbacks": 1, "saturation_penalty_s": 1.0, "tie_tolerance_s": 0.001,
        "session_slack": 0.25, "session_slack_long": 1.0, "disaggregate": True, "decode_serves_whole": True, "split_ttft_slack": 0.1,
        "prefill_serves_whole_tokens": 64,
    }  # fmt: skip  (kvgate_nopull takes no allow_pull)
    assert cfg.policy.build().name == "kvgate_nopull"


def test_environment_overrides_yaml_key_by_key(tmp_path, monkeypatch):
    path = write(tmp_path, {"policy": {"name": "kvgate", "link": "rdma"}, "directory": {"key_prefix": "file"}})
    monkeypatch.setenv("KVGATE_POLICY__NAME", "round_robin")
    monkeypatch.setenv("KVGATE_DIRECTORY__LOOKUP_TIMEOUT_MS", "40")
    monkeypatch.setenv("KVGATE_ADMIN_PORT", "9100")
    monkeypatch.setenv("KVGATE_FLEET", json.dumps(FLEET[1:]))
    cfg = load_config(path)
    assert cfg.policy.name == "round_robin" and cfg.policy.link == "rdma"  # the file's link survives
    assert cfg.directory.lookup_timeout_ms == 40 and cfg.directory.key_prefix == "file"
    assert cfg.admin_port == 9100
    assert [n.node_id for n in cfg.fleet] == ["n2"]


def test_path_from_env_and_overrides_rank_highest(tmp_path, monkeypatch):
    path = write(tmp_path, {"policy": {"name": "prefix_only"}, "ext_proc_port": 7000})
    monkeypatch.setenv("KVGATE_CONFIG", str(path))
    monkeypatch.setenv("KVGATE_POLICY__NAME", "least_request")
    cfg = load_config(policy={"name": "round_robin"})
    assert cfg.ext_proc_port == 7000 and cfg.policy.name == "round_robin"


def test_unknown_fields_are_rejected_and_named(tmp_path, monkeypatch):
    path = write(tmp_path, {"bogus": 1, "policy": {"linkk": "tcp"}, "fleet": [{**FLEET[1], "port": 1}]})
    monkeypatch.setenv("KVGATE_DIRECTORY__URLL", "memory://")
    msg = errors_of(path=path)
    for where in ("bogus: unknown field", "policy.linkk: unknown field", "fleet[0].port: unknown field",
                  "directory.urll: unknown field"):  # fmt: skip
        assert where in msg
    assert msg.startswith("4 invalid settings")


@pytest.mark.parametrize(
    "address, why",
    [
        ("localhost:8000", "must be an IP address"),
        ("10.0.0.1", "is not host:port"),
        ("10.0.0.1:0", "port must be 1-65535"),
        ("10.0.0.1:65536", "port must be 1-65535"),
        ("10.0.0.1:http", "port must be 1-65535"),
        ("::1:8000", "brackets"),
        ("", "is not host:port"),
    ],
)
def test_bad_node_address_is_named(address, why):
    msg = errors_of(fleet=[{"node_id": "n1", "address": address}])
    assert "fleet[0].address:" in msg and why in msg


def test_good_addresses_and_endpoints_pass():
    cfg = load_config(fleet=[
        {"node_id": "a", "address": "[::1]:8000", "transfer_endpoint": "node-a.fleet.svc:9100",
         "events_endpoint": "ipc:///tmp/a.sock", "replay_endpoint": "tcp://node-a:5558", "model": "m"},
    ])  # fmt: skip
    assert cfg.fleet[0].address == "[::1]:8000"
    assert cfg.node_model(cfg.fleet[0]) == "m"


def test_a_bridged_node_needs_a_model_to_key_its_events():
    node = {"node_id": "a", "address": "10.0.0.1:8000", "events_endpoint": "tcp://10.0.0.1:5557"}
    assert "events_endpoint but no model" in errors_of(fleet=[node])
    cfg = load_config(fleet=[node], models=["served-model"])
    assert cfg.node_model(cfg.fleet[0]) == "served-model"


def test_bad_endpoints_are_named():
    msg = errors_of(fleet=[{
        "node_id": "n1", "address": "10.0.0.1:8000", "transfer_endpoint": "bad host:9",
        "events_endpoint": "tcp://*:5557", "replay_endpoint": "http://10.0.0.1:5558",
    }])  # fmt: skip
    assert "fleet[0].transfer_endpoint: 'bad host:9'" in msg
    assert "fleet[0].events_endpoint: 'tcp://*:5557': '*' is a bind address" in msg
    assert "fleet[0].replay_endpoint:" in msg and "scheme must be tcp, ipc or inproc" in msg


def test_duplicate_node_ids_and_addresses_are_rejected():
    msg = errors_of(fleet=[FLEET[0], {**FLEET[1], "node_id": "n1"}])
    assert "fleet: duplicate node_id 'n1'" in msg
    msg = errors_of(fleet=[FLEET[0], {**FLEET[1], "address": FLEET[0]["address"]}])
    assert "fleet: duplicate address '10.0.0.1:8000'" in msg


def test_unknown_policy_and_profile_are_named():
    msg = errors_of(policy={"name": "fastest", "profile": "gpt-5-on-a-toaster"})
    assert "policy.name: unknown policy 'fastest'; choose one of " + ", ".join(POLICY_NAMES) in msg
    assert "policy.profile: no hardware profile 'gpt-5-on-a-toaster'" in msg and "llama-3.1-8b-h100" in msg


def test_profile_by_path_and_its_links_are_checked(tmp_path):
    data = yaml.safe_load((PROFILE_DIR / "llama-3.1-8b-h100.yaml").read_text())
    data.update(name="tcp-only", links_gbps={"tcp": 10})
    path = write(tmp_path, data, "tcp-only.yaml")
    assert load_config(policy={"profile": str(path)}).policy.hardware_profile().name == "tcp-only"
    msg = errors_of(policy={"profile": str(path), "link": "rdma"})
    assert "policy: link 'rdma' is not priced by profile" in msg

    broken = write(tmp_path, {**data, "kv_bytes_per_token": -1}, "broken.yaml")
    assert "policy.profile: hardware profile" in errors_of(policy={"profile": str(broken)})


def test_value_ranges_are_named():
    msg = errors_of(
        ext_proc_port=7000, admin_port=7000, block_size=0,
        directory={"heartbeat_ttl_s": 0, "url": "localhost:6379"},
        policy={"fallbacks": -1, "min_pull_blocks": 0, "link": "carrier-pigeon"},
        log={"level": "chatty"},
    )  # fmt: skip
    for where in ("block_size:", "directory.heartbeat_ttl_s:", "directory.url: 'localhost:6379' is not a URL",
                  "policy.fallbacks:", "policy.min_pull_blocks:", "policy.link:", "log.level:"):  # fmt: skip
        assert where in msg
    assert "admin_port and ext_proc_port are both 7000" in errors_of(ext_proc_port=7000, admin_port=7000)
    assert "ext_proc_port and ext_authz_port are both 7001" in errors_of(ext_proc_port=7001, ext_authz_port=7001)
    assert "no Envoy integration enabled" in errors_of(ext_proc_enabled=False)
    assert load_config(ext_proc_enabled=False, ext_authz_port=7002).ext_authz_port == 7002


def test_chat_template_must_exist_unless_inline(tmp_path):
    assert "tokenizer.chat_template: file" in errors_of(tokenizer={"chat_template": str(tmp_path / "none.jinja")})
    template = write(tmp_path, "{{ messages }}", "t.jinja")
    assert load_config(tokenizer={"chat_template": str(template)}).tokenizer.chat_template == str(template)
    assert load_config(tokenizer={"chat_template": "{% for m in messages %}{{ m }}{% endfor %}"})


def test_bad_files_and_env_json_fail_with_a_message(tmp_path, monkeypatch):
    assert "config file" in errors_of(path=tmp_path / "missing.yaml")
    assert "not valid YAML" in errors_of(path=write(tmp_path, "a: [1, 2", "bad.yaml"))
    assert "top level must be a mapping" in errors_of(path=write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    assert load_config(write(tmp_path, "", "empty.yaml")) == load_config()
    monkeypatch.setenv("KVGATE_MODELS", "not-json")
    assert '"models"' in errors_of()


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "text, value", [("8MiB", 8 << 20), ("256 MB", 256_000_000), ("1gi", 1 << 30), ("42", 42), (7, 7)]
)
def test_sizes(text, value):
    assert parse_size(text) == value


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.admin_port = 1  # type: ignore[misc]
    assert isinstance(cfg, KvgateConfig)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_builds_from_config(name):
    cfg = load_config(policy={"name": name})
    assert cfg.policy.build().name == name


def test_lora_adapters_map_to_a_listed_base_model():
    from gateway.serve_cmd import limits_from_config

    cfg = load_config(None, models=["llama-8b"], lora_adapters={"support-bot": "llama-8b"})
    limits = limits_from_config(cfg)
    assert limits.lora_adapters == {"support-bot": "llama-8b"}
    assert limits.models == {"llama-8b", "support-bot"}  # an adapter's name is a model clients may ask for
    for bad in ({"support-bot": "other-model"}, {"llama-8b": "llama-8b"}):
        with pytest.raises(ConfigError, match="lora_adapters"):
            load_config(None, models=["llama-8b"], lora_adapters=bad)


def test_an_events_collector_follows_the_nodes_without_an_events_endpoint():
    from gateway.serve_cmd import embedded_bridges
    from workers.bridge import COLLECTOR

    node = {"node_id": "a", "address": "10.0.0.1:8000", "replay_endpoint": "tcp://10.0.0.1:5558"}
    assert "no model" in errors_of(fleet=[node], events_collector="tcp://*:5557")
    cfg = load_config(fleet=[node, {"node_id": "b", "address": "10.0.0.2:8000", "events_topic": "kv@b@m"}],
                      models=["m"], events_collector="tcp://*:5557")  # fmt: skip
    assert cfg.events_collector == "tcp://0.0.0.0:5557"  # ZMQ's wildcard bind, spelled as an address
    (bridge,) = embedded_bridges(cfg, directory=None)
    assert bridge.node_ids == ["a", "b"]
    assert {s.node_id: (s.events, s.replay, s.topic) for s in map(bridge.spec, bridge.node_ids)} == {
        "a": (COLLECTOR, "tcp://10.0.0.1:5558", ""), "b": (COLLECTOR, None, "kv@b@m"),
    }  # fmt: skip


def test_serving_settles_the_start_up_heap_out_of_the_collectors_reach():
    """What ``kvgate serve`` allocated at start-up is frozen: a full collection (the event loop
    stopped meanwhile) no longer walks it. Run in a child: freezing is for the whole process."""
    import subprocess
    import sys

    code = (
        "import gc; from gateway.serve_cmd import serve, settle_heap, tokenizer_from_config; from gateway.config import load_config;"
        "tok = tokenizer_from_config(load_config()); before = len(gc.get_objects(2)); frozen = settle_heap();"
        "after = len(gc.get_objects(2)); print(before, frozen, after); assert before > 20000 and frozen >= before and after < before // 100"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kvgate_serve_freezes_its_start_up_heap_once_listening(tmp_path: Path):
    """The CLI's ``kvgate serve`` settles its heap after start-up (and says how much)."""
    from tests.conftest import free_port
    from tests.support.procs import python_module, wait_for_port

    admin = free_port()
    config = write(tmp_path, {"listen_host": "127.0.0.1", "ext_proc_port": free_port(), "admin_port": admin,
                              "directory": {"url": "memory://"}, "log": {"level": "INFO"}})
    proc = python_module("kvgate", "gateway.cli", ["serve", "--config", str(config)], tmp_path)
    try:
        wait_for_port(admin, timeout_s=60, proc=proc.popen)
        deadline = time.monotonic() + 30
        while "start-up heap frozen" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(li for li in proc.output().splitlines() if "start-up heap frozen" in li)
        assert int(line.split("frozen: ")[1].split()[0]) > 20000, line
    finally:
        proc.stop()


@pytest.mark.parametrize(("setting", "expected"), [("0", 0), ("2MiB", 2 << 20)])
def test_the_configured_body_memo_bound_is_the_serving_cores(monkeypatch: pytest.MonkeyPatch, setting: str, expected: int):
    """``tokenizer.body_memo_bytes`` and ``token_memo_bytes`` reach the routing core ``kvgate serve``
    builds (0: every body is decoded whole)."""
    import asyncio

    from gateway import serve_cmd
    from tests.conftest import free_port

    built: list = []

    class Recorded(serve_cmd.RoutingCore):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(serve_cmd, "RoutingCore", Recorded)
    cfg = load_config(listen_host="127.0.0.1", ext_proc_port=free_port(), admin_port=free_port(),
                      directory={"url": "memory://"}, tokenizer={"body_memo_bytes": setting, "token_memo_bytes": setting})  # fmt: skip

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(serve_cmd.serve(cfg, stop=stop))
        for _ in range(600):
            if built or task.done():
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 60)

    asyncio.run(run())
    assert built and built[0].bodies.max_bytes == expected and built[0].token_bodies.max_bytes == expected


def test_a_nodes_events_sources_are_host_addresses():
    node = {"node_id": "a", "address": "10.0.0.1:8000"}
    assert load_config(fleet=[{**node, "events_sources": ["10.0.1.1", "engine-a.eth1", "[fd00::1]"]}]).fleet[0].events_sources
    for bad in ("10.0.1.1:5557", "tcp://10.0.1.1", "not a host"):
        assert "events_sources" in errors_of(fleet=[{**node, "events_sources": [bad]}])
    from workers.bridge import parse_engine_spec  # kvgate bridge --engine ...

    spec = parse_engine_spec("node_id=a,address=10.0.0.1:8000,events=collector,sources=10.0.1.5;10.0.2.5")
    assert spec.sources == ("10.0.1.5", "10.0.2.5")
