"""``codec.unpack_codes``, the one unpacking of the record's code bytes, against the documented layout
(format.py: two 4-bit K codes per byte with the even token in the low nibble, V codes lowest bits first)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvarn_cutlass import codec


def test_hand_made_bytes():
    b = torch.tensor([[0x21, 0xA5], [0xE4, 0x1B]], dtype=torch.uint8)
    assert codec.unpack_codes(b, 4).tolist() == [[1, 2, 5, 10], [4, 14, 11, 1]]
    assert codec.unpack_codes(b[1:], 2).tolist() == [[0, 1, 2, 3, 3, 2, 1, 0]]
    assert codec.unpack_codes(torch.tensor([0b10000001], dtype=torch.uint8), 1).tolist() == [1, 0, 0, 0, 0, 0, 0, 1]
    assert codec.unpack_codes(b, 8).tolist() == b.tolist()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_inverts_the_layouts_packing_by_hand(bits, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (3, 5, 64))
    per = 8 // bits
    packed = sum(codes[..., j::per] << (bits * j) for j in range(per)).astype(np.uint8)  # code j at bit j*bits
    got = codec.unpack_codes(torch.from_numpy(packed), bits)
    assert got.dtype == torch.uint8 and got.shape == (3, 5, 64)
    assert np.array_equal(got.numpy(), codes), f"seed={seed}"


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="packed must be a uint8"):
        codec.unpack_codes(torch.zeros(4, dtype=torch.int8), 4)
    with pytest.raises(TypeError, match="packed must be a uint8"):
        codec.unpack_codes([1, 2], 4)
    for bits in (3, 0, 16, True):
        with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8"):
            codec.unpack_codes(torch.zeros(4, dtype=torch.uint8), bits)
