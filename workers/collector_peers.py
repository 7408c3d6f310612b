"""Whose KV events the collector accepts: a node's messages only from the node's own host.

Why: with a collector, engines' PUB sockets connect to a SUB socket kvgate binds, and a message's
topic names its node. Anyone reaching that port could otherwise publish under any node's topic:
claim the node holds prompts it never saw (steering traffic to it), or take the engine's next
sequence number so that its real batch looks like a restart and clears the node. An engine
connects from the host it serves on (the node's ``address``), so a message is accepted for a node
only when its sender's IP is one that host resolves to, or one of the node's ``events_sources``
(an engine publishing from another interface's address than it serves on) resolves to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time

import zmq

log = logging.getLogger(__name__)

RESOLVE_EVERY_S = 30.0  # a host name is resolved again at most this often (a mismatch may be a move)


def sender_ip(frame: zmq.Frame) -> str | None:
    """The IP a received message came from (IPv4-mapped addresses as IPv4); None when the
    transport has none (ipc, inproc): only local processes reach those."""
    try:
        peer = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    if not isinstance(peer, str) or not peer:
        return None
    return _normal(peer)


def _normal(ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def host_of(address: str) -> str:
    """``host`` of ``host:port`` / ``[v6]:port``."""
    return address.rsplit(":", 1)[0].strip("[]")


class NodeHosts:
    """The IPs each node's host resolves to, re-resolved on a mismatch at most every 30 s."""

    def __init__(self) -> None:
        self._ips: dict[str, tuple[frozenset[str], float]] = {}  # host -> (its IPs, when resolved)

    async def allows(self, address: str, ip: str, sources: tuple[str, ...] = ()) -> bool:
        """``ip`` is one the host of ``address`` or one of ``sources`` (hosts) resolves to."""
        for host in (host_of(address), *(s.strip("[]") for s in sources)):
            if await self._host_allows(host, ip):
                return True
        return False

    async def _host_allows(self, host: str, ip: str) -> bool:
        known = self._ips.get(host)
        if known is not None and (ip in known[0] or time.monotonic() - known[1] < RESOLVE_EVERY_S):
            return ip in known[0]
        ips = await self._resolve(host)
        self._ips[host] = (ips, time.monotonic())
        return ip in ips

    @staticmethod
    async def _resolve(host: str) -> frozenset[str]:
        literal = _normal(host)
        if literal is not None:
            return frozenset({literal})
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as e:
            log.warning("collector: cannot resolve node host %r (%s): its events are refused until it resolves", host, e)
            return frozenset()
        return frozenset(ip for info in infos if (ip := _normal(str(info[4][0]))) is not None)
