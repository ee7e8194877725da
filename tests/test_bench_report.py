"""Benchmark report and ``kvarn-cutlass bench`` output without a GPU.

Tables are checked cell by cell against the record they come from (the committed H200 record and
fresh random records), derived columns against independent arithmetic, memory per token against the
record layout's byte count written out by hand; plots as PNG files; the CLI's one-line errors.
"""

from __future__ import annotations

import copy
import json
import random
import os
import shutil
import stat
import struct
import sys
from pathlib import Path

import pytest
import torch

from kvarn_cutlass.bench import Section
from kvarn_cutlass.bench.record import record_section, write_json_atomic
from kvarn_cutlass.bench.report import docs_page_markdown, load_record, render_markdown, write_report
from kvarn_cutlass.cli import main

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "docs" / "benchmarks" / "h200.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def _tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``md`` as (header, rows of cells)."""
    tables, lines = [], md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith(("|:---", "|---")):
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def _table(md: str, first_columns: list[str]) -> list[dict[str, str]]:
    found = [(h, rows) for h, rows in _tables(md) if h[:len(first_columns)] == first_columns]
    assert len(found) == 1, f"expected one table starting with {first_columns}"
    header, rows = found[0]
    return [dict(zip(header, r)) for r in rows]


@pytest.fixture()
def h200(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "h200.json"
    shutil.copy(H200, path)
    return path, json.loads(H200.read_text())


# --- tables against the committed H200 record -----------------------------------------------------------------------


def test_decode_table_equals_the_record(h200):
    path, raw = h200
    md = render_markdown(load_record(path))
    res = raw["sections"]["decode"]["results"]
    table = {(int(r["batch"]), int(r["context"])): r for r in _table(md, ["batch", "context"])}
    assert set(table) == {(r["batch"], r["context"]) for r in res["rows"]}
    for row in res["rows"]:
        cells = table[(row["batch"], row["context"])]
        assert float(cells["KVarN graph µs"]) == row["graph_us"]
        assert float(cells["SDPA cuDNN µs"]) == row["sdpa_cudnn_us"]
        assert float(cells["SDPA flash µs"]) == row["sdpa_flash_us"]
        assert abs(float(cells["cuDNN / KVarN"]) - row["sdpa_cudnn_us"] / row["graph_us"]) <= 0.005
        assert abs(float(cells["flash / KVarN"]) - row["sdpa_flash_us"] / row["graph_us"]) <= 0.005
        assert float(cells["SDPA cuDNN graph µs"]) == row["sdpa_cudnn_graph_us"]
        assert abs(float(cells["cuDNN graph / KVarN"]) - row["sdpa_cudnn_graph_us"] / row["graph_us"]) <= 0.005
        # % of the copy ceiling from the compressed bytes read per step, independently of the stored fraction
        pct = row["kvarn_bytes"] / (row["graph_us"] * 1e-6) / 1e9 / res["copy_ceiling_gb_per_s"] * 100
        assert abs(float(cells["% of copy ceiling"]) - pct) <= 0.15
        assert abs(float(cells["fp16 MiB"]) - row["fp16_bytes"] / 2**20) <= 0.05


def test_prefill_section_names_its_timing_when_the_record_has_it(h200):
    path, raw = h200
    raw["sections"]["prefill"]["results"].pop("timing", None)
    path.write_text(json.dumps(raw))
    assert "Timing:" not in render_markdown(load_record(path))
    raw["sections"]["prefill"]["results"]["timing"] = "methods take turns, 5 rounds; medians"
    path.write_text(json.dumps(raw))
    assert "Timing: methods take turns, 5 rounds; medians." in render_markdown(load_record(path))


def test_prefill_table_equals_the_record(h200):
    path, raw = h200
    md = render_markdown(load_record(path))
    res = raw["sections"]["prefill"]["results"]
    table = {(int(r["prompt P"]), int(r["chunk C"]), int(r["head_dim"])): r for r in _table(md, ["prompt P", "chunk C", "head_dim", "KVarN ms"])}
    points = res["points"]
    assert set(table) == {(p["P"], p["C"], p["head_dim"]) for p in points}
    for p in points:
        cells = table[(p["P"], p["C"], p["head_dim"])]
        assert float(cells["KVarN ms"]) == p["kvarn_e2e_ms"]
        assert float(cells["SDPA flash ms"]) == p["sdpa_flash_e2e_ms"]
        assert float(cells["dequant+SDPA ms"]) == p["dequant_sdpa_e2e_ms"]
        assert abs(float(cells["KVarN / SDPA flash"]) - p["kvarn_e2e_ms"] / p["sdpa_flash_e2e_ms"]) <= 0.005
        assert abs(float(cells["KVarN / dequant+SDPA"]) - p["kvarn_e2e_ms"] / p["dequant_sdpa_e2e_ms"]) <= 0.005


def test_decode_lloyd_max_rows_render_beside_the_uniform_time(h200):
    path, raw = h200
    res = raw["sections"]["decode"]["results"]
    seed = random.randrange(2**32)
    rng, why = random.Random(seed), f"random.Random({seed})"  # why: in every message, so a failure reproduces
    res["lloyd_max_rows"] = [
        {"batch": r["batch"], "context": r["context"], "graph_us": round(rng.uniform(10, 900), 2),
         "uniform_graph_us": r["graph_us"], "fraction_of_copy_ceiling": round(rng.random(), 3)}
        for r in res["rows"][:3]]
    for r in res["lloyd_max_rows"]:
        r["time_vs_uniform"] = round(r["graph_us"] / r["uniform_graph_us"], 3)
    path.write_text(json.dumps(raw))
    md = render_markdown(load_record(path))
    assert len(_table(md, ["batch", "context"])) == len(res["rows"]), why  # the main table is still the only one
    cells = _table(md, ["quantizer", "batch", "context"])
    assert [(int(c["batch"]), int(c["context"]), float(c["Lloyd-Max graph µs"]), float(c["uniform graph µs"]),
             float(c["Lloyd-Max / uniform"])) for c in cells] == [
        (r["batch"], r["context"], r["graph_us"], r["uniform_graph_us"], r["time_vs_uniform"])
        for r in res["lloyd_max_rows"]], why


def test_compress_table_equals_the_record(h200):
    path, raw = h200
    md = render_markdown(load_record(path))
    comp = raw["sections"]["compress"]["results"]["compress"]
    rows = _table(md, ["preset", "quantizer", "head_dim", "batch"])
    assert [(r["preset"], r["quantizer"], float(r["graph µs"])) for r in rows] == [
        (c["preset"], c.get("quantizer", "uniform"), c["graph_us"]) for c in comp]


def test_a_section_of_removed_code_is_named_not_tabulated(h200):
    """The record keeps the CUTLASS K-score GEMM's historical section; the report names it and has no table of it."""
    path, raw = h200
    assert "gemm" in raw["sections"]
    md = render_markdown(load_record(path))
    others = [line for line in md.splitlines() if line.startswith("Other sections in the record (not tabulated): ")]
    assert len(others) == 1 and "gemm" in others[0].rstrip(".").split(": ", 1)[1].split(", "), others
    assert "K-score GEMM" not in md and not [h for h, _ in _tables(md) if h[0] in ("kernel", "bucket")]


def test_memory_per_token_matches_the_record_layout_by_hand():
    md = render_markdown({"sections": {}})
    rows = _table(md, ["preset", "head_dim", "tokens per tile"])
    bits = {"k4v2_g128": (4, 2, 128), "k4v4_g128": (4, 4, 128), "k4v2_g64": (4, 2, 64), "k4v4_g64": (4, 4, 64)}
    assert {(r["preset"], int(r["head_dim"])) for r in rows} == {(p, d) for p in bits for d in (64, 128, 256)}
    for r in rows:
        kb, vb, t = bits[r["preset"]]
        d = int(r["head_dim"])
        # codes (K and V), three fp16 vectors over channels and three over tokens per record
        record = d * t * (kb + vb) // 8 + 3 * 2 * d + 3 * 2 * t
        assert int(r["record bytes"]) == record
        assert float(r["bytes / token"]) == record / t
        assert int(r["fp16 bytes / token"]) == 2 * 2 * d
        assert abs(float(r["fp16 / KVarN"]) - 4 * d / (record / t)) <= 0.005


# --- fresh random records -----------------------------------------------------------------------------------------


def _random_record(rng: random.Random) -> dict:
    prov = {"gpu": "NVIDIA Test GPU", "compute_capability": "9.0", "date": "2031-02-03T04:05:06+00:00"}
    rows = []
    for batch in rng.sample([1, 2, 4, 8, 16, 32], 2):
        for ctx in rng.sample([1024, 2048, 4096, 8192, 65536], 3):
            row = {"batch": batch, "context": ctx, "graph_us": round(rng.uniform(5, 3000), 2),
                   "sdpa_cudnn_us": round(rng.uniform(5, 3000), 2), "kvarn_bytes": rng.randint(1, 2**30)}
            if rng.random() < 0.5:
                row["sdpa_flash_us"] = round(rng.uniform(5, 3000), 2)
            rows.append(row)
    points = [{"P": p, "C": c, "head_dim": 128, "kvarn_e2e_ms": round(rng.uniform(1, 500), 3),
               "sdpa_flash_e2e_ms": round(rng.uniform(1, 500), 3)} for p in (4096, 8192) for c in (256, 1024)]
    return {"sections": {"decode": {"provenance": prov, "results": {"rows": rows}},
                         "prefill": {"provenance": prov, "results": {"points": points}},
                         "mystery": {"provenance": prov, "results": {"x": 1}}}}


def test_random_record_cells_and_missing_fields(tmp_path):
    seed = random.randrange(2**32)
    rng, why = random.Random(seed), f"random.Random({seed})"  # why: in every message, so a failure reproduces
    doc = _random_record(rng)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    md = render_markdown(load_record(path))
    table = {(int(r["batch"]), int(r["context"])): r for r in _table(md, ["batch", "context"])}
    for row in doc["sections"]["decode"]["results"]["rows"]:
        cells = table[(row["batch"], row["context"])]
        assert float(cells["KVarN graph µs"]) == row["graph_us"], why
        assert abs(float(cells["cuDNN / KVarN"]) - row["sdpa_cudnn_us"] / row["graph_us"]) <= 0.005, why
        if "sdpa_flash_us" in row:
            assert abs(float(cells["flash / KVarN"]) - row["sdpa_flash_us"] / row["graph_us"]) <= 0.005, why
        else:
            assert cells["SDPA flash µs"] == cells["flash / KVarN"] == "-", why
        assert cells["KVarN eager µs"] == cells["% of copy ceiling"] == "-", why
    prefill = _table(md, ["prompt P", "chunk C", "head_dim", "KVarN ms"])
    assert sorted((int(r["prompt P"]), int(r["chunk C"]), float(r["KVarN ms"])) for r in prefill) == sorted(
        (p["P"], p["C"], p["kvarn_e2e_ms"]) for p in doc["sections"]["prefill"]["results"]["points"]), why
    assert all(r["dequant+SDPA ms"] == "-" for r in prefill), why
    assert "mystery" in md.splitlines()[-1], why
    assert "2031-02-03T04:05:06+00:00" in md, why


def test_append_rows_and_prefill_compress_render_as_recorded(tmp_path):
    seed = random.randrange(2**32)
    rng, why = random.Random(seed), f"random.Random({seed})"
    keys = ("gpu_us", "host_us", "amortized_gpu_us", "amortized_host_us", "checked_us", "static_fp16_gpu_us",
            "static_fp16_host_us")
    rows = []
    for batch in (1, 16):
        row = {"batch": batch, **{k: round(rng.uniform(0.5, 300), 3) for k in keys}}
        del row[rng.choice(keys)]  # a missing field renders as "-"
        rows.append(row)
    pre = {"prompt_tokens": 16384, "chunk_tokens": 512, "prefill_compress_ms": round(rng.uniform(0.2, 20), 3),
           "gpu_ms": round(rng.uniform(0.2, 20), 3), "host_ms": round(rng.uniform(0.2, 20), 3), "target_ms": 1.0}
    prov = {"gpu": "NVIDIA H200", "date": "2031-02-03T04:05:06+00:00"}
    doc = {"sections": {"append": {"provenance": prov, "results": {"rows": rows, "targets": {"gpu_us": 5.0}}},
                        "compress": {"provenance": prov, "results": {"compress": [], "prefill_compress": pre}}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    md = render_markdown(load_record(path))
    cells = _table(md, ["batch", "GPU µs", "host µs"])
    columns = ("GPU µs", "host µs", "GPU µs (128, amortized)", "host µs (128, amortized)", "checked µs",
               "static fp16 GPU µs", "static fp16 host µs")
    assert [int(c["batch"]) for c in cells] == [1, 16], why
    for row, cell in zip(rows, cells):
        for key, col in zip(keys, columns):
            assert (float(cell[col]) == row[key]) if key in row else cell[col] == "-", (why, key)
    assert f"{pre['prefill_compress_ms']} ms on the stream" in md and f"GPU alone {pre['gpu_ms']} ms" in md, why
    assert "Other sections" not in md, why


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ('{"sections": {"decode": {"rows": []}}}', "is not a benchmark record"),
    ("[1, 2]", "is not a benchmark record"),
])
def test_load_record_rejects_non_records(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_record(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_record(tmp_path / "absent.json")


# --- plots --------------------------------------------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_valid_pngs(h200, tmp_path):
    pytest.importorskip("matplotlib")
    path, raw = h200
    written, notice = write_report(load_record(path), tmp_path / "out")
    assert notice is None
    names = sorted(p.name for p in written)
    batches = sorted({r["batch"] for r in raw["sections"]["decode"]["results"]["rows"]})
    assert names == sorted(["results.md", "prefill.png", "memory_per_token.png"]
                           + [f"decode_b{b}.png" for b in batches])
    md = (tmp_path / "out" / "results.md").read_text()
    for p in written:
        if p.suffix == ".png":
            width, height = _png_size(p)
            assert (width, height) == (640, 400)
            assert 5_000 < p.stat().st_size < 300_000
            assert f"]({p.name})" in md  # linked from the tables


def test_prefill_plot_is_planned_only_for_points_it_draws(h200):
    """The prefill plot draws head_dim-128 points: a record whose only timed point is the head_dim-256 one
    plans no prefill plot (it would be empty), and one head_dim-128 point is enough to plan it."""
    from kvarn_cutlass.bench.plots import planned_plots

    path, raw = h200
    res = raw["sections"]["prefill"]["results"]
    d256 = [p for p in res["points"] if p["head_dim"] == 256]
    d128 = [p for p in res["points"] if p["head_dim"] == 128]
    assert d256 and d256[0]["kvarn_e2e_ms"] is not None and d128
    path.write_text(json.dumps({**raw, "sections": {"prefill": {**raw["sections"]["prefill"],
                                                                "results": {**res, "points": d256}}}}))
    assert "prefill" not in planned_plots(load_record(path))
    path.write_text(json.dumps({**raw, "sections": {"prefill": {**raw["sections"]["prefill"],
                                                                "results": {**res, "points": d256 + d128[:1]}}}}))
    assert planned_plots(load_record(path))["prefill"] == ["prefill.png"]


def test_without_matplotlib_tables_are_written_with_a_notice(h200, tmp_path, monkeypatch, capsys):
    path, _ = h200
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    written, notice = write_report(load_record(path), tmp_path / "a")
    assert [p.name for p in written] == ["results.md"]
    assert "pip install 'kvarn-cutlass[plots]'" in notice and "\n" not in notice
    assert "![" not in (tmp_path / "a" / "results.md").read_text()
    assert main(["bench", "--from-json", str(path), "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kvarn-cutlass[plots]" in err[0]
    assert (tmp_path / "b" / "results.md").is_file()


def test_docs_page_is_generated_from_the_h200_record():
    """docs/benchmarks.md is what tools/benchmarks_doc.py renders from docs/benchmarks/h200.json (rerun it
    after a new record), and every plot it links is committed."""
    doc = load_record(H200)
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert page == docs_page_markdown(doc, "h200"), "stale: run python3 tools/benchmarks_doc.py"
    links = [line.split("](")[1].rstrip(")") for line in page.splitlines() if line.startswith("![")]
    assert links and all((REPO / "docs" / link).is_file() for link in links)
    dates = {s["provenance"]["date"] for s in doc["sections"].values()}
    assert all(d in page for d in dates)


# --- the bench command ---------------------------------------------------------------------------------------------


def _one_line_error(capsys, *names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for name in names:
        assert name in err
    return err


@no_gpu
def test_bench_without_a_gpu_is_a_one_line_error(capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path / "out")]) == 1
    _one_line_error(capsys, "CUDA GPU")
    assert not (tmp_path / "out").exists()


def test_bench_from_json_renders_without_a_gpu(h200, tmp_path, capsys):
    path, raw = h200
    out = tmp_path / "out"
    assert main(["bench", "--from-json", str(path), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out"] == str(out) and Path(report["files"][0]) == out / "results.md"
    rows = _table((out / "results.md").read_text(), ["batch", "context"])
    assert len(rows) == len(raw["sections"]["decode"]["results"]["rows"])


def test_bench_from_json_section_filter(h200, tmp_path):
    path, _ = h200
    assert main(["bench", "--from-json", str(path), "--out", str(tmp_path), "--section", "prefill", "--no-plots"]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "## Prefill" in md and "## Decode" not in md
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("args, names", [
    (["--from-json", "{tmp}/absent.json"], ["--from-json", "absent.json"]),
    (["--from-json", "{tmp}/garbage.json"], ["--from-json", "not JSON"]),
    (["--section", "nope"], ["--section", "nope"]),
    (["--from-json", "{h200}", "--section", "nope"], ["--section", "nope"]),
    (["--from-json", "{h200}", "--out", "{tmp}/garbage.json"], ["--out", "not a folder"]),
])
def test_bench_bad_arguments_are_one_line_errors(h200, tmp_path, capsys, args, names):
    (tmp_path / "garbage.json").write_text("{")
    args = [a.format(tmp=tmp_path, h200=h200[0]) for a in args]
    assert main(["bench", *args]) == 1
    _one_line_error(capsys, *names)


def test_bench_runs_sections_records_and_reports(tmp_path, monkeypatch, capsys):
    """The run loop with stand-in sections (no GPU): progress lines, results.json with provenance, the merged
    record, a failing section that costs the others nothing and makes the exit status non-zero."""
    import kvarn_cutlass.bench as bench
    import kvarn_cutlass.bench.record as record

    raw = json.loads(H200.read_text())
    decode = copy.deepcopy(raw["sections"]["decode"]["results"])
    seed = random.randrange(2**32)
    rng, why = random.Random(seed), f"random.Random({seed})"  # why: in every message, so a failure reproduces
    for row in decode["rows"]:
        row["graph_us"] = round(rng.uniform(5, 500), 2)

    def broken(opts):
        raise RuntimeError("boom")

    fake = {"decode": Section("decode", lambda opts: decode, "stand-in"),
            "copy": Section("copy", broken, "stand-in that fails")}
    prov = {"gpu": "NVIDIA Test GPU", "compute_capability": "9.0", "date": "2031-01-01T00:00:00+00:00"}
    monkeypatch.setattr(bench, "sections", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(record, "provenance", lambda: prov)
    monkeypatch.setattr(record, "default_record_path", lambda d=None: Path(d) / "test-gpu.json")
    out = tmp_path / "out"
    rc = main(["bench", "--out", str(out), "--record-dir", str(tmp_path / "rec"), "--no-plots"])
    assert rc == 1, why
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("bench [")]
    assert progress[0].startswith("bench [1/2] copy: running") and progress[1].startswith("bench [1/2] copy: FAILED"), why
    assert progress[2].startswith("bench [2/2] decode: running") and progress[3].startswith("bench [2/2] decode: done"), why
    assert "failed sections: copy: RuntimeError: boom" in captured.err, why
    results = load_record(out / "results.json")
    assert results["sections"] == {"decode": {"provenance": prov, "results": decode}}, why
    assert results["failed"] == ["copy: RuntimeError: boom"], why
    merged = load_record(tmp_path / "rec" / "test-gpu.json")
    assert merged["sections"]["decode"]["results"] == decode, why
    table = {(int(r["batch"]), int(r["context"])): r for r in _table((out / "results.md").read_text(), ["batch", "context"])}
    assert all(float(table[(r["batch"], r["context"])]["KVarN graph µs"]) == r["graph_us"] for r in decode["rows"]), why


def test_bench_a_failed_record_merge_costs_the_other_sections_nothing(tmp_path, monkeypatch, capsys):
    """A section whose merge into the docs/benchmarks record fails is reported like a failed section: its
    numbers stay in results.json, the next sections run and are merged, the exit status is non-zero."""
    import kvarn_cutlass.bench as bench
    import kvarn_cutlass.bench.record as record

    seed = random.randrange(2**32)
    rng, why = random.Random(seed), f"random.Random({seed})"  # why: in every message, so a failure reproduces
    results = {name: {"x": round(rng.uniform(1, 100), 3)} for name in ("decode", "prefill")}
    fake = {name: Section(name, lambda opts, name=name: results[name], "stand-in") for name in results}
    prov = {"gpu": "NVIDIA Test GPU", "compute_capability": "9.0", "date": "2031-01-01T00:00:00+00:00"}
    record_merge = record.record_section

    def merge_fails_for_prefill(name, res, path, provenance, merge=None):  # the first section to run
        if name == "prefill":
            raise OSError("disk full")
        record_merge(name, res, path, provenance, merge=merge)

    monkeypatch.setattr(bench, "sections", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(record, "provenance", lambda: prov)
    monkeypatch.setattr(record, "default_record_path", lambda d=None: Path(d) / "test-gpu.json")
    monkeypatch.setattr(record, "record_section", merge_fails_for_prefill)
    out, rec = tmp_path / "out", tmp_path / "rec" / "test-gpu.json"
    assert main(["bench", "--out", str(out), "--record-dir", str(rec.parent), "--no-plots"]) == 1, why
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("bench [")]
    assert progress[1].startswith("bench [1/2] prefill: done") and progress[3].startswith("bench [2/2] decode: done"), why
    failure = f"prefill: merging into {rec}: OSError: disk full"
    assert f"failed sections: {failure}" in captured.err, why
    written = load_record(out / "results.json")
    assert written["failed"] == [failure], why
    assert written["sections"] == {n: {"provenance": prov, "results": r} for n, r in results.items()}, why
    merged = load_record(rec)
    assert set(merged["sections"]) == {"decode"} and merged["sections"]["decode"]["results"] == results["decode"], why


def test_progress_on_a_terminal_refreshes_one_line():
    import io
    import re
    import time

    from kvarn_cutlass.cli.bench import _Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = _Progress(3, stream)
    t = progress.start(2, "prefill")
    deadline = time.monotonic() + 30
    while "\r" not in stream.getvalue() and time.monotonic() < deadline:  # wait for one refresh, however slow
        time.sleep(0.05)
    progress.done(2, "prefill", t, "done")
    text = stream.getvalue()
    assert re.fullmatch(r"bench \[2/3\] prefill: \d+:\d\d \(total \d+:\d\d\)"
                        r"(\rbench \[2/3\] prefill: \d+:\d\d \(total \d+:\d\d\)\033\[K)+"
                        r"\r\033\[Kbench \[2/3\] prefill: done in \d+:\d\d \(total \d+:\d\d\)\n", text), text


@pytest.mark.gpu
def test_bench_copy_section_end_to_end_on_the_gpu(tmp_path, capsys):
    """The real run loop on a GPU (the quick copy section): results.json with this GPU's provenance, tables."""
    out = tmp_path / "out"
    assert main(["bench", "--section", "copy", "--quick", "--out", str(out), "--no-record", "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert "bench [1/1] copy: done" in err
    doc = load_record(out / "results.json")
    assert doc["failed"] == [] and list(doc["sections"]) == ["copy"]
    assert doc["sections"]["copy"]["provenance"]["gpu"] == torch.cuda.get_device_name()
    rows = _table((out / "results.md").read_text(), ["MiB", "median µs"])
    assert len(rows) == len(doc["sections"]["copy"]["results"]["sizes"]) > 0


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o077])
def test_records_follow_the_umask_and_replace_atomically(tmp_path, mask):
    """Records and results.json used to be written 0600 (tempfile.mkstemp) whatever the umask."""
    old = os.umask(mask)
    try:
        path = tmp_path / "sub" / "h200.json"
        record_section("copy", {"a": 1}, path, prov={"gpu": "x"})
        record_section("launch", {"b": [2.5]}, path, prov={"gpu": "y"})
        write_json_atomic(tmp_path / "results.json", {"z": 1, "a": [None]})
    finally:
        os.umask(old)
    for p in (path, tmp_path / "results.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask
    doc = json.loads(path.read_text())
    assert doc == {"sections": {"copy": {"provenance": {"gpu": "x"}, "results": {"a": 1}},
                                "launch": {"provenance": {"gpu": "y"}, "results": {"b": [2.5]}}}}
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": [None], "z": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["h200.json"]  # no temporary left


def test_a_failed_record_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "h200.json"
    write_json_atomic(path, {"sections": {}})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"sections": {"x": object()}})  # not JSON-serializable
    assert json.loads(path.read_text()) == {"sections": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["h200.json"]
