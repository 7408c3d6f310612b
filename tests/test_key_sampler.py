"""The stride rule answers the same for a uint64 array (the gateway's keys) as for a list, at any stride."""

from __future__ import annotations

import numpy as np
import pytest

from directory_client.sampling import KeySampler


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 6, 8, 16])
def test_array_and_list_pick_the_same_keys(stride: int) -> None:
    rng = np.random.default_rng(stride)
    keys = rng.integers(0, np.iinfo(np.int64).max, 600, dtype=np.int64).astype(np.uint64) * np.uint64(3)
    keys[::7] |= np.uint64(1 << 63)  # the top bit set too: keys are full 64-bit hashes
    as_list = [int(k) for k in keys]
    expected = [i for i, k in enumerate(as_list) if k % stride == 0]
    kept, positions = KeySampler(stride).select_positions(keys)
    assert kept == [as_list[i] for i in expected]
    assert (positions if positions is not None else list(range(len(keys)))) == expected
    assert KeySampler(stride).select_positions(keys) == KeySampler(stride).select_positions(as_list)
    assert 0 < len(expected) < len(keys) or stride == 1
