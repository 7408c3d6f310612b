"""The pyverbs RDMA READ backend. These machines have no RDMA device (kernel without
CONFIG_INFINIBAND), so the transfer test skips here, saying so; where pyverbs loads, the
missing device must still surface as the one ``TransferError`` type.

Debian's ``python3-pyverbs`` serves the venv's Python 3.11 when ``KVGATE_PYVERBS_PATH`` (or, in
these tests, its default location) points at it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from workers.transfer import SlotTable, TransferAgent, TransferError, block_payload
from workers.transfer.standalone import StaticHolder, synthetic_chain
from workers.transfer.verbs_backend import PYVERBS_PATH_ENV, VerbsBackend, import_pyverbs, rdma_devices
from tests.conftest import free_port
from tests.support.transfer import KEY, peer_auth

DEBIAN_PYVERBS = "/usr/lib/python3/dist-packages"


@pytest.fixture(autouse=True)
def pyverbs_path(monkeypatch):
    if PYVERBS_PATH_ENV not in os.environ and Path(DEBIAN_PYVERBS, "pyverbs").is_dir():
        monkeypatch.setenv(PYVERBS_PATH_ENV, DEBIAN_PYVERBS)


def pyverbs_or_skip() -> None:
    try:
        import_pyverbs()
    except TransferError as e:
        pytest.skip(f"pyverbs is not installed here: {e}")


def device_or_skip() -> str:
    pyverbs_or_skip()
    try:
        return rdma_devices()[0]
    except TransferError as e:
        pytest.skip(f"no RDMA device on this machine ({e}); the verbs backend runs on RDMA fleets only")


def test_no_device_is_a_transfer_error_not_a_pyverbs_error() -> None:
    pyverbs_or_skip()
    try:
        names = rdma_devices()
    except TransferError:
        with pytest.raises(TransferError, match="RDMA device"):
            VerbsBackend()
        return
    with pytest.raises(TransferError, match="not found"):
        VerbsBackend(device=f"not-{names[0]}")


async def test_rdma_read_between_two_agents() -> None:
    device = device_or_skip()
    chain = synthetic_chain(32, 3)
    owner_slots = SlotTable(32, 4096, checksum_key=KEY)
    holder = StaticHolder(owner_slots, chain)
    owner = TransferAgent(VerbsBackend(device=device), owner_slots, holder, auth=peer_auth("owner"))
    await owner.start("127.0.0.1", free_port())

    class Nothing:
        def hold(self, hashes):
            return 0

        def unhold(self, hashes):
            raise AssertionError

    puller = TransferAgent(VerbsBackend(device=device), SlotTable(64, 4096, checksum_key=KEY), Nothing(), auth=peer_auth("puller"))
    try:
        pulled = await puller.pull(owner.endpoint, chain, 2, timeout_s=10)
        assert pulled.hashes == tuple(chain[2:])
        for h, slot in zip(pulled.hashes, pulled.slots):
            assert puller.slots.view(slot)[:4096].tobytes() == block_payload(h, 4096)
        owner_slots.view(owner_slots.slot_of(chain[5]))[0] ^= 1
        with pytest.raises(TransferError) as err:
            await puller.pull(owner.endpoint, chain, 0, timeout_s=10)
        assert err.value.reason == "checksum"
        await asyncio.sleep(0.05)
        assert holder.pinned == 0
    finally:
        await puller.close()
        await owner.close()
