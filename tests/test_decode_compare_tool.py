"""tools/decode_compare.py on two synthetic decode records (no GPU): rows matched by shape, ratios computed from
the records' own numbers, a cross-GPU comparison refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _helpers import load_tool


def _record(path, gpu, commit, rows, lm_rows):
    section = {"provenance": {"gpu": gpu, "git_commit": commit, "date": "2026-12-08"},
               "results": {"rows": rows, "lloyd_max_rows": lm_rows}}
    path.write_text(json.dumps({"sections": {"decode": section}}))
    return str(path)


def _rows(rng, shapes):
    return [{"batch": b, "context": t, "graph_us": float(rng.uniform(5, 600)), "floor_us": float(rng.uniform(1, 400)),
             "sdpa_cudnn_graph_us": float(rng.uniform(10, 2000))} for b, t in shapes]


def test_compare_matches_rows_by_shape_and_computes_ratios(tmp_path, capsys):
    tool = load_tool("decode_compare")
    rng = np.random.default_rng(1207)
    base_rows = _rows(rng, [(1, 4096), (1, 131072), (16, 32768)])
    new_rows = _rows(rng, [(16, 32768), (1, 4096), (16, 131072)])  # other order; one shape each not shared
    lm_b = [{"batch": 1, "context": 4096, "graph_us": 12.0, "time_vs_uniform": 1.2}]
    lm_c = [{"batch": 1, "context": 4096, "graph_us": 11.0, "time_vs_uniform": 1.25}]
    a = _record(tmp_path / "a.json", "H100", "aaa", base_rows, lm_b)
    b = _record(tmp_path / "b.json", "H100", "bbb", new_rows, lm_c)
    out = tmp_path / "cmp.json"
    assert tool.main([a, b, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in got["rows"]] == [(1, 4096), (16, 32768)]
    by = {(r["batch"], r["context"]): r for r in new_rows}
    ba = {(r["batch"], r["context"]): r for r in base_rows}
    for r in got["rows"]:
        s = (r["batch"], r["context"])
        assert r["changed_over_baseline"] == pytest.approx(by[s]["graph_us"] / ba[s]["graph_us"], abs=1e-4)
        assert r["changed_cudnn_ratio"] == pytest.approx(by[s]["sdpa_cudnn_graph_us"] / by[s]["graph_us"], abs=1e-3)
        assert r["baseline_floor_fraction"] == pytest.approx(ba[s]["floor_us"] / ba[s]["graph_us"], abs=1e-3)
    assert got["lloyd_max_rows"][0]["changed_over_baseline"] == pytest.approx(11.0 / 12.0, abs=1e-4)
    assert got["baseline"]["git_commit"] == "aaa" and got["changed"]["git_commit"] == "bbb"
    assert "commit bbb" in capsys.readouterr().out


def test_compare_refuses_two_gpus_and_a_record_without_decode(tmp_path):
    tool = load_tool("decode_compare")
    rows = _rows(np.random.default_rng(3), [(1, 4096)])
    a = _record(tmp_path / "a.json", "H100", "a", rows, [])
    b = _record(tmp_path / "b.json", "H200", "b", rows, [])
    with pytest.raises(SystemExit, match="different GPUs"):
        tool.main([a, b])
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"sections": {"prefill": {}}}))
    with pytest.raises(SystemExit, match="no decode section"):
        tool.main([a, str(empty)])
