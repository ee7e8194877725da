"""tools/snapkv_accuracy.py end to end on the reference model, small: the protocol's invariants
(the uncompacted row agrees with itself, compaction holds at most ``keep`` tokens plus what the
window forces, every reported number is a finite probability or perplexity)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _helpers import SHARED, load_tool

REPO = Path(__file__).resolve().parents[1]
MODEL = SHARED / "models" / "kvarn-ref-lm"
TEXT = SHARED / "data" / "code_eval.txt"

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file() or not TEXT.is_file(),
                                reason=f"reference model/data not found under {SHARED}")


def _tool():
    return load_tool("snapkv_accuracy")


@pytest.mark.parametrize("select", ["snapkv", "recent"])
def test_small_run_reports_consistent_rows(select, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "snapkv.json"
    prompt, window = 640, 128
    assert _tool().main(["--model", str(MODEL), "--text", str(TEXT), "--windows", "2", "--prompt", str(prompt),
                         "--continuation", "8", "--presets", "k4v4_g128", "--window", str(window),
                         "--keep", "0.5", "--obs", "8", "--chunk", "256", "--select", select,
                         "--json", str(out)]) in (0, None)
    report = json.loads(out.read_text())
    assert report["tokens_scored"] == 2 * 8 and report["select"] == select
    rows = {r["keep_fraction"]: r for r in report["results"]}
    assert set(rows) == {None, 0.5}
    full, half = rows[None], rows[0.5]
    assert full["tokens_held_after_compaction"] == prompt
    assert full["ppl_rel_vs_uncompacted"] == 0 and full["top1_agree_uncompacted"] == 1
    # whole tiles only: at most keep tokens held (the window alone is below keep here), fewer than before
    assert window <= half["tokens_held_after_compaction"] <= half["keep"] == prompt // 2
    for r in (full, half):
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
        for key in ("top1_agree_unquantized", "top1_accuracy"):
            assert 0 <= r[key] <= 1
    assert "| k4v4_g128 |" in capsys.readouterr().out
