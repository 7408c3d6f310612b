"""The Lua scripts beside this module, each prefixed with ``common.lua``, with their SHA1.

One script per directory operation keeps every operation one atomic round trip; the shared
helpers (tier bitmasks, prefix scan, reservation expiry) live once in ``common.lua``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_HERE = Path(__file__).parent
SCRIPT_NAMES = (
    "lookup_all",
    "lookup_node",
    "record_stored",
    "record_removed",
    "register",
    "heartbeat",
    "registry_touch",
    "registry_live",
    "node_info",
    "reserve",
    "release",
    "writer_claim",
    "writer_release",
    "writer_lapsed_clear",
    "retire",
    "replace_commit",
)


@dataclass(frozen=True, slots=True)
class Script:
    name: str
    text: bytes
    sha: str


@cache
def scripts() -> dict[str, Script]:
    common = (_HERE / "common.lua").read_text()
    out = {}
    for name in SCRIPT_NAMES:
        text = (common + "\n" + (_HERE / f"{name}.lua").read_text()).encode()
        out[name] = Script(name, text, hashlib.sha1(text).hexdigest())
    return out
