"""The transfer agent over both TCP transports: real processes, real sockets, real bytes.

``kvgate-tcp`` (the default: bytes through the owner agent's signed ``/kv/read``) and Mooncake's
TCP transport run the same pulls. The owner is ``python -m workers.transfer serve`` (a synthetic
chain of blocks); the puller is an agent in the test process. Where a test has to damage the
owner's memory or watch its pins, both agents run here (still talking over loopback TCP).
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.conftest import free_port
from tests.support.procs import Proc, python_module, wait_for_port
from tests.support.transfer import KEY, secret_file, signed, peer_auth
from workers.transfer import SlotTable, TransferAgent, TransferError, block_payload, make_backend
from workers.transfer.standalone import StaticHolder, synthetic_chain

PAYLOAD = 8192
BLOCKS = 48
SEED = 7


class NothingHeld:
    """A puller's holder: it serves nothing in these tests."""

    def hold(self, hashes) -> int:
        return 0

    def unhold(self, hashes) -> None:
        raise AssertionError("nothing was held")


TCP_BACKENDS = ["kvgate-tcp", "mooncake-tcp"]


def start_owner(
    tmp_path, name: str, *, blocks: int = BLOCKS, payload: int = PAYLOAD, backend: str = "kvgate-tcp"
) -> tuple[Proc, str]:
    port = free_port()
    args = ["serve", "--port", str(port), "--blocks", str(blocks), "--payload-bytes", str(payload), "--seed", str(SEED),
            "--secret-file", secret_file(tmp_path), "--backend", backend]  # fmt: skip
    proc = python_module(name, "workers.transfer", args, tmp_path)
    wait_for_port(port, proc=proc.popen, timeout_s=30)
    return proc, f"127.0.0.1:{port}"


def puller(slots: int = 128, payload: int = PAYLOAD, backend: str = "kvgate-tcp") -> TransferAgent:
    auth = peer_auth("puller")
    return TransferAgent(
        make_backend(backend, host="127.0.0.1", auth=auth), SlotTable(slots, payload, checksum_key=KEY), NothingHeld(),
        auth=auth,
    )


async def health(endpoint: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"http://{endpoint}/kv/health") as r:
        return await r.json()


@pytest.fixture(scope="module", params=TCP_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def owner(tmp_path_factory, backend: str):
    proc, endpoint = start_owner(tmp_path_factory.mktemp("owner"), "owner", backend=backend)
    yield endpoint
    proc.stop()


async def test_pull_moves_verified_bytes_between_processes(owner: str, backend: str) -> None:
    agent = puller(backend=backend)
    chain = synthetic_chain(BLOCKS, SEED)
    try:
        pulled = await agent.pull(owner, chain, 0, timeout_s=10)
        assert pulled.hashes == tuple(chain)
        assert pulled.bytes == BLOCKS * agent.slots.slot_size
        for h, slot in zip(pulled.hashes, pulled.slots):  # independent of the agent's own check
            assert agent.slots.view(slot)[:PAYLOAD].tobytes() == block_payload(h, PAYLOAD)
        agent.adopt(pulled)
        assert agent.slots.slot_of(chain[3]) == pulled.slots[3]
        assert agent.stats.pulls_ok == 1 and agent.stats.pulled_blocks == BLOCKS
        # The owner's lease (its pins) is released once the read is over.
        for _ in range(100):
            if (await health(owner))["leases"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await health(owner))["leases"] == 0
    finally:
        await agent.close()


async def test_pull_starts_after_what_the_puller_has_and_stops_where_the_owner_does(owner: str, backend: str) -> None:
    agent = puller(backend=backend)
    chain = synthetic_chain(BLOCKS, SEED) + synthetic_chain(5, SEED + 1)  # the owner lacks the tail
    try:
        pulled = await agent.pull(owner, chain, 5, timeout_s=10)
        assert pulled.hashes == tuple(chain[5:BLOCKS])
        assert agent.slots.free_slots == agent.slots.capacity - (BLOCKS - 5)
        agent.discard(pulled)
        assert agent.slots.free_slots == agent.slots.capacity
    finally:
        await agent.close()


async def test_an_owner_without_the_blocks_gives_an_empty_pull(owner: str, backend: str) -> None:
    agent = puller(backend=backend)
    try:
        pulled = await agent.pull(owner, synthetic_chain(10, SEED + 99), 0, timeout_s=10)
        assert pulled.hashes == () and pulled.slots == ()
        assert agent.slots.free_slots == agent.slots.capacity
    finally:
        await agent.close()


async def test_a_dead_owner_is_a_transfer_error_and_nothing_leaks(tmp_path) -> None:
    proc, endpoint = start_owner(tmp_path, "doomed")
    proc.kill(signal.SIGKILL)
    proc.stop()
    agent = puller()
    try:
        with pytest.raises(TransferError) as err:
            await agent.pull(endpoint, synthetic_chain(BLOCKS, SEED), 0, timeout_s=5)
        assert err.value.reason == "unreachable"
        assert agent.slots.free_slots == agent.slots.capacity
        assert agent.stats.failures == {"unreachable": 1}
    finally:
        await agent.close()


@pytest.mark.parametrize("backend", TCP_BACKENDS)
async def test_owner_frozen_then_killed_mid_read(tmp_path, backend: str) -> None:
    """A read that outlives the pull's timeout keeps its slots until it returns (it may still write)."""
    blocks, payload = 128, 4 << 20  # 512 MiB: the read takes long enough to freeze the owner during it
    proc, endpoint = start_owner(tmp_path, "frozen", blocks=blocks, payload=payload, backend=backend)
    agent = puller(slots=blocks, payload=payload, backend=backend)
    try:
        task = asyncio.create_task(agent.pull(endpoint, synthetic_chain(blocks, SEED), 0, timeout_s=1.5))
        deadline = time.monotonic() + 10
        while agent.slots.free_slots == agent.slots.capacity:  # slots are reserved just before the read
            assert time.monotonic() < deadline and not task.done(), "the read never started"
            await asyncio.sleep(0.001)
        proc.popen.send_signal(signal.SIGSTOP)
        with pytest.raises(TransferError) as err:
            await task
        assert err.value.reason in ("timeout", "transfer")
        if err.value.reason == "timeout":
            assert agent.slots.free_slots < agent.slots.capacity  # still quarantined: the read runs on
        proc.kill(signal.SIGKILL)  # the read now fails and gives its slots back
        deadline = time.monotonic() + 30
        while agent.slots.free_slots != agent.slots.capacity:
            assert time.monotonic() < deadline, "slots of the dead read were never freed"
            await asyncio.sleep(0.05)
    finally:
        proc.kill(signal.SIGKILL)
        proc.stop()
        await agent.close()


async def in_process_owner(
    blocks: int = 16, payload: int = 1024, backend: str = "kvgate-tcp", **kw
) -> tuple[TransferAgent, StaticHolder, list[int]]:
    chain = synthetic_chain(blocks, SEED)
    slots = SlotTable(blocks, payload, checksum_key=KEY)
    holder = StaticHolder(slots, chain)
    auth = peer_auth("owner")
    agent = TransferAgent(make_backend(backend, host="127.0.0.1", auth=auth), slots, holder, auth=auth, **kw)
    await agent.start("127.0.0.1", free_port())
    return agent, holder, chain


async def test_a_corrupted_block_is_caught_and_nothing_is_used() -> None:
    owner, holder, chain = await in_process_owner()
    agent = puller(payload=1024)
    try:
        slot = owner.slots.slot_of(chain[9])
        owner.slots.view(slot)[100] ^= 0x40  # damage one byte of the owner's copy
        with pytest.raises(TransferError) as err:
            await agent.pull(owner.endpoint, chain, 0, timeout_s=5)
        assert err.value.reason == "checksum" and "checksum" in str(err.value)
        assert agent.stats.corrupt_blocks == 1
        assert agent.slots.free_slots == agent.slots.capacity
        for _ in range(100):  # the lease is released even though the pull failed
            if holder.pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert holder.pinned == 0
    finally:
        await agent.close()
        await owner.close()


async def test_leases_pin_blocks_until_released_or_expired() -> None:
    owner, holder, chain = await in_process_owner(lease_ttl_s=0.3)
    ep = owner.endpoint
    try:
        async with aiohttp.ClientSession() as s:
            async with signed(s, "POST", ep, "/kv/lease", {"hashes": chain[:10], "start": 4}) as r:
                first = await r.json()
            assert first["held"] == 10 and len(first["addrs"]) == 6
            assert first["addrs"][0] == owner.slots.address(owner.slots.slot_of(chain[4]))
            assert holder.pinned == 10
            async with signed(s, "DELETE", ep, f"/kv/lease/{first['lease']}") as r:
                assert (await r.json())["released"] is True
            assert holder.pinned == 0
            async with signed(s, "POST", ep, "/kv/lease", {"hashes": chain, "start": 0}) as r:
                assert (await r.json())["held"] == len(chain)
            assert holder.pinned == len(chain)
            await asyncio.sleep(0.6)  # nobody releases it: the lease expires
            assert holder.pinned == 0 and owner.stats.expired_leases == 1
            async with signed(s, "POST", ep, "/kv/lease", {"hashes": chain[:3], "start": 3}) as r:  # nothing beyond start
                body = await r.json()
            assert body["lease"] is None and body["held"] == 3 and holder.pinned == 0
    finally:
        await owner.close()


BAD_LEASES = [{"hashes": "nope"}, {"start": 1}, {"hashes": [1, 2], "start": 5}, {"hashes": [-1]}, {"hashes": [2**64]}]


async def test_bad_lease_requests_get_a_clear_error_and_pin_nothing() -> None:
    owner, holder, chain = await in_process_owner(blocks=4)
    try:
        async with aiohttp.ClientSession() as s:
            for body in BAD_LEASES:
                async with signed(s, "POST", owner.endpoint, "/kv/lease", body) as r:
                    assert r.status == 400, body
                    assert "error" in await r.json()
            async with signed(s, "POST", owner.endpoint, "/kv/lease", raw=b"{not json") as r:
                assert r.status == 400
        assert holder.pinned == 0 and owner.stats.leases == 0
    finally:
        await owner.close()


async def test_peers_with_different_slot_sizes_refuse_to_pull() -> None:
    owner, holder, chain = await in_process_owner(payload=1024)
    agent = puller(payload=2048)
    try:
        with pytest.raises(TransferError) as err:
            await agent.pull(owner.endpoint, chain, 0, timeout_s=5)
        assert err.value.reason == "mismatch"
        assert agent.slots.free_slots == agent.slots.capacity
    finally:
        await agent.close()
        await owner.close()
