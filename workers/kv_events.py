"""KV-cache events in vLLM's wire format: the event types, a tolerant decoder, an encoder and the
ZMQ publisher engines (our simulated one included) use to announce what they cache.

Wire format (vLLM ``vllm/distributed/kv_events.py``; SGLang ``srt/disaggregation/kv_events.py``):

* ZMQ PUB, three frames per batch: ``topic`` (UTF-8, may be empty), ``seq`` (8-byte big-endian,
  counting from 0 per publisher), ``payload`` (msgpack).
* ``payload`` is an ``EventBatch``: the array ``[ts, events, data_parallel_rank]`` (the rank is
  omitted when unset; older SGLang sends ``[ts, events]``). We also accept a map
  ``{"ts", "events", "data_parallel_rank"}``.
* Each event is a tagged union: new vLLM (after PR #42892) sends a **map** with the tag under
  ``"type"``; older vLLM and SGLang send a **positional array** ``[tag, field1, field2, ...]``
  whose trailing fields may be omitted (msgspec ``omit_defaults``). Field order::

      BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                       lora_name, extra_keys, group_idx
      BlockRemoved     block_hashes, medium, group_idx
      AllBlocksCleared (no fields)

* Block hashes are ints by default (vLLM: the low 64 bits of the digest, read big-endian; some
  producers send them as signed int64) or raw digest bytes. Both are normalised to an unsigned
  64-bit int here, bytes by taking their last 8 bytes big-endian, exactly as vLLM does.
* Replay: a ROUTER socket. A client (DEALER) sends ``[b"", start_seq (8 bytes)]`` and gets, per
  buffered batch with ``seq >= start_seq``, ``[b"", topic, seq, payload]``, then the end marker
  ``[b"", b"", -1 (8 bytes, signed), b""]`` (current vLLM, ``ZmqEventPublisher._service_replay``).
  Older vLLM and SGLang answer without the topic: ``[b"", seq, payload]`` and
  ``[b"", -1, b""]``. A reader takes the last two frames as ``seq, payload`` and accepts both.

Decoding is tolerant of what producers legitimately vary (form, omitted trailing defaults,
unknown fields, extra trailing array elements, int or bytes hashes) and strict about everything
else: KV-event input is untrusted, so a payload that is not a batch raises ``KVEventDecodeError``
and nothing else, and a malformed or unknown event inside a good batch is dropped on its own and
reported in ``DecodedBatch.rejected`` (its neighbours are kept).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Generator, Sequence
from typing import Annotated, Any, Literal, TypeAlias

import msgspec
import zmq

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_UINT32_MAX = 0xFFFFFFFF
TokenId: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=_UINT32_MAX)]
"""A token ID as the typed decoder checks it (in C): an integer in uint32's range, never a bool."""
END_SEQ = -1
"""Sequence number of the replay end marker."""


class KVCacheEvent(msgspec.Struct, frozen=True, gc=False, omit_defaults=True, tag=True):
    """Base of the three event types (msgspec tagged union; tag = class name, field ``type``)."""


class BlockStored(KVCacheEvent, frozen=True, gc=False, omit_defaults=True, tag=True):
    """Full blocks entered the cache. ``token_ids`` are the tokens of exactly these blocks
    (``len(block_hashes) * block_size`` of them); ``parent_block_hash`` is the engine hash of the
    block just before the first one (None when the first one starts the sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent, frozen=True, gc=False, omit_defaults=True, tag=True):
    """Blocks left the cache (of ``medium``; None means the engine's primary tier, the GPU)."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True, gc=False, omit_defaults=True, tag=True):
    """The whole cache was dropped (prefix-cache reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
WireFormat: TypeAlias = Literal["map", "array"]
ReplayForm: TypeAlias = Literal["topic", "plain"]
"""How a replay answer is framed: ``topic`` = current vLLM (4 frames at the client), ``plain`` =
older vLLM and SGLang (3 frames)."""


class DecodedBatch(msgspec.Struct, frozen=True, gc=False):
    """One decoded ``EventBatch``; ``rejected`` says why each dropped event was dropped."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    rejected: tuple[str, ...] = ()


class KVEventDecodeError(ValueError):
    """A payload or frame set that is not a KV event batch. The only error the decoder raises."""


# ---------------------------------------------------------------------------------------------
# decoding

_BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_BLOCK_STORED_REQUIRED = ("block_hashes", "token_ids", "block_size")  # parent defaults to None
_BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_FIELDS_BY_TAG: dict[str, tuple[str, ...]] = {
    "BlockStored": _BLOCK_STORED_FIELDS,
    "BlockRemoved": _BLOCK_REMOVED_FIELDS,
    "AllBlocksCleared": (),
}

_raw_decoder = msgspec.msgpack.Decoder()


class _BadEvent(Exception):
    """One event is malformed; its batch survives without it."""


def normalize_block_hash(value: object) -> int:
    """An engine block hash as an unsigned 64-bit int (ints masked, bytes: last 8 big-endian)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < -(1 << 63) or value > _MASK64:
            raise _BadEvent(f"block hash {value} does not fit in 64 bits")
        return value & _MASK64
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise _BadEvent("empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise _BadEvent(f"block hash of type {type(value).__name__}")


def _hash_list(value: object, field: str) -> list[int]:
    if not isinstance(value, list):
        raise _BadEvent(f"{field} must be a list, got {type(value).__name__}")
    return [normalize_block_hash(v) for v in value]


_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=_UINT32_MAX)]]


def _token_list(value: object) -> list[int]:
    if not isinstance(value, list):
        raise _BadEvent(f"token_ids must be a list, got {type(value).__name__}")
    try:  # checked in msgspec's C code: a Python loop took ~30 ms a MiB of a stranger's tokens
        msgspec.convert(value, _TOKEN_IDS, strict=True)
    except msgspec.ValidationError as exc:
        at = re.search(r"\$\[(\d+)\]", str(exc))
        t = value[int(at.group(1))] if at else exc
        raise _BadEvent(f"token id {t!r} is not an integer in [0, 2**32)") from None
    return value


def _opt_int(value: object, field: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise _BadEvent(f"{field} must be an integer or nil, got {type(value).__name__}")


def _opt_str(value: object, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _BadEvent(f"{field} must be a string or nil, got {type(value).__name__}")


def _fields_of(raw: object) -> tuple[str, dict[str, Any]]:
    """Tag and named fields of one raw event, whichever form it came in."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise _BadEvent("map event without a string 'type'")
        names = _FIELDS_BY_TAG.get(tag)
        if names is None:
            raise _BadEvent(f"unknown event type {tag[:64]!r}")
        return tag, {k: raw[k] for k in names if k in raw}
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise _BadEvent("array event without a string tag")
        tag = raw[0]
        names = _FIELDS_BY_TAG.get(tag)
        if names is None:
            raise _BadEvent(f"unknown event type {tag[:64]!r}")
        return tag, dict(zip(names, raw[1:]))  # extra trailing elements are newer fields: ignored
    raise _BadEvent(f"event of type {type(raw).__name__}")


def _event_from_raw(raw: object) -> KVEvent:
    tag, f = _fields_of(raw)
    if tag == "BlockStored":
        missing = [n for n in _BLOCK_STORED_REQUIRED if n not in f]
        if missing:
            raise _BadEvent(f"BlockStored without {', '.join(missing)}")
        parent = f.get("parent_block_hash")
        block_size = f["block_size"]
        token_ids = _token_list(f["token_ids"])
        # vLLM's CPU-offload connector announces blocks it lacks metadata for with no tokens and
        # block_size 0 (placeholders); with tokens, the size must be real
        if type(block_size) is not int or block_size < 0 or (block_size == 0 and token_ids):
            raise _BadEvent(f"block_size must be a positive integer, got {block_size!r}")
        extra = f.get("extra_keys")
        return BlockStored(
            block_hashes=_hash_list(f["block_hashes"], "block_hashes"),
            parent_block_hash=None if parent is None else normalize_block_hash(parent),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=_opt_int(f.get("lora_id"), "lora_id"),
            medium=_opt_str(f.get("medium"), "medium"),
            lora_name=_opt_str(f.get("lora_name"), "lora_name"),
            extra_keys=extra if isinstance(extra, list) else None,
            group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise _BadEvent("BlockRemoved without block_hashes")
        return BlockRemoved(
            block_hashes=_hash_list(f["block_hashes"], "block_hashes"),
            medium=_opt_str(f.get("medium"), "medium"),
            group_idx=_opt_int(f.get("group_idx"), "group_idx"),
        )
    return AllBlocksCleared()


class _StoredArray(BlockStored, frozen=True, gc=False, array_like=True, tag="BlockStored"):
    """``BlockStored`` in the positional form (older vLLM, SGLang), for the typed decoder."""


class _RemovedArray(BlockRemoved, frozen=True, gc=False, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedArray(AllBlocksCleared, frozen=True, gc=False, array_like=True, tag="AllBlocksCleared"):
    pass


_map_events_decoder = msgspec.msgpack.Decoder(list[BlockStored | BlockRemoved | AllBlocksCleared])
_array_events_decoder = msgspec.msgpack.Decoder(list[_StoredArray | _RemovedArray | _ClearedArray])
_outer_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw] | dict[str, msgspec.Raw])
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])

EVENT_CHUNK_BYTES = 64 << 10
"""Events decoded in one call (~0.5 ms of msgspec's work) before ``decode_batch_steps`` pauses."""
MAX_EVENT_BYTES = 2 << 20
"""An event larger than this is rejected undecoded: decoding it would hold the loop in one call
(~17 ms typed, more checked field by field). A vLLM step stores at most its token budget of a
prompt (``max_num_batched_tokens``, ~5 bytes a token): 2 MiB is ~400,000 tokens."""


def _from_array(ev: _StoredArray | _RemovedArray | _ClearedArray) -> KVEvent:
    """The event as the map form's type (the positional one is a subclass, and not equal to it)."""
    return _BASE_TYPE[type(ev)](*msgspec.structs.astuple(ev))


_BASE_TYPE: dict[type, type] = {_StoredArray: BlockStored, _RemovedArray: BlockRemoved, _ClearedArray: AllBlocksCleared}


class _MapBatch(msgspec.Struct, frozen=True, gc=False, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, frozen=True, gc=False, array_like=True):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


_map_batch_decoder = msgspec.msgpack.Decoder(_MapBatch)
_array_batch_decoder = msgspec.msgpack.Decoder(_ArrayBatch)
WHOLE_BATCH_BYTES = 256 << 10
"""A batch up to this size (vLLM's per-step batches are kilobytes) is decoded in one call, ~2 ms at most."""


def _decode_typed(payload: bytes | bytearray | memoryview) -> DecodedBatch | None:
    """A whole batch of the common kind (see ``_typed_events``) in one call; None: anything else."""
    try:
        batch: _MapBatch | _ArrayBatch = _map_batch_decoder.decode(payload)
        events: list[KVEvent] = batch.events
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            batch = _array_batch_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        events = [_from_array(ev) for ev in batch.events]
    normal = _normalized(events)
    return None if normal is None else DecodedBatch(ts=batch.ts, events=normal, data_parallel_rank=batch.data_parallel_rank)


def _typed_events(payload: bytes | bytearray | memoryview) -> list[KVEvent] | None:
    """An array of events, the common case (every event well formed, all in one form, int hashes)
    checked and built in msgspec's C code: a stored run's tokens are validated without a Python
    loop per token. None: anything else, which the tolerant decoder then reads (same result
    where both read)."""
    try:
        events: list[KVEvent] = _map_events_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            arrays = _array_events_decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return None
        events = [_from_array(ev) for ev in arrays]
    return _normalized(events)


def _normalized(events: list[KVEvent]) -> list[KVEvent] | None:
    """Typed events with hashes as unsigned 64-bit ints; None if one needs the tolerant decoder."""
    for i, ev in enumerate(events):
        if isinstance(ev, BlockStored):
            if ev.block_size < 0 or (ev.block_size == 0 and ev.token_ids):
                return None  # rejected one by one, with its reason, by the tolerant decoder
            parent = ev.parent_block_hash
            if (ev.block_hashes and min(ev.block_hashes) < 0) or (parent is not None and parent < 0):
                events[i] = msgspec.structs.replace(
                    ev,
                    block_hashes=[h & _MASK64 for h in ev.block_hashes],
                    parent_block_hash=None if parent is None else parent & _MASK64,
                )
        elif isinstance(ev, BlockRemoved) and ev.block_hashes and min(ev.block_hashes) < 0:
            events[i] = msgspec.structs.replace(ev, block_hashes=[h & _MASK64 for h in ev.block_hashes])
    return events


def _as_array(raws: Sequence[msgspec.Raw]) -> bytes:
    """Encoded events joined into one msgpack array (an array32 header, then the events)."""
    return b"\xdd" + len(raws).to_bytes(4, "big") + b"".join(raws)


def _events_of(raws: Sequence[msgspec.Raw], first: int, rejected: list[str]) -> list[KVEvent]:
    """``raws`` (events ``first``...) decoded together when they can be, else one by one; the
    events left out are explained in ``rejected``."""
    if len(raws) > 1 or len(raws[0]) <= MAX_EVENT_BYTES:
        typed = _typed_events(_as_array(raws))
        if typed is not None:
            return typed
    events: list[KVEvent] = []
    for i, raw in enumerate(raws, first):
        if len(raw) > MAX_EVENT_BYTES:
            rejected.append(f"event {i}: {len(raw)} bytes, over the {MAX_EVENT_BYTES} an event may take")
            continue
        one = _typed_events(_as_array([raw])) if len(raws) > 1 else None
        if one is not None:
            events.extend(one)
            continue
        try:
            events.append(_event_from_raw(_raw_decoder.decode(raw)))
        except _BadEvent as exc:
            rejected.append(f"event {i}: {exc}")
    return events


def decode_batch_steps(payload: bytes | bytearray | memoryview) -> Generator[None, None, DecodedBatch]:
    """``decode_batch``, pausing (a bare ``yield``) after each ``EVENT_CHUNK_BYTES`` of events:
    a 16 MiB batch of 360,000 small events held an event loop ~0.28 s in one decoding call (~2 s
    when one bad event sent the whole batch to the field-by-field decoder); here the longest
    call is the events' outer array (~35 ms for those 360,000) or one event of at most
    ``MAX_EVENT_BYTES``. A batch of at most ``WHOLE_BATCH_BYTES`` is decoded in one call."""
    if len(payload) <= WHOLE_BATCH_BYTES:
        whole = _decode_typed(payload)
        return whole if whole is not None else _decode_tolerant(payload)
    try:
        outer = _outer_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_tolerant(payload)  # not a batch: its error says why
    if isinstance(outer, list):
        if len(outer) < 2:
            return _decode_tolerant(payload)
        raw_ts, raw_events, raw_rank = outer[0], outer[1], outer[2] if len(outer) > 2 else None
    else:
        if "ts" not in outer or "events" not in outer:
            return _decode_tolerant(payload)
        raw_ts, raw_events, raw_rank = outer["ts"], outer["events"], outer.get("data_parallel_rank")
    ts = _raw_decoder.decode(raw_ts)
    rank = None if raw_rank is None else _raw_decoder.decode(raw_rank)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or (rank is not None and (isinstance(rank, bool) or not isinstance(rank, int))):
        return _decode_tolerant(payload)  # its error says why
    try:
        raws = _raw_list_decoder.decode(raw_events)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_tolerant(payload)
    events: list[KVEvent] = []
    rejected: list[str] = []
    ends = list(itertools.accumulate(map(len, raws)))  # bytes up to the end of each event
    start = 0
    while start < len(raws):
        before = ends[start - 1] if start else 0
        end = max(start + 1, bisect.bisect_right(ends, before + EVENT_CHUNK_BYTES, start))
        events.extend(_events_of(raws[start:end], start, rejected))
        start = end
        if start < len(raws):
            yield
    return DecodedBatch(ts=float(ts), events=events, data_parallel_rank=rank, rejected=tuple(rejected))


def decode_batch(payload: bytes | bytearray | memoryview) -> DecodedBatch:
    """Decode one msgpack ``EventBatch`` (either event form, mixed freely).

    Raises ``KVEventDecodeError`` when the payload is not a batch at all; a bad event inside a
    good batch is left out and explained in ``rejected`` instead.
    """
    if len(payload) <= WHOLE_BATCH_BYTES:
        whole = _decode_typed(payload)
        return whole if whole is not None else _decode_tolerant(payload)
    steps = decode_batch_steps(payload)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _decode_tolerant(payload: bytes | bytearray | memoryview) -> DecodedBatch:
    """``decode_batch`` for any input: every field checked in Python, bad events left out."""
    try:
        raw = _raw_decoder.decode(payload)
    except Exception as exc:  # msgspec.DecodeError, and anything odd input might provoke
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise KVEventDecodeError(f"batch array has {len(raw)} elements, expected [ts, events, dp_rank?]")
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise KVEventDecodeError("batch map without 'ts' and 'events'")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"batch is a msgpack {type(raw).__name__}, expected an array")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError(f"data_parallel_rank must be an integer or nil, got {type(rank).__name__}")
    decoded: list[KVEvent] = []
    rejected: list[str] = []
    for i, ev in enumerate(events):
        try:
            decoded.append(_event_from_raw(ev))
        except _BadEvent as exc:
            rejected.append(f"event {i}: {exc}")
    return DecodedBatch(ts=float(ts), events=decoded, data_parallel_rank=rank, rejected=tuple(rejected))


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame (signed, so the replay end marker reads as -1)."""
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------------------------
# encoding


def _event_to_wire(ev: KVEvent, wire_format: WireFormat) -> dict[str, Any] | list[Any]:
    """vLLM's layout: fields without a default are always written, defaulted ones only when set."""
    if isinstance(ev, BlockStored):
        fields: list[tuple[str, Any]] = [
            ("block_hashes", ev.block_hashes),
            ("parent_block_hash", ev.parent_block_hash),
            ("token_ids", ev.token_ids),
            ("block_size", ev.block_size),
            ("lora_id", ev.lora_id),
            ("medium", ev.medium),
            ("lora_name", ev.lora_name),
        ]
        optional = [("extra_keys", ev.extra_keys), ("group_idx", ev.group_idx)]
        tag = "BlockStored"
    elif isinstance(ev, BlockRemoved):
        fields = [("block_hashes", ev.block_hashes), ("medium", ev.medium)]
        optional = [("group_idx", ev.group_idx)]
        tag = "BlockRemoved"
    elif isinstance(ev, AllBlocksCleared):
        fields, optional, tag = [], [], "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {type(ev).__name__}")
    if wire_format == "map":
        out: dict[str, Any] = {"type": tag}
        out.update(fields)
        out.update((k, v) for k, v in optional if v is not None)
        return out
    # array form: trailing defaulted fields are omitted, inner ones kept as nil placeholders
    while optional and optional[-1][1] is None:
        optional.pop()
    return [tag, *(v for _, v in fields), *(v for _, v in optional)]


_encoder = msgspec.msgpack.Encoder()


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = 0,
    wire_format: WireFormat = "map",
) -> bytes:
    """One ``EventBatch`` payload: ``[ts, events, dp_rank]`` with events in ``wire_format``."""
    if wire_format not in ("map", "array"):
        raise ValueError(f"wire_format must be 'map' or 'array', not {wire_format!r}")
    body: list[Any] = [time.time() if ts is None else ts, [_event_to_wire(e, wire_format) for e in events]]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return _encoder.encode(body)


# ---------------------------------------------------------------------------------------------
# publishing


class KVEventPublisher:
    """ZMQ PUB of KV-event batches with sequence numbers and a replay ROUTER, as vLLM publishes.

    The publisher binds both endpoints (engines are the stable side; bridges connect), or, with
    ``connect=True``, connects its PUB to a collector that binds (what vLLM does for any endpoint
    that is not a wildcard, ipc or inproc); the replay ROUTER always binds, as in vLLM.

    Thread-safety: ``publish`` may be called from any thread; one lock orders sequence numbers,
    the PUB send and the replay buffer, and nothing in it blocks (PUB never blocks: at its
    high-water mark ZMQ drops, which subscribers see as a gap and repair through replay). It is
    meant to be called straight from the engine's asyncio loop. The replay socket is owned by a
    background thread that only reads the buffer under the same lock (copying the slice it needs),
    so a slow replay client never stalls publishing.
    """

    _REPLAY_POLL_MS = 100  # how often the replay thread checks for close()

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        wire_format: WireFormat = "map",
        replay_form: ReplayForm = "topic",
        connect: bool = False,
    ) -> None:
        if wire_format not in ("map", "array"):
            raise ValueError(f"wire_format must be 'map' or 'array', not {wire_format!r}")
        if replay_form not in ("topic", "plain"):
            raise ValueError(f"replay_form must be 'topic' or 'plain', not {replay_form!r}")
        self._replay_form: ReplayForm = replay_form
        if buffer_batches <= 0:
            raise ValueError("buffer_batches must be positive")
        self._wire_format: WireFormat = wire_format
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._drop_next = 0
        self._closed = False
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        try:
            if connect:  # vLLM given tcp://host:P: the PUB connects to a collector there
                self._pub.connect(endpoint)
            else:
                self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # a replay answers up to buffer_batches messages at once: never drop any of them
                self._replay.setsockopt(zmq.SNDHWM, 0)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self.endpoint = endpoint if connect else self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()

    # -- publishing -------------------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Send one ``EventBatch`` of ``events``; returns its sequence number."""
        return self.publish_raw(encode_batch(events, wire_format=self._wire_format))

    def publish_raw(self, payload: bytes) -> int:
        """Send ``payload`` as the next batch, whatever it holds: how tests and drills feed
        subscribers a malformed batch through the real socket (the engine never needs it)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("publisher is closed")
            seq = next(self._seq)
            self._buffer.append((seq, payload))
            if self._drop_next:
                self._drop_next -= 1
            else:
                try:
                    self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # cannot happen on PUB (it drops at HWM); the batch stays replayable
        return seq

    def drop_next(self, count: int = 1) -> None:
        """Fault injection: keep the next ``count`` batches for replay but do not send them, so
        subscribers see a sequence gap exactly as a lost message would produce."""
        with self._lock:
            self._drop_next += count

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch will get (peeks without consuming)."""
        with self._lock:
            return self._buffer[-1][0] + 1 if self._buffer else 0

    # -- replay -----------------------------------------------------------------------------

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._closed:
            try:
                if not sock.poll(self._REPLAY_POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._closed:
                    return
                log.exception("replay socket failed")
                return
            try:
                self._answer_replay(sock, frames)
            except zmq.ZMQError:
                if self._closed:
                    return
                log.exception("replay answer failed")

    def _answer_replay(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        identity = frames[0]
        # current vLLM puts the topic before each sequence frame, the end marker's topic empty
        head, end_head = ((self._topic,), (b"",)) if self._replay_form == "topic" else ((), ())
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring malformed replay request of %d frames", len(frames))
            sock.send_multipart((identity, b"", *end_head, encode_seq(END_SEQ), b""))
            return
        start = int.from_bytes(frames[2], "big")
        with self._lock:
            if self._buffer:
                first = self._buffer[0][0]
                todo = list(itertools.islice(self._buffer, max(0, start - first), None))
            else:
                todo = []
        for seq, payload in todo:
            sock.send_multipart((identity, b"", *head, encode_seq(seq), payload))
        sock.send_multipart((identity, b"", *end_head, encode_seq(END_SEQ), b""))

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the replay thread and close both sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
