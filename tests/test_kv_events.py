"""KV-event wire format: byte-exact messages built from the documented layouts (with the msgpack
package, independently of our encoder), decoder robustness, and the real ZMQ publisher."""

from __future__ import annotations

import hashlib
import time

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import free_port
from workers.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    KVEventDecodeError,
    KVEventPublisher,
    _decode_tolerant,
    _typed_events,
    _event_to_wire,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

TOKENS = list(range(100, 132))  # two 16-token blocks


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# byte-exact decoding of the documented forms


def test_new_vllm_map_form_as_captured() -> None:
    # the shape a vLLM 0.26 engine sends (positional batch, events as tagged maps, with fields
    # this decoder does not know: kv_cache_spec_kind)
    payload = pack(
        [
            1789095808.8378847,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [15760518052499183552, 42],
                    "parent_block_hash": None,
                    "token_ids": TOKENS,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [42], "medium": "GPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1789095808.8378847
    assert batch.data_parallel_rank == 0
    assert batch.rejected == ()
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[15760518052499183552, 42],
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=16,
        medium="GPU",
        extra_keys=[None, None],
        group_idx=0,
    )
    assert removed == BlockRemoved(block_hashes=[42], medium="GPU", group_idx=0)
    assert cleared == AllBlocksCleared()


def test_older_vllm_positional_form() -> None:
    # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    payload = pack(
        [
            12.5,
            [
                ["BlockStored", [7, 8], 6, TOKENS, 16, None, "CPU"],
                ["BlockRemoved", [7], "CPU"],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 3
    assert batch.events[0] == BlockStored(
        block_hashes=[7, 8], parent_block_hash=6, token_ids=TOKENS, block_size=16, medium="CPU"
    )
    assert batch.events[1] == BlockRemoved(block_hashes=[7], medium="CPU")
    assert batch.events[2] == AllBlocksCleared()


def test_sglang_form_with_trailing_defaults_omitted() -> None:
    # SGLang: batch without dp rank, BlockStored up to lora_id, BlockRemoved with hashes only
    payload = pack([3.0, [["BlockStored", [1], None, TOKENS[:16], 16, None], ["BlockRemoved", [1]]]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16),
        BlockRemoved(block_hashes=[1]),
    ]


def test_array_form_ignores_extra_trailing_fields() -> None:
    payload = pack([1.0, [["BlockStored", [1], None, TOKENS[:16], 16, 5, "GPU", "ad", None, 2, "future", 9]]])
    (ev,) = decode_batch(payload).events
    assert (ev.lora_id, ev.medium, ev.lora_name, ev.group_idx) == (5, "GPU", "ad", 2)


def test_map_batch_envelope_is_accepted() -> None:
    payload = pack({"ts": 2.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    assert decode_batch(payload) == DecodedBatch(ts=2.0, events=[AllBlocksCleared()], data_parallel_rank=1)


def test_byte_hashes_become_low_64_bits_big_endian() -> None:
    digest = hashlib.sha256(b"block").digest()
    parent = hashlib.sha256(b"parent").digest()
    payload = pack([0.0, [["BlockStored", [digest], parent, TOKENS[:16], 16, None, "GPU"]]])
    (ev,) = decode_batch(payload).events
    assert ev.block_hashes == [int.from_bytes(digest[24:], "big")]
    assert ev.parent_block_hash == int.from_bytes(parent[24:], "big")


def test_signed_int64_hashes_are_read_as_unsigned() -> None:
    payload = pack([0.0, [{"type": "BlockRemoved", "block_hashes": [-1, -(2**63)], "medium": None}]])
    (ev,) = decode_batch(payload).events
    assert ev.block_hashes == [2**64 - 1, 2**63]


def test_bad_events_are_dropped_one_by_one() -> None:
    good = ["BlockRemoved", [1]]
    payload = pack(
        [
            0.0,
            [
                good,
                ["BlockUpdated", [1]],  # unknown tag
                {"block_hashes": [1]},  # map without type
                ["BlockStored", [1], None, [1, -5], 16],  # negative token id
                ["BlockStored", [1], None, TOKENS[:16]],  # no block_size
                ["BlockStored", ["x"], None, TOKENS[:16], 16],  # hash of the wrong type
                {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS[:16], "block_size": 0},
                ["BlockRemoved", [True]],  # booleans are not hashes
                17,
                good,
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.events == [BlockRemoved(block_hashes=[1]), BlockRemoved(block_hashes=[1])]
    assert len(batch.rejected) == 8
    assert "unknown event type 'BlockUpdated'" in batch.rejected[0]
    assert batch.rejected[2].startswith("event 3:")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        pack("a string"),
        pack([1.0]),
        pack(["ts", []]),
        pack([True, []]),
        pack([1.0, {"not": "a list"}]),
        pack([1.0, [], "rank"]),
        pack({"events": []}),
        pack([1.0, []]) + b"trailing",
    ],
)
def test_garbage_raises_the_typed_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq(b"\xff" * 8) == -1
    assert encode_seq(-1) == b"\xff" * 8
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x00" * 4)


# ---------------------------------------------------------------------------------------------
# our encoder writes exactly the documented bytes


def test_encoder_map_form_matches_documented_layout() -> None:
    events = [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=16, medium="GPU"),
        BlockStored(
            block_hashes=[3], parent_block_hash=2, token_ids=TOKENS[:16], block_size=16, lora_name="ad", group_idx=1
        ),
        BlockRemoved(block_hashes=[1], medium="GPU"),
        AllBlocksCleared(),
    ]
    expected = pack(
        [
            9.25,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "parent_block_hash": None,
                    "token_ids": TOKENS,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {
                    "type": "BlockStored",
                    "block_hashes": [3],
                    "parent_block_hash": 2,
                    "token_ids": TOKENS[:16],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": None,
                    "lora_name": "ad",
                    "group_idx": 1,
                },
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    assert encode_batch(events, ts=9.25) == expected


def test_encoder_array_form_matches_documented_layout() -> None:
    events = [
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, group_idx=2),
        BlockRemoved(block_hashes=[1]),
        AllBlocksCleared(),
    ]
    expected = pack(
        [
            1.5,
            [
                ["BlockStored", [1], None, TOKENS[:16], 16, None, None, None, None, 2],
                ["BlockRemoved", [1], None],
                ["AllBlocksCleared"],
            ],
        ]
    )
    assert encode_batch(events, ts=1.5, wire_format="array", data_parallel_rank=None) == expected


# ---------------------------------------------------------------------------------------------
# properties

hashes = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1), st.binary(min_size=1, max_size=40))
token_blocks = st.integers(1, 4).flatmap(lambda n: st.lists(st.integers(0, 2**32 - 1), min_size=16 * n, max_size=16 * n))
mediums = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "STORAGE", "CPU_PINNED"]))
opt_small = st.one_of(st.none(), st.integers(0, 5))


@st.composite
def events(draw: st.DrawFn) -> BlockStored | BlockRemoved | AllBlocksCleared:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    if kind == "removed":
        return BlockRemoved(block_hashes=draw(st.lists(hashes, max_size=4)), medium=draw(mediums), group_idx=draw(opt_small))
    tokens = draw(token_blocks)
    return BlockStored(
        block_hashes=draw(st.lists(hashes, min_size=len(tokens) // 16, max_size=len(tokens) // 16)),
        parent_block_hash=draw(st.one_of(st.none(), hashes)),
        token_ids=tokens,
        block_size=16,
        lora_id=draw(opt_small),
        medium=draw(mediums),
        lora_name=draw(st.one_of(st.none(), st.text(max_size=8))),
        group_idx=draw(opt_small),
    )


def _normalized(h: int | bytes) -> int:
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & (2**64 - 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(events(), max_size=6), st.sampled_from(["map", "array"]))
def test_round_trip_in_both_forms(evs: list, wire_format: str) -> None:
    batch = decode_batch(encode_batch(evs, ts=1.0, wire_format=wire_format))  # type: ignore[arg-type]
    assert batch.rejected == ()
    assert len(batch.events) == len(evs)
    for got, sent in zip(batch.events, evs):
        assert type(got) is type(sent)
        if not isinstance(sent, AllBlocksCleared):
            assert got.block_hashes == [_normalized(h) for h in sent.block_hashes]
            assert got.medium == sent.medium and got.group_idx == sent.group_idx
        if isinstance(sent, BlockStored):
            assert got.token_ids == sent.token_ids
            assert got.lora_name == sent.lora_name and got.lora_id == sent.lora_id
            parent = None if sent.parent_block_hash is None else _normalized(sent.parent_block_hash)
            assert got.parent_block_hash == parent


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_the_typed_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except KVEventDecodeError:
        return
    assert isinstance(batch, DecodedBatch)


msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=12),
        st.binary(max_size=12),
        st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=12), st.sampled_from(["type", "block_hashes", "token_ids"])), children, max_size=5),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_arbitrary_msgpack_raises_only_the_typed_error(obj: object) -> None:
    try:
        decode_batch(pack(obj))
    except KVEventDecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(msgpack_values, max_size=6))
def test_arbitrary_events_in_a_good_batch_never_break_it(raw_events: list) -> None:
    batch = decode_batch(pack([1.0, raw_events, 0]))
    assert len(batch.events) + len(batch.rejected) == len(raw_events)


int_hashes = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**63), -1))


@st.composite
def wire_events(draw: st.DrawFn) -> object:
    """One event as it goes on the wire, in either form, often with one field swapped for any
    msgpack value (a bool token, a negative block size, a string where a list belongs...)."""
    ev = draw(events())
    if not isinstance(ev, AllBlocksCleared):  # ints only, so the typed decoder gets its chance
        ev = msgspec.structs.replace(ev, block_hashes=draw(st.lists(int_hashes, min_size=len(ev.block_hashes), max_size=len(ev.block_hashes))))
    wire = _event_to_wire(ev, draw(st.sampled_from(["map", "array"])))
    if draw(st.booleans()):
        if isinstance(wire, dict):
            wire[draw(st.sampled_from(sorted(wire)))] = draw(msgpack_values)
        elif len(wire) > 1:
            wire[draw(st.integers(1, len(wire) - 1))] = draw(msgpack_values)
    return wire


@settings(max_examples=400, deadline=None)
@given(st.lists(wire_events(), max_size=5), st.one_of(st.none(), st.integers(0, 3)), st.booleans())
def test_typed_decoding_reads_exactly_what_the_tolerant_decoder_reads(raw_events: list, rank: int | None, ts_int: bool) -> None:
    """Most batches are decoded by msgspec's typed decoder (tokens checked in C); it must never
    read a batch otherwise than the field-by-field decoder, nor accept one that decoder rejects
    an event of."""
    payload = pack([1 if ts_int else 1.5, raw_events] + ([] if rank is None else [rank]))
    typed = _typed_events(pack(raw_events))
    tolerant = _decode_tolerant(payload)
    if typed is not None:
        assert typed == tolerant.events and tolerant.rejected == ()
    assert decode_batch(payload) == tolerant


def test_typed_decoding_takes_the_common_batches() -> None:
    """vLLM's map form and SGLang's array form, int hashes (negative ones too), both decode typed."""
    evs = [
        BlockStored(block_hashes=[1, -2], parent_block_hash=-3, token_ids=list(range(32)), block_size=16, medium="GPU"),
        BlockRemoved(block_hashes=[-5], medium="GPU"),
        AllBlocksCleared(),
    ]
    for wire_format in ("map", "array"):
        typed = _typed_events(pack(msgspec.msgpack.decode(encode_batch(evs, ts=2.0, wire_format=wire_format))[1]))  # type: ignore[arg-type]
        assert typed is not None
        stored, removed, cleared = typed
        assert stored.block_hashes == [1, 2**64 - 2] and stored.parent_block_hash == 2**64 - 3
        assert removed.block_hashes == [2**64 - 5] and isinstance(cleared, AllBlocksCleared)
    bool_token = pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [True] * 16, "block_size": 16}]])
    assert _typed_events(pack(msgspec.msgpack.decode(bool_token)[1])) is None and decode_batch(bool_token).rejected


# ---------------------------------------------------------------------------------------------
# the publisher, over real sockets


def _sub(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    sub.connect(endpoint)
    return sub


def _joined(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """Publish probes until the SUB sees one (the slow-joiner problem), then drain."""
    for _ in range(100):
        pub.publish([])
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never joined")


def _replay(ctx: zmq.Context, endpoint: str, start: int, *, topic: bytes | None = b"") -> list[tuple[int, bytes]]:
    """Ask for a replay; ``topic``: what each answer's topic frame must hold (None: the old
    form, which has none)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", encode_seq(start)])
        out = []
        while True:
            frames = dealer.recv_multipart()
            if topic is None:
                empty, seq_frame, payload = frames
            else:
                empty, topic_frame, seq_frame, payload = frames
            assert empty == b""
            seq = decode_seq(seq_frame)
            if seq == -1:
                assert payload == b""
                assert topic is None or topic_frame == b""  # current vLLM's end marker: empty topic
                return out
            assert topic is None or topic_frame == topic
            out.append((seq, payload))
    finally:
        dealer.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_publisher_frames_sequence_and_replay(ctx: zmq.Context) -> None:
    with KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv@n1@m"
    ) as pub:
        sub = _sub(ctx, pub.endpoint, b"kv@n1")
        _joined(pub, sub)
        first = pub.next_seq
        ev = BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=TOKENS[:16], block_size=16, medium="GPU")
        assert pub.publish([ev]) == first
        assert pub.publish([BlockRemoved(block_hashes=[11])]) == first + 1
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@n1@m" and decode_seq(seq) == first
        assert decode_batch(payload).events == [ev]
        assert decode_seq(sub.recv_multipart()[1]) == first + 1

        # current vLLM's replay form: [b"", topic, seq, payload], end marker [b"", b"", -1, b""]
        replayed = _replay(ctx, pub.replay_endpoint, first, topic=b"kv@n1@m")
        assert [s for s, _ in replayed] == [first, first + 1]
        assert decode_batch(replayed[0][1]).events == [ev]
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0, topic=b"kv@n1@m")] == list(range(first + 2))
        assert _replay(ctx, pub.replay_endpoint, first + 10, topic=b"kv@n1@m") == []
        sub.close()


def test_publisher_answers_replay_in_the_older_form_on_request(ctx: zmq.Context) -> None:
    """Older vLLM and SGLang answered [b"", seq, payload] and [b"", -1, b""]: kept for tests."""
    with KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv@n1@m",
        replay_form="plain",
    ) as pub:  # fmt: skip
        sub = _sub(ctx, pub.endpoint, b"kv@n1")
        _joined(pub, sub)
        first = pub.publish([AllBlocksCleared()])
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, first, topic=None)] == [first]
        sub.close()


def test_publisher_drop_next_leaves_a_gap_that_replay_fills(ctx: zmq.Context) -> None:
    with KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as pub:
        sub = _sub(ctx, pub.endpoint)
        _joined(pub, sub)
        pub.drop_next(1)
        dropped = pub.publish([AllBlocksCleared()])
        sent = pub.publish([])
        assert decode_seq(sub.recv_multipart()[1]) == sent  # the dropped one never arrived
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, dropped)] == [dropped, sent]
        sub.close()


def test_publisher_buffer_is_bounded_and_raw_payloads_pass_through(ctx: zmq.Context) -> None:
    with KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", buffer_batches=3
    ) as pub:
        for _ in range(5):
            pub.publish([])
        raw = pub.publish_raw(b"\xc1not msgpack")
        replayed = _replay(ctx, pub.replay_endpoint, 0)
        assert [s for s, _ in replayed] == [3, 4, 5]
        assert replayed[-1] == (raw, b"\xc1not msgpack")


def test_publisher_answers_malformed_replay_requests_with_the_end_marker(ctx: zmq.Context) -> None:
    with KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as pub:
        pub.publish([])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 3000)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        assert dealer.recv_multipart() == [b"", b"", encode_seq(-1), b""]
        dealer.close(linger=0)
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0)] == [0]  # still serving


def test_publisher_array_form_and_close(ctx: zmq.Context) -> None:
    pub = KVEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}", wire_format="array"
    )
    pub.publish([BlockRemoved(block_hashes=[5], medium="GPU")])
    (_, payload), = _replay(ctx, pub.replay_endpoint, 0)
    assert msgpack.unpackb(payload)[1] == [["BlockRemoved", [5], "GPU"]]
    t0 = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(RuntimeError):
        pub.publish([])


def test_publisher_refuses_a_taken_port() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with KVEventPublisher(endpoint):
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(endpoint)


def test_vllm_032_fields_and_offload_placeholders_decode() -> None:
    """vLLM 0.32's BlockStored carries fields we do not use (kv_cache_spec_kind, locality,
    ownership, session_id): ignored. Its CPU-offload connector announces blocks it has no metadata
    for as placeholders: no token IDs and block_size 0 (before: rejected as malformed)."""
    stored = {
        "type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": TOKENS[:16],
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt"]],
        "group_idx": 0, "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None,
        "locality": "LOCAL", "ownership": None, "session_id": "s-1",
    }  # fmt: skip
    placeholder = {
        "type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [], "block_size": 0,
        "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 0, "locality": None, "ownership": None,
    }  # fmt: skip
    batch = decode_batch(pack([1.0, [stored, placeholder], 0]))
    assert batch.rejected == ()
    assert batch.events[0].extra_keys == [["salt"]] and batch.events[0].group_idx == 0
    assert batch.events[1] == BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU", group_idx=0)
    # a block size of 0 with token IDs is still nonsense
    bad = dict(placeholder, token_ids=TOKENS[:16])
    assert len(decode_batch(pack([1.0, [bad]])).rejected) == 1
