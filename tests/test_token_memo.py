"""The token-ID body decoder and memo (``gateway.token_memo``): whatever a body holds, routing sees
what a whole decode gives (values, key order, errors), and block keys are the same bits; a resent
prompt parses only its new IDs; a client cannot make it compare more than a few bodies' bytes or
hold more than its bound."""

from __future__ import annotations

import gc
import json
import tracemalloc

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.token_memo import MAX_COMPARES, MAX_LONGER, MIN_BYTES, STRIDE, TokenMemo, _first_difference, _parse
from tokenizer.errors import InvalidPrompt
from tokenizer.keys import block_keys
from tokenizer.openai_body import COMPLETIONS_PATH, parse_request

VOCAB = 128256
RNG = np.random.default_rng(7)
HISTORY = RNG.integers(0, VOCAB, 12_000).tolist()  # ~80 kB of JSON: past MIN_BYTES


def _body(ids: list, *, head: str = '"model": "m", ', tail: str = ', "max_tokens": 8', sep: str = ", ") -> bytes:
    return ('{' + head + '"prompt": [' + sep.join(map(str, ids)) + ']' + tail + '}').encode()


def _outcome(req_or_body: object) -> tuple:
    """What routing sees of a decoded body: its fields (in order), the prompt's IDs, or the error."""
    req = req_or_body
    if isinstance(req, bytes):
        try:
            req = msgspec.json.decode(req)
        except msgspec.DecodeError as e:
            return ("json", str(e))
        except RecursionError:
            return ("nested",)
    if not isinstance(req, dict):
        return ("not an object",)
    try:
        parsed = parse_request(COMPLETIONS_PATH, req, vocab_size=VOCAB)
    except InvalidPrompt as e:
        return ("invalid", str(e))
    prompt = parsed.prompt
    ids = prompt.token_ids.tolist() if hasattr(prompt, "token_ids") else repr(prompt)
    others = [(k, v) for k, v in req.items() if k != "prompt"]
    return ("ok", list(req), others, ids)


def _through(memo: TokenMemo, body: bytes) -> tuple:
    """As ``RoutingCore`` decodes: the memo, or a whole decode when it declines."""
    try:
        req = memo.decode(body)
    except msgspec.DecodeError as e:
        return ("json", str(e))
    except RecursionError:
        return ("nested",)
    return _outcome(body if req is None else req)


def _same(memo: TokenMemo, body: bytes) -> None:
    assert _through(memo, body) == _outcome(body)


# -- the parser


@settings(deadline=None)
@given(st.lists(st.integers(0, 10**8 - 1), min_size=1, max_size=1500), st.sampled_from([",", ", ", ",   "]))
def test_the_parser_reads_what_json_says(ids: list[int], sep: str) -> None:
    """Short inputs by the regex, long ones (past 4 kB) by numpy: the same numbers and ends."""
    text = ("{\"prompt\":[" + sep.join(map(str, ids)) + "]}").encode()
    got = _parse(text, 11, len(text) - 2)
    assert got is not None
    values, ends = got
    assert values.dtype == np.uint32 and values.tolist() == ids
    assert all(text[e - 1 : e].isdigit() and not text[e : e + 1].isdigit() for e in ends.tolist())


def _json_ids(inside: str) -> list[int] | None:
    try:
        value = json.loads("[" + inside + "]")
    except ValueError:
        return None
    ok = value and all(type(v) is int and 0 <= v < 10**8 for v in value)
    return value if ok and not inside[:1].isspace() and not inside[-1:].isspace() else None


@pytest.mark.parametrize("inside", [
    "1,,2", "1,2,", ",1", "01,2", "1, 02", "1,-2", "1.0,2", "1e3,2", "1,2 ", " 1,2", "1 ,2", "1,\n2",
    "1, 2,3", "1,2, 3", "1,\t2", "123456789,1", "1,true", "1,null", '1,"2"', "1,[2]", "", "1 2", "1,  ,2",
    "1,     2", "-0", "1,2,]", "9" * 20, "0,0", "10000000,0",
])
@pytest.mark.parametrize("long", [False, True])
def test_the_parser_takes_only_json_integers(inside: str, long: bool) -> None:
    """Whatever it is given, the parser answers JSON's own numbers or None (the body is then
    decoded whole): short inputs by the regex, long ones by numpy (which also declines spacing
    that is valid but uneven)."""
    if long:
        inside = "7, " * 2000 + inside
    text = ('{"prompt":[' + inside + "]}").encode()
    got = _parse(text, 11, len(text) - 2)
    want = _json_ids(inside)
    assert got is None or got[0].tolist() == want
    if want is None:
        assert got is None


@given(st.integers(0, 200_000), st.integers(0, 200_000), st.integers(1, 255))
def test_the_first_difference_is_found_exactly(at: int, limit: int, flip: int) -> None:
    data = bytes(RNG.integers(0, 256, 150_000, dtype=np.uint8))
    body = bytearray(data)
    if at < len(body):
        body[at] ^= flip
    limit = min(limit, len(data))
    want = next((i for i in range(limit) if body[i] != data[i]), limit)
    assert _first_difference(bytes(body), data, limit) == want


# -- equivalence with a whole decode, on adversarial bodies

_ELEMENT = st.one_of(
    st.integers(0, VOCAB - 1).map(str),
    st.integers(VOCAB, 2**70).map(str),
    st.integers(-(2**40), -1).map(str),
    st.sampled_from(["0", "1", "00", "01", "1.0", "1e3", "1E3", "0.5", "-0", "true", "false", "null", '"7"',
                     "[1]", "[]", "{}", "[1, 2]", " 3", "4 ", "99999999", "100000000", "4294967295", "4294967296"]),
)
_PLACE = st.sampled_from(["end", "middle", "start"])
_SHAPE = st.sampled_from([
    ("", ', "max_tokens": 8'), ('"model": "m", ', ""), ('"prompt": "x", "model": "m", ', ""),
    ('"model": "m", ', ', "prompt": [1, 2]'), ('"model": "m", ', ', "prompt": "text"'),
    ('"model": "m", "x": "\\"prompt\\": [1", ', ""), ('"model": "m", ', ', "model": 7'),
    ('"model": "m", "nested": {"prompt": [1, 2]}, ', ""), ('"model": "m", ', ', "n": 2, "cache_salt": "s"'),
    ('"model": "m", ', ',}'), ('"model": "m", ', ""),
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ELEMENT, max_size=4), _PLACE, _SHAPE, st.sampled_from([",", ", ", " , ", ",\n"]), st.booleans())
def test_every_body_routes_as_a_whole_decode(extra: list[str], place: str, shape: tuple[str, str], sep: str, batch: bool) -> None:
    """Fresh, then resent after a kept body with the same history: the same outcome as a whole decode."""
    head, tail = shape
    history = [str(i) for i in HISTORY]
    at = {"end": len(history), "middle": len(history) // 2, "start": 0}[place]
    ids = history[:at] + extra + history[at:]
    prompt = "[" + sep.join(ids) + "]"
    if batch:
        prompt = "[" + prompt + ", [1]]"
    body = ("{" + head + '"prompt": ' + prompt + tail + "}").encode()
    memo = TokenMemo()
    _same(memo, _body(HISTORY[:-40]))  # a kept body this one may continue
    _same(memo, body)
    _same(memo, body)  # and once it may be kept itself


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(HISTORY) - 1), st.lists(st.integers(0, 2 * VOCAB), min_size=0, max_size=40),
       st.integers(0, 3), st.sampled_from([", ", ","]))
def test_a_body_continuing_a_kept_one_anywhere_decodes_as_whole(keep: int, new: list[int], digits: int, sep: str) -> None:
    """Cut the history at any token, change that token's digits or not, add any IDs (some out of
    the vocabulary): the outcome is a whole decode's, IDs and errors alike."""
    memo = TokenMemo()
    _same(memo, _body(HISTORY))
    ids: list = HISTORY[:keep]
    if keep and digits:
        ids[-1] = int(str(ids[-1]) + "7" * digits)  # the shared token goes on in the new body
    _same(memo, _body(ids + new, sep=sep))


# -- what it saves, exactly


def test_a_resent_growing_prompt_parses_only_its_new_ids() -> None:
    memo = TokenMemo()
    ids = list(HISTORY)
    for turn in range(6):
        ids += RNG.integers(0, VOCAB, 37).tolist()
        body = _body(ids)
        req = memo.decode(body)
        assert req is not None and req["prompt"].tolist() == ids
        assert _outcome(req) == _outcome(body)
    assert memo.misses == 1 and memo.hits == 5
    assert memo.reused_tokens >= 5 * (len(HISTORY) - STRIDE)


def test_siblings_sharing_a_history_reuse_it_and_a_token_cut_mid_number_is_read_whole() -> None:
    """Bodies that share the history and differ after it (a continuing chat's turns); and a kept
    body whose last shared token is a prefix of the new body's (``...,12]`` then ``...,123]``)."""
    memo = TokenMemo()
    base = list(HISTORY[: 16 * 400])
    for turn in range(4):
        _same(memo, _body(base + [turn, 5, 6]))
    _same(memo, _body(base + [12]))
    _same(memo, _body(base + [123, 4]))
    _same(memo, _body(base[:-1] + [int(str(base[-1]) + "9")]))
    assert memo.hits >= 5


def test_keys_are_the_bits_of_a_whole_decode() -> None:
    memo = TokenMemo()
    ids = list(HISTORY)
    for turn in range(3):
        ids += [turn] * 50
        body = _body(ids)
        got = memo.decode(body)["prompt"]
        want = np.asarray(msgspec.json.decode(body)["prompt"], dtype=np.uint32)
        for block_size in (16, 64):
            assert block_keys(got, block_size=block_size, seed=3) == block_keys(want, block_size=block_size, seed=3)


async def test_a_core_routes_token_ids_as_one_without_the_memo() -> None:
    """Through ``RoutingCore``: with the memo and without, the policy is asked about the same
    prompt (length, blocks, the last block key, which chains every token), turn after turn."""
    from directory_client import InProcessDirectory, NodeInfo
    from gateway.core import RoutingCore, RoutingLimits
    from gateway.policy import make_policy
    from gateway.profile import load_profile
    from tokenizer import PromptTokenizer

    tok = PromptTokenizer()
    cores = []
    for memo_bytes in (64 << 20, 0):
        directory = InProcessDirectory()
        await directory.register_node(NodeInfo("n1", "127.0.0.1:9001"))
        cores.append(RoutingCore(tok, directory, make_policy("kvgate"), load_profile("llama-3.1-8b-h100"),
                                 RoutingLimits(head_chars=0), token_memo_bytes=memo_bytes))
    ids = [i % tok.vocab_size for i in HISTORY]
    bodies = []
    for turn in range(4):
        ids += [turn + 1] * 33
        bodies.append(_body(ids))
    bodies.append(_body(ids + [tok.vocab_size + 5]))  # refused alike: same status and message
    for body in bodies:
        asked = []
        for core in cores:
            result = await core.route(COMPLETIONS_PATH, body, sees_response_end=False)
            if result.kind == "routed":
                assert result.request is not None
                asked.append((result.request.prompt_tokens, result.request.affinity, result.request.total_blocks))
                await core.release(result)
            else:
                asked.append((result.kind, result.status, result.body))
        assert asked[0] == asked[1]
    assert cores[0].token_bodies.hits == 4 and cores[1].token_bodies.hits == 0
    assert cores[1].token_bodies.misses == 5  # parsed without a list, nothing kept


def test_decoded_ids_are_read_only() -> None:
    memo = TokenMemo()
    for body in (_body(HISTORY), _body(HISTORY + [1, 2])):
        ids = memo.decode(body)["prompt"]
        with pytest.raises(ValueError):
            ids[0] = 1  # the memo's copy: nobody downstream may change it


# -- hostile clients


def test_many_kept_bodies_behind_one_key_cost_at_most_a_few_comparisons() -> None:
    """Bodies sharing 60 kB then differing: each new one is compared with at most MAX_COMPARES
    kept ones, each at most its own length."""
    memo = TokenMemo()
    base = HISTORY[:9000]
    total = 0
    for i in range(40):
        body = _body(base + [i] * 2000)
        before = memo.compared_bytes
        _same(memo, body)
        assert memo.compared_bytes - before <= MAX_COMPARES * len(body)
        total += len(body)
    assert memo.compared_bytes <= MAX_COMPARES * total


def test_the_bound_holds_and_is_what_is_held() -> None:
    """Distinct long bodies, many times the bound: the charged bytes stay under it, and the memory
    the memo really holds (tracemalloc) is within a few percent of what it is charged."""
    bound = 4 << 20
    bodies = [_body(RNG.integers(0, VOCAB, 30_000).tolist()) for _ in range(3)]
    memo = TokenMemo(max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(30):
            body = bodies[i % 3][:-1] + b', "user": "%d"}' % i  # a new body each time (not shared bytes)
            assert memo.decode(body) is not None
            assert memo.held_bytes <= bound
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert memo.held_bytes == sum(k.cost for k in memo._kept.values()) > bound // 2
    assert held <= memo.held_bytes * 1.05 + (64 << 10)


def test_a_body_over_the_bound_and_tiny_bodies_are_never_kept() -> None:
    huge = _body(RNG.integers(0, VOCAB, 200_000).tolist())
    memo = TokenMemo(max_bytes=len(huge))  # its IDs and ends do not fit beside it
    assert memo.decode(huge) is not None and memo.held_bytes == 0
    small = TokenMemo()
    for i in range(200):
        assert small.decode(_body([i] * 100)) is None  # under MIN_BYTES: decoded whole
    assert small.held_bytes == 0 and not small._kept
    off = TokenMemo(max_bytes=0)
    assert off.decode(huge) is not None and off.held_bytes == 0  # parsed, never kept


def test_a_hit_that_evicts_its_own_source_is_still_exact() -> None:
    """Room for one body: each turn continues the kept one and pushes it out when kept itself."""
    first = _body(HISTORY)
    memo = TokenMemo(max_bytes=int(len(first) * 2.5))
    ids = list(HISTORY)
    for turn in range(5):
        ids += [turn] * 20
        _same(memo, _body(ids))
        assert len(memo._kept) == 1 and memo.held_bytes <= memo.max_bytes
    assert memo.hits == 4


def test_a_body_that_breaks_late_is_decoded_whole_and_not_kept() -> None:
    """A valid-looking array with one float, bool or negative at its end, a later "prompt"
    replacing it, a broken tail: the whole decode's answer, nothing kept; the next clean body
    still continues the kept one."""
    memo = TokenMemo()
    _same(memo, _body(HISTORY))
    for bad in (_body(HISTORY + ["1.5"]), _body(HISTORY + [3], tail=', "prompt": [5]'), _body(HISTORY + ["-1"]),
                _body(HISTORY + [7], tail=', "prompt": [5'), _body(HISTORY + ["true"]), _body(HISTORY + ["1e2"])):
        _same(memo, bad)
    assert len(memo._kept) == 1 and memo.hits == 0
    _same(memo, _body(HISTORY + [VOCAB]))  # out of the vocabulary: refused by parse_request alike
    _same(memo, _body(HISTORY + [1, 2, 3]))
    assert memo.hits == 2


def test_a_short_body_does_not_work_out_a_long_kept_one() -> None:
    """A kept body is scanned for its token ends the first time it is a candidate, only for a
    body at least 1/MAX_LONGER as long: a client's short bodies cannot make it scan long ones."""
    memo = TokenMemo()
    long = _body(HISTORY * 4)
    _same(memo, long)
    for i in range(5):
        _same(memo, _body(HISTORY[: 6000] + [i] * 10))  # shares the first rungs with the long one
    assert memo.worked_out_bytes <= sum(len(k.data) for k in memo._kept.values() if len(k.data) < len(long))
    assert memo.worked_out_bytes < len(long) * 5 // MAX_LONGER


def test_a_kept_body_whose_first_prompt_array_was_replaced_lends_nothing() -> None:
    """``{"prompt": [A], "prompt": [B]}`` decodes to B; a body continuing the bytes of A must not
    be given B's IDs (the kept body's array is checked to be the decoded one)."""
    other = RNG.integers(0, VOCAB, len(HISTORY)).tolist()
    memo = TokenMemo()
    _same(memo, _body(HISTORY, tail=', "prompt": [' + ", ".join(map(str, other)) + "]"))
    _same(memo, _body(HISTORY + [1, 2]))
    assert memo.hits == 0


def test_a_growing_prompt_shares_one_store_and_no_returned_ids_ever_change() -> None:
    """Turns that go on where the last one ended write past it in one shared array (no copy of
    the history); a turn that branches off an earlier one copies; every array handed out before
    still holds its own body's IDs."""
    memo = TokenMemo()
    handed: list[tuple[np.ndarray, list[int]]] = []

    def decode(ids: list[int]) -> None:
        got = memo.decode(_body(ids))["prompt"]
        handed.append((got, list(ids)))

    ids = list(HISTORY)
    decode(ids)
    for turn in range(4):
        ids = ids + [turn + 1] * (5 + 7 * turn)
        decode(ids)
    stores = [k.store for k in memo._kept.values()]
    assert len({id(s) for s in stores[1:]}) == 1  # the history copied once, then extended in place
    decode(ids[:-20] + [9, 9, 9])  # branches off inside the last turn
    decode(ids[: len(HISTORY) + 3] + [4, 4])  # and off an earlier one
    decode(ids + [5])
    assert len({id(k.store) for k in memo._kept.values()}) >= 3
    for got, want in handed:
        assert got.tolist() == want and not got.flags.writeable
