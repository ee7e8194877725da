"""Bits per cached element of each preset with float16 vs float32 scales, recomputed from the format.

One record holds T tokens x D channels of K and of V (2*T*D elements): codes of k_bits and v_bits
each, plus 3*D + 3*T scales (K: chan_step, chan_min [D], row_scale [T]; V: tok_step, tok_min [T],
col_scale [D]). The README's "bits per element" table (head_dim 128) must match these numbers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import kvarn_cutlass as kc

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE_HEADER = "| preset | bits/element, f16 scales | bits/element, f32 scales | saved by f16 scales |"


def bits_per_element(spec: kc.TileSpec) -> float:
    return spec.tile_nbytes * 8 / (2 * spec.tile_tokens * spec.head_dim)


def expected_bits(preset: str, head_dim: int, scale_bits: int) -> float:
    k_bits, v_bits, T = kc.PRESETS[preset]
    D = head_dim
    return (k_bits * T * D + v_bits * T * D + (3 * D + 3 * T) * scale_bits) / (2 * T * D)


@pytest.mark.parametrize("preset", sorted(kc.PRESETS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bits_per_element_from_the_record_layout(preset, head_dim):
    f16 = kc.TileSpec(preset, head_dim, torch.float16)
    f32 = kc.TileSpec(preset, head_dim, torch.float32)
    assert bits_per_element(f16) == expected_bits(preset, head_dim, 16)
    assert bits_per_element(f32) == expected_bits(preset, head_dim, 32)
    # the sections add up to the record (no padding) and the saving is exactly the scales' half
    assert sum(f16.section(n)[1] for n in f16.section_names()) == f16.tile_nbytes
    T = f16.tile_tokens
    assert bits_per_element(f32) - bits_per_element(f16) == (3 * head_dim + 3 * T) * 16 / (2 * T * head_dim)
    assert 16 / bits_per_element(f16) == pytest.approx(f16.compression_vs_fp16, rel=1e-12)


def _readme_rows() -> dict[str, list[str]]:
    text = README.read_text(encoding="utf-8")
    assert TABLE_HEADER in text, f"README.md has no bits-per-element table (header {TABLE_HEADER!r})"
    rows = {}
    for line in text[text.index(TABLE_HEADER):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    return rows


def test_readme_table_matches_the_format():
    rows = _readme_rows()
    assert set(rows) == set(kc.PRESETS)
    for preset, cells in rows.items():
        b16 = bits_per_element(kc.TileSpec(preset, 128, torch.float16))
        b32 = bits_per_element(kc.TileSpec(preset, 128, torch.float32))
        assert float(cells[1]) == b16 and float(cells[2]) == b32
        saved, pct = re.match(r"([\d.]+) \(([\d.]+)%\)", cells[3]).groups()
        assert float(saved) == b32 - b16 and float(pct) == round(100 * (b32 - b16) / b32, 1)
        ratios = [float(x) for x in re.findall(r"([\d.]+)x", cells[4])]
        assert ratios == [round(16 / b16, 2), round(16 / b32, 2)]
