"""Hardware profiles: how long prefill, decode and KV transfer take on one node.

One source of truth for two users: the gateway's cost model estimates time to
first token with it, and the simulated engine sleeps for it. Profiles are YAML
files; the shipped ones live beside this module and cite the public figures they come from.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

PROFILE_DIR = Path(__file__).with_name("profiles")


class HardwareProfile(BaseModel):
    """Timing model of one (model, GPU) pair. Times in seconds, sizes in tokens/bytes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model: str
    hardware: str
    sources: list[str] = Field(default_factory=list, description="public figures this was calibrated from")

    block_size: int = 16
    kv_bytes_per_token: int = Field(gt=0, description="K+V bytes per token over all layers (full size)")
    kv_capacity_blocks: int = Field(gt=0, description="paged KV cache size in blocks")
    max_num_seqs: int = Field(256, gt=0, description="max running sequences (continuous batching)")
    max_num_batched_tokens: int = Field(8192, gt=0, description="token budget of one engine step")
    max_model_len: int = Field(32768, gt=0, description="longest prompt + reply the model accepts")

    prefill_tokens_per_s: float = Field(gt=0, description="linear (MLP/projection) prefill throughput")
    prefill_attention_s_per_token2: float = Field(
        ge=0, description="attention cost: seconds per (new token × context token) pair"
    )
    prefill_overhead_s: float = Field(0.0, ge=0)

    decode_step_base_s: float = Field(gt=0, description="one decode step of a batch of one")
    decode_step_per_seq_s: float = Field(0.0, ge=0)
    decode_step_per_context_token_s: float = Field(0.0, ge=0, description="KV reads per step")

    links_gbps: dict[str, float] = Field(default_factory=lambda: {"rdma": 400.0, "tcp": 25.0})
    transfer_setup_s: float = Field(0.002, ge=0, description="per-pull fixed cost (handshake, registration)")
    cpu_tier_gbps: float = Field(100.0, gt=0, description="host→GPU copy speed for a CPU-tier hit")

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill of ``new_tokens`` after ``cached_tokens`` already in KV: linear + attention."""
        if new_tokens <= 0:
            return 0.0
        linear = new_tokens / self.prefill_tokens_per_s
        attention = self.prefill_attention_s_per_token2 * new_tokens * (cached_tokens + new_tokens / 2)
        return self.prefill_overhead_s + linear + attention

    def decode_step_seconds(self, batch_size: int, context_tokens: int) -> float:
        """One decode step producing one token for each of ``batch_size`` sequences."""
        return (
            self.decode_step_base_s
            + self.decode_step_per_seq_s * max(batch_size - 1, 0)
            + self.decode_step_per_context_token_s * context_tokens
        )

    def transfer_seconds(self, tokens: int, link: str = "rdma") -> float:
        """Moving the full-size KV of ``tokens`` between nodes over ``link``."""
        if tokens <= 0:
            return 0.0
        gbps = self.links_gbps[link]
        return self.transfer_setup_s + tokens * self.kv_bytes_per_token * 8 / (gbps * 1e9)

    def cpu_tier_load_seconds(self, tokens: int) -> float:
        """Bringing a CPU-tier hit back to the GPU before it can be used."""
        return tokens * self.kv_bytes_per_token * 8 / (self.cpu_tier_gbps * 1e9)


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


@cache
def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (e.g. ``llama-3.1-8b-h100``) or a YAML file by path."""
    path = Path(name_or_path)
    # A bare name ("llama-3.1-8b-h100": its dots are not a suffix) is a shipped profile.
    if path.suffix not in (".yaml", ".yml") and len(path.parts) == 1:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no hardware profile {name_or_path!r}; shipped: {', '.join(shipped_profiles())}")
    return HardwareProfile.model_validate(yaml.safe_load(path.read_text()))
