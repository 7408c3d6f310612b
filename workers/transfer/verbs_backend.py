"""Direct one-sided RDMA READ with pyverbs, as a ``TransferBackend``.

Set-up, once per process: open the device, a protection domain, and register the slot buffer as
one memory region (local write for our reads landing in it, remote read for peers).

Connection, once per (puller, owner) pair, over the agent's control channel: the puller creates
an RC queue pair (INIT) and sends its QP number, starting PSN, LID and GID (``connect_request``);
the owner creates its own QP, moves it to RTS aimed at the puller's and answers with the same
facts (``accept``); the puller moves its QP to RTS aimed at the owner's (``connected``). Each QP
has its own completion queue, so a broken connection can be dropped without stale completions
leaking into another peer's reads.

A read posts the READ work requests (every WR signalled, at most ``max_rd_atomic`` outstanding —
the device's limit on reads in flight per QP) and polls the CQ until every WR completed or the
deadline passed. A failed completion, a pyverbs error or the deadline raises ``TransferError``; the
QP is then closed (it is in the error state) and the next pull connects again.

pyverbs is imported lazily: the venv may not have it. Debian ships it as ``python3-pyverbs`` for
the system Python; point ``KVGATE_PYVERBS_PATH`` at the directory holding its ``pyverbs``
package (e.g. ``/usr/lib/python3/dist-packages``) when the ABI matches.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from workers.transfer.backend import ReadOp, TransferError

PYVERBS_PATH_ENV = "KVGATE_PYVERBS_PATH"
SQ_DEPTH = 256
DEFAULT_POLL_TIMEOUT_S = 10.0


def import_pyverbs() -> SimpleNamespace:
    """The pyverbs modules used here; ``TransferError`` naming the cause if they cannot load."""
    extra = os.environ.get(PYVERBS_PATH_ENV)
    if extra and extra not in sys.path:
        sys.path.append(extra)
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, SendWR
    except ImportError as e:
        raise TransferError(f"pyverbs is not importable ({e}); install rdma-core's pyverbs or set {PYVERBS_PATH_ENV}") from e
    return SimpleNamespace(
        e=enums, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
        get_device_list=get_device_list, MR=MR, PD=PD, PyverbsError=PyverbsError, QP=QP, QPAttr=QPAttr,
        QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR,
    )


def rdma_devices() -> list[str]:
    """Names of the RDMA devices this host has; ``TransferError`` if it has none or no support."""
    pv = import_pyverbs()
    try:
        names = [d.name.decode() for d in pv.get_device_list()]
    except pv.PyverbsError as e:  # no kernel support (CONFIG_INFINIBAND off) or no uverbs device
        raise TransferError(f"no RDMA device: {e}") from e
    if not names:
        raise TransferError("no RDMA device found")
    return names


class _Conn:
    """One RC queue pair and its own completion queue."""

    __slots__ = ("qp", "cq", "psn")

    def __init__(self, qp: Any, cq: Any, psn: int) -> None:
        self.qp, self.cq, self.psn = qp, cq, psn

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            try:
                obj.close()
            except Exception:  # closing a QP in the error state can fail; the device reclaims it
                pass


class VerbsBackend:
    """RC queue pairs + RDMA READ over one registered memory region."""

    name = "verbs"

    def __init__(
        self,
        *,
        device: str = "",
        port: int = 1,
        gid_index: int = 0,
        max_outstanding: int = 16,
        poll_timeout_s: float = DEFAULT_POLL_TIMEOUT_S,
    ) -> None:
        self._pv = pv = import_pyverbs()
        names = rdma_devices()
        name = device or names[0]
        if name not in names:
            raise TransferError(f"RDMA device {name!r} not found (have {', '.join(names)})")
        try:
            self._ctx = pv.Context(name=name)
            self._pd = pv.PD(self._ctx)
            self._port_attr = self._ctx.query_port(port)
            self._gid = self._ctx.query_gid(port, gid_index).gid
            limit = self._ctx.query_device().max_qp_rd_atom
        except pv.PyverbsError as e:
            raise TransferError(f"opening RDMA device {name!r}: {e}") from e
        self.device = name
        self._port = port
        self._gid_index = gid_index
        self._rd_atom = max(1, min(max_outstanding, limit))
        self._poll_timeout_s = poll_timeout_s
        self._node = uuid.uuid4().hex
        self._access = pv.e.IBV_ACCESS_LOCAL_WRITE | pv.e.IBV_ACCESS_REMOTE_READ
        self._mr: Any = None
        self._out: dict[str, _Conn] = {}  # owner node -> our QP reading from it
        self._pending: dict[str, _Conn] = {}  # owner node -> QP waiting for its accept answer
        self._in: dict[str, _Conn] = {}  # puller node -> our QP it reads through
        self._lock = threading.Lock()  # one read at a time per backend: completions stay ours

    def register(self, address: int, length: int) -> None:
        try:
            self._mr = self._pv.MR(self._pd, length, self._access, address=address)
        except self._pv.PyverbsError as e:
            raise TransferError(f"registering {length} bytes with {self.device}: {e}") from e

    def descriptor(self) -> dict[str, Any]:
        if self._mr is None:
            raise TransferError("no memory registered")
        return {"backend": self.name, "node": self._node, "rkey": self._mr.rkey, **self._address()}

    def _address(self) -> dict[str, Any]:
        return {"lid": self._port_attr.lid, "gid": self._gid}

    def _new_conn(self) -> _Conn:
        pv = self._pv
        cq = pv.CQ(self._ctx, SQ_DEPTH)
        cap = pv.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.QPInitAttr(qp_type=pv.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
        attr = pv.QPAttr()
        attr.qp_access_flags = self._access
        attr.port_num = self._port
        qp = pv.QP(self._pd, init, attr)  # RC with attributes: returned in INIT
        return _Conn(qp, cq, random.getrandbits(24))

    def _to_rts(self, conn: _Conn, remote: dict[str, Any]) -> None:
        pv = self._pv
        gid = pv.GID()
        gid.gid = str(remote["gid"])
        route = pv.GlobalRoute(dgid=gid, sgid_index=self._gid_index)
        attr = pv.QPAttr()
        attr.ah_attr = pv.AHAttr(port_num=self._port, is_global=1, gr=route, dlid=int(remote["lid"]))
        attr.dest_qp_num = int(remote["qp_num"])
        attr.rq_psn = int(remote["psn"])  # the PSN the peer sends from
        attr.sq_psn = conn.psn
        attr.path_mtu = self._port_attr.active_mtu
        attr.max_dest_rd_atomic = self._rd_atom
        attr.max_rd_atomic = self._rd_atom
        attr.qp_access_flags = self._access
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer = 14, 7, 7, 12
        conn.qp.to_rts(attr)

    def _me(self, conn: _Conn) -> dict[str, Any]:
        return {"node": self._node, "qp_num": conn.qp.qp_num, "psn": conn.psn, **self._address()}

    def connect_request(self, peer: dict[str, Any]) -> dict[str, Any] | None:
        owner = str(peer["node"])
        with self._lock:
            if owner in self._out:
                return None
            try:
                conn = self._pending.get(owner) or self._new_conn()
            except self._pv.PyverbsError as e:
                raise TransferError(f"creating a queue pair: {e}") from e
            self._pending[owner] = conn
            return self._me(conn)

    def accept(self, request: dict[str, Any]) -> dict[str, Any]:
        puller = str(request["node"])
        try:
            conn = self._new_conn()
            self._to_rts(conn, request)
        except self._pv.PyverbsError as e:
            raise TransferError(f"accepting a queue pair from {puller}: {e}") from e
        with self._lock:
            old = self._in.pop(puller, None)
            self._in[puller] = conn
        if old is not None:
            old.close()
        return self._me(conn)

    def connected(self, peer: dict[str, Any], answer: dict[str, Any]) -> None:
        owner = str(peer["node"])
        with self._lock:
            conn = self._pending.pop(owner, None)
            if conn is None:
                raise TransferError(f"no connection to {owner} was being set up")
            try:
                self._to_rts(conn, answer)
            except self._pv.PyverbsError as e:
                conn.close()
                raise TransferError(f"connecting to {owner}: {e}") from e
            self._out[owner] = conn

    def read(self, peer: dict[str, Any], ops: Sequence[ReadOp]) -> None:
        if peer.get("backend") != self.name:
            raise TransferError(f"peer speaks {peer.get('backend')!r}, this node {self.name!r}")
        owner = str(peer["node"])
        with self._lock:
            conn = self._out.get(owner)
            if conn is None:
                raise TransferError(f"not connected to {owner}")
            try:
                self._read(conn, int(peer["rkey"]), ops)
            except BaseException:
                self._out.pop(owner, None)  # its QP is in the error state (or may be): reconnect next time
                conn.close()
                raise

    def _read(self, conn: _Conn, rkey: int, ops: Sequence[ReadOp]) -> None:
        pv = self._pv
        lkey = self._mr.lkey
        deadline = time.monotonic() + self._poll_timeout_s
        i = 0
        while i < len(ops):
            window = ops[i : i + self._rd_atom]
            try:
                for j, op in enumerate(window):
                    wr = pv.SendWR(
                        wr_id=i + j, opcode=pv.e.IBV_WR_RDMA_READ, num_sge=1,
                        sg=[pv.SGE(op.local_addr, op.length, lkey)], send_flags=pv.e.IBV_SEND_SIGNALED,
                    )
                    wr.set_wr_rdma(rkey, op.remote_addr)
                    conn.qp.post_send(wr)
                done = 0
                while done < len(window):
                    n, wcs = conn.cq.poll(num_entries=len(window) - done)
                    for wc in wcs[:n]:
                        if wc.status != pv.e.IBV_WC_SUCCESS:
                            raise TransferError(f"RDMA READ {wc.wr_id} completed with status {wc.status} (vendor {wc.vendor_err})")
                    done += n
                    if not n and time.monotonic() > deadline:
                        raise TransferError(f"RDMA READ: {len(window) - done} completions missing after {self._poll_timeout_s}s")
            except pv.PyverbsError as e:
                raise TransferError(f"RDMA READ: {e}") from e
            i += len(window)

    def close(self) -> None:
        with self._lock:
            conns = [*self._out.values(), *self._pending.values(), *self._in.values()]
            self._out.clear(), self._pending.clear(), self._in.clear()
        for conn in conns:
            conn.close()
        for obj in (self._mr, self._pd, self._ctx):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # best effort at shutdown; the process is ending
                    pass
