"""The simulated engine's side of disaggregated prefill/decode, in vLLM's ``kv_transfer_params`` shape.

A prefill node is asked with ``kv_transfer_params: {"do_remote_decode": true}`` (and
``max_tokens: 1``); it serves the prompt as usual, keeps the blocks in its prefix cache, and
answers with the parameters a decode node needs to fetch them::

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": <node id>,
     "remote_host": <transfer agent host>, "remote_port": <transfer agent port>, "remote_blocks": <n>}

A decode node given those parameters pulls the ``remote_blocks`` leading blocks of the prompt
from that transfer agent before its prefill (``workers.engine.pull``: leased, verified, the
modelled transfer time waited); a pull that fails (unreachable, refused, a block failing
verification, no room) is discarded and the prompt recomputed. Engines of one model hash a
prompt's blocks alike, so the block count names the blocks.
"""

from __future__ import annotations

from typing import Any

from workers.transfer import TransferAgent


def wants_remote_decode(body: Any) -> bool:
    """The request is a prefill for another node: answer with transfer parameters."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def remote_prefill_source(body: Any) -> tuple[str, str] | None:
    """(transfer agent "host:port", block count) to pull before prefill, as the pull headers'
    strings (``workers.engine.pull.parse_pull_headers`` checks them); None without parameters."""
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return f"{params.get('remote_host', '')}:{params.get('remote_port', '')}", str(params.get("remote_blocks", ""))


def remote_decode_params(agent: TransferAgent | None, node_id: str, prompt_blocks: int) -> dict[str, Any] | None:
    """What the answer to a ``do_remote_decode`` request carries; None when this node cannot serve
    transfers (no agent): the decode node then computes the prompt itself."""
    if agent is None:
        return None
    host, _, port = agent.endpoint.rpartition(":")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": node_id,
        "remote_host": host.strip("[]"),
        "remote_port": int(port),
        "remote_blocks": prompt_blocks,
    }
