"""``bench --section e2e`` without a GPU: the memory arithmetic against what the library and transformers
allocate, the granted context at the edge of its budget, the plan against the H200's memory, the README
headline block and plot generated from a record, the fp16 prefill and decode baselines (the decode attention
and its FlashAttention-2 varlen problem against float64 attention over the filled prefix)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from kvarn_cutlass.bench import e2e
from kvarn_cutlass.cache import KVarNCache

from _helpers import prefix_attention_f64

H200_GIB = 139


def _tensor_bytes(cache: KVarNCache) -> int:
    """Every tensor a fresh cache holds (the per-layer lengths are views of the cache's own)."""
    total = cache.device_lengths().nbytes + cache._errors.nbytes + cache._counter.nbytes
    for st in cache._layers:
        total += sum(t.nbytes for t in (st.tiles, st.tile_table, st.window_k, st.window_v, st.sink_k, st.sink_v))
    return total


@pytest.mark.parametrize("tokens,layers,batch,heads,dim,preset,window,sink", [
    (1000, 2, 1, 2, 128, "k4v2_g128", 256, 0),
    (1024, 3, 2, 1, 64, "k4v4_g64", 128, 64),
    (129, 1, 3, 4, 256, "k4v2_g128", 128, 128),
    (5, 2, 1, 2, 128, "k4v2_g64", 64, 0),
])
def test_kvarn_cache_bytes_is_what_the_cache_allocates(tokens, layers, batch, heads, dim, preset, window, sink):
    cache = KVarNCache(layers, batch, heads, dim, preset=preset, window=window, sink_tokens=sink, max_seq_len=tokens)
    assert e2e.kvarn_cache_bytes(tokens, layers, batch, heads, dim, preset, window, sink) == _tensor_bytes(cache)


def test_fp16_cache_bytes_and_backups_are_what_transformers_and_the_cache_allocate():
    from transformers import Qwen3Config, StaticCache

    config = Qwen3Config(**{**e2e.QWEN3_8B, "num_hidden_layers": 3})
    static = StaticCache(config=config, max_cache_len=50)
    static.early_initialization(2, 8, 128, torch.float16, torch.device("cpu"))
    held = sum(la.keys.nbytes + la.values.nbytes + la.cumulative_length.nbytes for la in static.layers)
    assert held == e2e.fp16_cache_bytes(50, 3, 2, 8, 128)
    cache = KVarNCache(3, 2, 8, 128, window=256, max_seq_len=600)
    before = cache.allocated_nbytes()
    for layer in range(3):
        cache._backup(layer)  # what a step graph allocates per layer
    assert cache.allocated_nbytes() - before == e2e.backup_bytes(3, 2, 8, 128)


@pytest.mark.parametrize("budget,layers,heads,window", [(3_000_000, 2, 2, 256), (2 * 10**8, 36, 8, 256), (40_000_000, 3, 1, 128)])
def test_granted_context_is_the_longest_that_fits(budget, layers, heads, window):
    g = e2e.granted_context(budget, layers, heads, 128, window=window)
    kv = lambda n: e2e.kvarn_cache_bytes(n, layers, 1, heads, 128, window=window)  # noqa: E731
    fp = lambda n: e2e.fp16_cache_bytes(n, layers, 1, heads, 128)  # noqa: E731
    assert kv(g["kvarn"]) <= budget < kv(g["kvarn"] + 1)
    assert fp(g["fp16"]) <= budget < fp(g["fp16"] + 1)
    cache = KVarNCache(layers, 1, heads, 128, window=window, max_seq_len=g["kvarn"])
    assert _tensor_bytes(cache) <= budget


def test_the_headline_shape_grants_over_4_5x_the_fp16_context():
    # k4v2_g128 records are 108 B/token/head against 512 for fp16 (4.74x); the fixed window costs a little of it
    for gib in e2e.BUDGETS_GIB:
        g = e2e.granted_context(gib * e2e.GIB, 36, 8, 128)
        assert 4.5 < g["kvarn"] / g["fp16"] < 512 / 108


@pytest.mark.parametrize("tie", [True, False])
def test_weight_bytes_is_the_models_parameter_bytes(tie):
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = {**e2e.QWEN3_8B, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": tie}
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float16)
    assert e2e.weight_bytes(shape) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_full_plan_fits_an_h200_by_the_estimate():
    """Batch 16 at 16k with 36 layers (and the sweep's points) within the H200's memory, with a tenth to spare."""
    p = e2e.FULL
    assert (p.layers, p.prompt, p.new_tokens, max(p.batches)) == (36, 16384, 300, 16)
    for kind in e2e.KINDS:
        for batch in p.batches:
            for chunk in p.chunks:
                assert e2e.estimate_bytes(kind, p.layers, batch, p.prompt + p.new_tokens, chunk) < 0.9 * H200_GIB * e2e.GIB
        for batch, contexts in p.sweep:
            for context in contexts:
                need = e2e.estimate_bytes(kind, p.layers, batch, context + p.sweep_steps + 2, 1)
                assert need < 0.9 * H200_GIB * e2e.GIB, (kind, batch, context)
    # the estimate's fp16 cache at batch 16 is the 39.4 GB the module docstring states
    assert math.isclose(e2e.fp16_cache_bytes(16684, 36, 16, 8, 128) / 1e9, 39.36, abs_tol=0.01)


def _record(quick: bool = False) -> dict:
    rows = [{"batch": 1, "prompt": 16384, "chunk": 512, "new_tokens": 300, "ttft_ms_kvarn": 100.0, "ttft_ms_fp16": 150.0,
             "decode_tok_s_kvarn": 30.0, "decode_tok_s_fp16": 20.0, "decode_fp16_baseline": "flash_varlen",
             "peak_mem_gib_kvarn": 17.2, "peak_mem_gib_fp16": 19.4},
            {"batch": 16, "prompt": 16384, "chunk": 2048, "new_tokens": 300, "ttft_ms_kvarn": 900.0,
             "error_fp16": "OutOfMemoryError: CUDA out of memory"}]
    sweep = [{"batch": b, "context": c, "decode_tok_s_kvarn": 40.0 * b / (1 + c / 65536), "decode_tok_s_fp16": 35.0 * b / (1 + c / 16384),
              "decode_fp16_baseline": "flash_varlen"} for b in (1, 16) for c in (1024, 4096, 16384, 32768)]
    granted = [{"budget_gib": 8, "layers": 36, "kvarn_tokens": 274944, "fp16_tokens": 58254, "ratio": 4.72, "fits": True}]
    shape = {**e2e.QWEN3_8B, "num_hidden_layers": 4 if quick else 36, "preset": "k4v2_g128", "window": 256}
    res = {"shape": shape, "plan": {"prompt": 4096 if quick else 16384}, "quick": quick, "rows": rows,
           "decode_sweep": sweep, "granted_context": granted}
    res["bars"] = e2e._bars(res)
    prov = {"gpu": "NVIDIA H200", "date": "2026-12-02T10:00:00+00:00", "git_commit": "abc123"}
    return {"sections": {"e2e": {"provenance": prov, "results": res}}}


def test_headline_table_shows_the_stored_numbers_and_their_ratios():
    md = e2e.headline_markdown(_record(), plot="docs/benchmarks/h200-e2e_decode.png")
    assert "| 1 | 16384 + 300 | 512 | 100.0 | 150.0 | 1.50x | 30.0 | 20.0 (flash_varlen) | 1.50x | 17.2 / 19.4 |" in md
    assert f"fp16 decode baseline: flash_varlen: {e2e.FP16_DECODE_BASELINES['flash_varlen']}." in md
    assert "static_sdpa" not in md
    assert "| 16 | 16384 + 300 | 2048 | 900.0 | - | - | - | - | - | - / - |" in md
    assert "batch 16 chunk 2048 fp16: OutOfMemoryError" in md
    assert "8 GiB: KVarN 274,944 tokens, fp16 58,254 (4.72x)" in md
    assert "NVIDIA H200, 2026-12-02, commit abc123" in md and "](docs/benchmarks/h200-e2e_decode.png)" in md
    assert "kvarn-cutlass bench --section e2e" in md and "Smoke-test" not in md
    assert "Smoke-test numbers** (a reduced run: 4 layers, 4096-token prompt)" in e2e.headline_markdown(_record(quick=True))
    # a row recorded before decode_fp16_baseline existed decoded through transformers' masked SDPA: named, and flagged
    old = _record()
    del old["sections"]["e2e"]["results"]["rows"][0]["decode_fp16_baseline"]
    md = e2e.headline_markdown(old)
    assert "| 30.0 | 20.0 (static_sdpa) | 1.50x |" in md and "static_sdpa is not the strongest fp16 decode" in md
    assert "flash_varlen: " in md  # the sweep's points still name theirs
    empty = e2e.headline_markdown({"sections": {}})
    assert empty.startswith("Not measured yet") and "kvarn-cutlass bench --section e2e" in empty


def test_bars_follow_the_issue():
    bars = _record()["sections"]["e2e"]["results"]["bars"]
    assert bars == {"b1_c512_ttft_kvarn_le_fp16": True, "b1_c512_decode_kvarn_ge_1.0x_fp16": True,
                    "goal_b16_32k_decode_kvarn_ge_1.5x_fp16": True, "goal_granted_8gib_ge_4.5x": True}


def test_update_readme_replaces_only_the_marked_block():
    text = f"# t\n\nintro\n\n{e2e.README_BEGIN}\nold\n{e2e.README_END}\n\nrest\n"
    new = e2e.update_readme(text, "fresh\ntable")
    assert new == f"# t\n\nintro\n\n{e2e.README_BEGIN}\nfresh\ntable\n{e2e.README_END}\n\nrest\n"
    assert e2e.update_readme(new, "fresh\ntable") == new
    for bad in ("no markers", f"{e2e.README_END}\n{e2e.README_BEGIN}", text + e2e.README_BEGIN):
        with pytest.raises(ValueError, match="markers"):
            e2e.update_readme(bad, "x")


def test_the_readme_carries_the_markers():
    from kvarn_cutlass.bench.record import REPO_ROOT

    if REPO_ROOT is None:
        pytest.skip("not a checkout")
    readme = (REPO_ROOT / "README.md").read_text()
    assert e2e.update_readme(readme, "x")  # the markers are there once each, in order


def test_main_writes_the_plot_and_the_readme_block(tmp_path):
    pytest.importorskip("matplotlib")
    record = tmp_path / "docs" / "benchmarks" / "h200.json"
    record.parent.mkdir(parents=True)
    doc = _record()
    record.write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{e2e.README_BEGIN}\n{e2e.README_END}\n")
    assert e2e.main(["--record", str(record), "--readme", str(readme)]) == 0
    png = record.parent / "h200-e2e_decode.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![decode tokens/s against context](docs/benchmarks/h200-e2e_decode.png)" in readme.read_text()
    # a record without the section leaves the placeholder and draws nothing
    other = copy.deepcopy(doc)
    other["sections"] = {"decode": {"results": {}}}
    record.write_text(json.dumps(other))
    png.unlink()
    assert e2e.main(["--record", str(record), "--readme", str(readme)]) == 0
    assert not png.exists() and "Not measured yet" in readme.read_text()


def test_layer_override_is_checked_before_any_gpu_work(monkeypatch):
    monkeypatch.setenv("KVARN_E2E_LAYERS", "two")
    with pytest.raises(ValueError, match="KVARN_E2E_LAYERS"):
        e2e.run(e2e.BenchOptions(quick=True))


# --- the flash fp16 prefill (the TTFT baseline) -------------------------------------------------------------------------
def _tiny_qwen3():
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = {**e2e.QWEN3_8B, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("chunk", [16, 37, 64])
def test_fp16_prefill_is_transformers_static_cache_prefill(chunk):
    """Against transformers' own chunked prefill of a StaticCache (masked SDPA over the whole buffer): the same last
    logits and the same cache, the model's attention implementation left as it was."""
    from transformers import StaticCache

    from kvarn_cutlass.hf import prefill

    model = _tiny_qwen3()
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(1))
    want_cache = StaticCache(config=model.config, max_cache_len=45)
    want = prefill(model, ids, want_cache, chunk).logits[:, -1]
    cache = StaticCache(config=model.config, max_cache_len=45)
    got = e2e.fp16_prefill(model, ids, cache, chunk)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i, (a, b) in enumerate(zip(cache.layers, want_cache.layers)):
        assert int(a.cumulative_length) == int(b.cumulative_length) == 37
        # layer 0's K/V do not depend on attention; later layers' carry its rounding
        check = torch.testing.assert_close if i else (lambda x, y, **_: torch.equal(x, y) or pytest.fail("layer 0"))
        check(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        check(a.values, b.values, rtol=1e-4, atol=1e-4)


def test_fp16_prefill_refuses_a_used_or_small_cache_and_its_attention_needs_kv_end():
    from transformers import StaticCache

    model = _tiny_qwen3()
    ids = torch.randint(0, 320, (1, 20))
    with pytest.raises(ValueError, match="max_cache_len=10"):
        e2e.fp16_prefill(model, ids, StaticCache(config=model.config, max_cache_len=10), 8)
    cache = StaticCache(config=model.config, max_cache_len=30)
    e2e.fp16_prefill(model, ids, cache, 8)
    with pytest.raises(ValueError, match="empty StaticCache"):
        e2e.fp16_prefill(model, ids, cache, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        e2e.fp16_prefill(model, ids, StaticCache(config=model.config, max_cache_len=30), 0)
    q, kv = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 30, 32)
    for bad in (None, 2, 31, True):
        with pytest.raises(ValueError, match="kv_end"):
            e2e.fp16_prefill_attention(None, q, kv, kv, None, kv_end=bad)


def test_the_faster_fp16_prefill_is_ttft_ms_fp16_and_is_named():
    row = {"ttft_ms_fp16_flash": 80.0, "ttft_ms_fp16_static_sdpa": 120.0}
    e2e._fp16_ttft(row)
    assert (row["ttft_ms_fp16"], row["ttft_fp16_baseline"]) == (80.0, "flash")
    row = {"ttft_ms_fp16_static_sdpa": 120.0, "error_fp16_flash": "OutOfMemoryError"}
    e2e._fp16_ttft(row)
    assert (row["ttft_ms_fp16"], row["ttft_fp16_baseline"]) == (120.0, "static_sdpa")
    doc = _record()
    doc["sections"]["e2e"]["results"]["rows"][0]["ttft_fp16_baseline"] = "flash"
    md = e2e.headline_markdown(doc)
    assert "| 100.0 | 150.0 (flash) | 1.50x |" in md and f"flash: {e2e.FP16_TTFT_BASELINES['flash']}" in md


# --- parts, their estimates and the merge --------------------------------------------------------------------------------
def test_the_full_plan_runs_in_parts_each_of_which_fits_a_device_command():
    p = e2e.FULL
    assert e2e.plan_parts(p) == ["gen-b1-c512", "gen-b1-c2048", "gen-b16-c512", "gen-b16-c2048", "sweep-b1",
                                 "sweep-b16", "granted"]
    pp = e2e.parts_plan(p)
    assert [n for n, _ in pp.parts] == e2e.plan_parts(p)
    assert all(s > 0 for _, s in pp.parts) and all(pp.fixed_s + s < 600 for _, s in pp.parts)
    assert pp.fixed_s + sum(s for _, s in pp.parts) > 600  # why it runs in parts
    est = dict(pp.parts)
    assert est["gen-b16-c512"] > 8 * est["gen-b1-c512"]  # the batch-16 prefills dominate
    assert e2e.parts_plan(p, ["granted"]).fixed_s < pp.fixed_s  # no model, no kernels
    with pytest.raises(ValueError, match=r"part 'gen-b2-c512' .*its parts: gen-b1-c512"):
        e2e.parts_plan(p, ["gen-b2-c512"])


def _part_results(rows=(), sweep=(), granted=(), parts=(), layers=36) -> dict:
    res = {"shape": {**e2e.QWEN3_8B, "num_hidden_layers": layers}, "plan": {"layers": layers, "prompt": 16384},
           "rows": [dict(r) for r in rows], "decode_sweep": [dict(x) for x in sweep],
           "granted_context": [dict(g) for g in granted], "parts": {n: {"seconds": 1.0} for n in parts}}
    res["bars"] = e2e._bars(res)
    return res


def test_merge_keeps_the_recorded_parts_and_replaces_the_remeasured():
    r = lambda b, c, t: {"batch": b, "prompt": 16384, "chunk": c, "ttft_ms_kvarn": t, "ttft_ms_fp16": 50.0,  # noqa: E731
                         "decode_tok_s_kvarn": 30.0, "decode_tok_s_fp16": 20.0}
    recorded = _part_results(rows=[r(16, 512, 40.0), r(1, 512, 90.0)], sweep=[{"batch": 1, "context": 1024}],
                             parts=["gen-b16-c512", "gen-b1-c512", "sweep-b1"])
    new = _part_results(rows=[r(1, 512, 45.0), r(1, 2048, 45.0)],
                        granted=[{"budget_gib": 8, "ratio": 4.7, "fits": True}],
                        parts=["gen-b1-c512", "gen-b1-c2048", "granted"])
    merged = e2e.merge_results(recorded, new)
    assert [(x["batch"], x["chunk"], x["ttft_ms_kvarn"]) for x in merged["rows"]] == [(1, 512, 45.0), (1, 2048, 45.0),
                                                                                        (16, 512, 40.0)]
    assert merged["decode_sweep"] == recorded["decode_sweep"] and merged["granted_context"] == new["granted_context"]
    assert set(merged["parts"]) == {"gen-b16-c512", "gen-b1-c512", "sweep-b1", "gen-b1-c2048", "granted"}
    # the bars of the merged rows: b1 c512 re-measured (90 -> 45 ms against 50), b16 c512 kept
    assert not recorded["bars"]["b1_c512_ttft_kvarn_le_fp16"] and merged["bars"]["b1_c512_ttft_kvarn_le_fp16"]
    assert merged["bars"]["b16_c512_ttft_kvarn_le_fp16"] and "b1_c2048_ttft_kvarn_le_fp16" in merged["bars"]
    assert merged["bars"]["goal_granted_8gib_ge_4.5x"] and not recorded["bars"].get("goal_granted_8gib_ge_4.5x")
    other = _part_results(rows=[r(1, 512, 45.0)], layers=4)  # another configuration: replaces, never mixes
    assert e2e.merge_results(recorded, other) == other


def test_headline_names_each_commit_of_a_merged_record():
    r = lambda b, c: {"batch": b, "prompt": 16384, "chunk": c, "ttft_ms_kvarn": 40.0, "ttft_ms_fp16": 50.0,  # noqa: E731
                      "decode_tok_s_kvarn": 30.0, "decode_tok_s_fp16": 20.0}
    res = _part_results(rows=[r(1, 512), r(16, 512)], parts=["gen-b1-c512", "gen-b16-c512"])
    prov = {"gpu": "NVIDIA H200", "date": "2026-12-02T00:00:00+00:00", "git_commit": "bbbb"}
    res["parts"] = {"gen-b1-c512": {"git_commit": "bbbb", "date": "2026-12-02T00:00:00+00:00"},
                    "gen-b16-c512": {"git_commit": "aaaa", "date": "2026-12-01T21:00:00+00:00"}}
    text = e2e.headline_markdown({"sections": {"e2e": {"results": res, "provenance": prov}}})
    assert "2026-12-01 to 2026-12-02, commits aaaa (gen-b16-c512); bbbb (gen-b1-c512)" in text
    res["parts"]["gen-b16-c512"]["git_commit"] = "bbbb"  # one commit: the provenance's date and commit alone
    text = e2e.headline_markdown({"sections": {"e2e": {"results": res, "provenance": prov}}})
    assert "2026-12-02, commit bbbb." in text and "commits" not in text


def test_record_section_merges_with_the_sections_merge(tmp_path):
    from kvarn_cutlass.bench.record import record_section

    path = tmp_path / "h200.json"
    a = _part_results(sweep=[{"batch": 1, "context": 1024}], parts=["sweep-b1"])
    b = _part_results(sweep=[{"batch": 16, "context": 1024}], parts=["sweep-b16"])
    record_section("e2e", a, path, {"date": "1"}, merge=e2e.merge_results)
    record_section("e2e", b, path, {"date": "2"}, merge=e2e.merge_results)
    entry = json.loads(path.read_text())["sections"]["e2e"]
    assert [p["batch"] for p in entry["results"]["decode_sweep"]] == [1, 16] and entry["provenance"] == {"date": "2"}
    record_section("e2e", b, path, {"date": "3"})  # without a merge the new results replace the entry
    assert json.loads(path.read_text())["sections"]["e2e"]["results"] == b


def test_group_parts_fills_commands_under_the_limit():
    from kvarn_cutlass.cli.bench import group_parts

    parts = [("a", 100.0), ("b", 300.0), ("c", 50.0), ("d", 250.0), ("e", 900.0)]
    groups = group_parts(100.0, parts, 450.0)
    assert sorted(n for g in groups for n in g) == ["a", "b", "c", "d", "e"]
    est = dict(parts)
    for g in groups:
        assert g == sorted(g) and (len(g) == 1 or 100 + sum(est[n] for n in g) <= 450)
    assert ["e"] in groups  # too long for any command: alone
    with pytest.raises(ValueError, match="--command-limit"):
        group_parts(100.0, parts, 100.0)


def test_cli_lists_the_parts_and_checks_part_before_any_gpu_work(capsys):
    from kvarn_cutlass.cli import main

    assert main(["bench", "--section", "e2e", "--list-parts"]) == 0
    out = capsys.readouterr().out
    commands = [ln.split("#")[0].split() for ln in out.splitlines() if ln.strip().startswith("kvarn-cutlass bench")]
    named = [c[i + 1] for c in commands for i, w in enumerate(c) if w == "--part"]
    assert sorted(named) == sorted(e2e.plan_parts(e2e.FULL))  # every part in exactly one command
    for line in out.splitlines():
        if line.strip().startswith("kvarn-cutlass bench"):
            assert int(line.split("# ~")[1].split()[0]) <= 450
    for argv, match in ((["--part", "granted"], "exactly one --section"),
                        (["--section", "e2e", "--part", "gen-b2-c512"], "not among the parts"),
                        (["--section", "copy", "--part", "x"], "does not run in parts"),
                        (["--section", "copy", "--list-parts"], "runs in parts")):
        assert main(["bench", *argv]) == 1
        assert match in capsys.readouterr().err


# --- the fp16 decode baseline: attention over the filled prefix of a StaticCache ------------------------------------------
def _decode_problem(batch, q_heads, kv_heads, L, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, 1, D, generator=g)
    k = torch.randn(batch, kv_heads, L, D, generator=g)
    v = torch.randn(batch, kv_heads, L, D, generator=g)
    return q, k, v


def _poisoned(x, lengths):
    """x [B, H, L, D] with every slot at or past lengths[b] set to NaN (K) / huge (V): what must never be read."""
    y = x.clone()
    for b, n in enumerate(lengths):
        y[b, :, n:] = float("nan")
    return y


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2), (16, 2)])  # GQA groups 1, 4, 8
@pytest.mark.parametrize("positions", [[0, 1, 2], [5, 37, 63], [63, 63, 63]])
def test_fp16_decode_attention_is_attention_over_the_filled_prefix(q_heads, kv_heads, positions):
    """Against float64 attention over keys [0, p + 1) per sequence; an unfilled tail full of NaN changes no bit."""
    L, D, scale = 64, 32, 0.17
    q, k, v = _decode_problem(3, q_heads, kv_heads, L, D, seed=sum(positions) + q_heads)
    pos = torch.tensor(positions)[:, None]
    lengths = [p + 1 for p in positions]
    got, weights = e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale, position_ids=pos)
    assert weights is None and got.shape == (3, 1, q_heads, D) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), prefix_attention_f64(q, k, v, lengths, scale), rtol=0, atol=2e-6)
    bad_v = _poisoned(v, lengths)
    bad_v[torch.isnan(bad_v)] = 1e30
    poisoned, _ = e2e.fp16_decode_attention(None, q, _poisoned(k, lengths), bad_v, None, scaling=scale, position_ids=pos)
    assert torch.equal(poisoned, got)


def test_fp16_decode_attention_shares_one_position_and_clamps_it_to_the_buffer():
    L, D = 40, 16
    q, k, v = _decode_problem(2, 8, 2, L, D, seed=5)
    one, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=torch.tensor([[9]]))
    both, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=torch.tensor([[9], [9]]))
    assert torch.equal(one, both)
    torch.testing.assert_close(one.double(), prefix_attention_f64(q, k, v, [10, 10], D**-0.5), rtol=0, atol=2e-6)
    # a position past the buffer reads the whole buffer, never past it
    past, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=torch.tensor([[L + 7]]))
    last, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=torch.tensor([[L - 1]]))
    assert torch.equal(past, last)


def test_fp16_decode_attention_computes_the_lengths_once_per_step_and_follows_the_positions(monkeypatch):
    """The lengths of a step are computed for its first layer and reused by the later ones (the same position_ids
    tensor); a step's new positions, in a new tensor or written in place into the same one, are never served
    stale (each checked against float64 attention over the new prefix)."""
    L, D = 48, 16
    q, k, v = _decode_problem(2, 8, 2, L, D, seed=11)
    adds = []
    real_add = torch.add
    monkeypatch.setattr(torch, "add", lambda *a, **kw: adds.append(1) or real_add(*a, **kw))
    pos = torch.tensor([[6], [20]])
    for _ in range(3):  # three layers of one step
        got, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=pos)
    assert len(adds) == 1
    torch.testing.assert_close(got.double(), prefix_attention_f64(q, k, v, [7, 21], D**-0.5), rtol=0, atol=2e-6)
    pos.add_(1)  # the next step in place (a captured graph's static input is updated so)
    got, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=pos)
    torch.testing.assert_close(got.double(), prefix_attention_f64(q, k, v, [8, 22], D**-0.5), rtol=0, atol=2e-6)
    got, _ = e2e.fp16_decode_attention(None, q, k, v, None, position_ids=torch.tensor([[30], [2]]))
    torch.testing.assert_close(got.double(), prefix_attention_f64(q, k, v, [31, 3], D**-0.5), rtol=0, atol=2e-6)
    assert len(adds) == 3


def _varlen_flash_f64(q, k, v, cu_q, cu_k, used, max_q, max_k, scale):
    """FlashAttention-2's varlen forward as its API documents it, in float64: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    (total_q, Hq, D) attend, not causally, to keys k[cu_k[i] : cu_k[i] + used[i]] (seqused_k) of (total_k, Hkv, D),
    query head j reading KV head j // (Hq / Hkv)."""
    hq, hk = q.shape[1], k.shape[1]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used[i])
        assert q1 - q0 <= max_q and n <= max_k and k0 + n <= int(cu_k[i + 1])
        for j in range(hq):
            kk, vv = k[k0:k0 + n, j // (hq // hk)].double(), v[k0:k0 + n, j // (hq // hk)].double()
            out[q0:q1, j] = torch.softmax(q[q0:q1, j].double() @ kk.T * scale, -1) @ vv
    return out


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_the_flash_varlen_problem_is_attention_over_the_filled_prefix(q_heads, kv_heads):
    """The CUDA path's arguments (one varlen sequence per (sequence, KV head), the buffers viewed in place), solved
    by the documented varlen semantics, give float64 attention over the filled prefix, the output rows in the
    query's head order (row b * Hkv + h, head g -> query head h * G + g of sequence b)."""
    B, L, D, scale = 3, 48, 16, 0.21
    q, k, v = _decode_problem(B, q_heads, kv_heads, L, D, seed=q_heads)
    lengths = [1, 20, 48]
    k, v = _poisoned(k, lengths), _poisoned(v, lengths)
    used = torch.tensor(lengths, dtype=torch.int32)[:, None].expand(B, kv_heads).contiguous()
    args = e2e._flash_varlen_args(q, k, v, used)
    q3, k3, v3, cu_q, cu_k, seqused, max_q, max_k = args
    assert (q3.shape, k3.shape, cu_q.dtype, cu_k.dtype, seqused.dtype) == (
        (B * kv_heads, q_heads // kv_heads, D), (B * kv_heads * L, 1, D), torch.int32, torch.int32, torch.int32)
    assert k3.data_ptr() == k.data_ptr() and v3.data_ptr() == v.data_ptr()  # views: the cache is not copied
    out = _varlen_flash_f64(*args, scale).reshape(B, 1, q_heads, D)
    torch.testing.assert_close(out, prefix_attention_f64(q, k, v, lengths, scale), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="contiguous"):
        e2e._flash_varlen_args(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, used)


@pytest.mark.parametrize("change,match", [
    ({"query": torch.randn(2, 8, 3, 16)}, "one position per sequence"),
    ({"key": torch.randn(2, 3, 40, 16)}, "multiple of Hkv"),
    ({"value": torch.randn(2, 2, 39, 16)}, "key and value"),
    ({"key": torch.randn(1, 2, 40, 16), "value": torch.randn(1, 2, 40, 16)}, "B=2"),
    ({"position_ids": None}, "position_ids"),
    ({"position_ids": torch.tensor([[3], [4], [5]])}, "position_ids"),
    ({"position_ids": torch.tensor([[3.0]])}, "position_ids"),
    ({"position_ids": torch.tensor([3])}, "position_ids"),
    ({"attention_mask": torch.ones(2, 1, 1, 40, dtype=torch.bool)}, "attention_mask"),
    ({"dropout": 0.1}, "dropout"),
    ({"sliding_window": 16}, "sliding_window"),
])
def test_fp16_decode_attention_refuses_what_it_does_not_compute(change, match):
    args = {"query": torch.randn(2, 8, 1, 16), "key": torch.randn(2, 2, 40, 16), "value": torch.randn(2, 2, 40, 16),
            "attention_mask": None, "position_ids": torch.tensor([[3]]), **change}
    with pytest.raises(ValueError, match=match):
        e2e.fp16_decode_attention(None, args.pop("query"), args.pop("key"), args.pop("value"), args.pop("attention_mask"),
                                  **args)


def test_static_greedy_decodes_a_static_cache_through_decode_attn_only():
    """The fp16 decode baseline in StaticGreedy (eager steps on the CPU): the tokens of transformers' own masked SDPA
    decode, every decode step's attention through decode_attn (one query each), none of the prefill's, and the
    model's attention implementation left as it was."""
    from transformers import AttentionInterface, StaticCache

    from kvarn_cutlass.hf.static_step import StaticGreedy

    model = _tiny_qwen3()
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(2))
    runs = {}
    seen = []

    def counting(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return e2e.fp16_decode_attention(module, query, *args, **kwargs)

    AttentionInterface.register("test_counting_decode", counting)
    for name in (None, e2e._decode_attn("fp16"), "test_counting_decode"):
        run = StaticGreedy(model, ids, 9, StaticCache(config=model.config, max_cache_len=45), 16, decode_attn=name)
        run.prefill()
        for _ in range(8):
            run.step()
        runs[name] = run.finish()
        assert model.config._attn_implementation == "sdpa"
    assert torch.equal(runs[None], runs[e2e.FP16_DECODE_ATTN]) and torch.equal(runs[None], runs["test_counting_decode"])
    assert seen == [1] * (8 * model.config.num_hidden_layers)


@pytest.mark.parametrize("reps", [1, 3, 5, 12])
def test_ttft_rounds_alternate_the_runs(reps):
    """Every round times each prefill once; no run follows the same one in every round (from 2 rounds on), and
    over each 2 * len(TTFT_RUNS) rounds every run takes each position, and follows each other run, equally often."""
    from collections import Counter

    rounds = e2e.ttft_rounds(reps)
    assert len(rounds) == reps and all(sorted(r) == sorted(e2e.TTFT_RUNS) for r in rounds)
    if reps >= 2:
        for name in e2e.TTFT_RUNS:
            before = {r[r.index(name) - 1] if r.index(name) else None for r in rounds}
            assert len(before) > 1, (name, rounds)
    n = len(e2e.TTFT_RUNS)
    for start in range(0, reps - 2 * n + 1, 2 * n):
        block = rounds[start:start + 2 * n]
        positions = Counter((name, r.index(name)) for r in block for name in r)
        assert set(positions.values()) == {2}
        pairs = Counter((a, b) for r in block for a, b in zip(r, r[1:]))
        assert len(pairs) == n * (n - 1) and set(pairs.values()) == {2}


def test_gen_row_interleaves_the_prefills_and_decodes_after_the_last_round(monkeypatch):
    """_gen_row on stand-ins for the timed runs (no GPU): samples in call order, medians of them, the decode of
    each cache only in the last round, an out-of-memory run recorded (error only) and not retried while the others
    go on."""
    import torch

    calls, times, clock = [], {name: [] for name in e2e.TTFT_RUNS}, iter(range(1, 100))
    plan = e2e.Plan(layers=2, prompt=16, new_tokens=4, batches=(1,), chunks=(8,), reps=3, sweep=(), sweep_steps=2)

    def generation(model, kind, ids, chunk, new_tokens, decode):
        calls.append((kind, decode))
        assert ids.shape == (1, 16) and chunk == 8 and new_tokens == 4
        times[kind].append(float(next(clock)))
        return times[kind][-1], ({f"decode_tok_s_{kind}": 1.0} if decode else {})

    def flash(model, ids, chunk, capacity):
        calls.append(("fp16_flash", False))
        if len(calls) == 4:  # its second run
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        times["fp16_flash"].append(float(next(clock)))
        return times["fp16_flash"][-1], {"peak_mem_gib_fp16_flash_prefill": 1.0}

    monkeypatch.setattr(e2e, "_generation", generation)
    monkeypatch.setattr(e2e, "_flash_ttft", flash)
    monkeypatch.setattr(e2e, "_release", lambda: None)
    row = e2e._gen_row(None, plan, 1, 8, device="cpu")
    # rounds: (kvarn, fp16, flash), (flash, fp16, kvarn), (fp16, flash, kvarn); the flash run's OOM ends it
    assert calls == [("kvarn", False), ("fp16", False), ("fp16_flash", False), ("fp16_flash", False), ("fp16", False),
                     ("kvarn", False), ("fp16", True), ("kvarn", True)]
    assert row["ttft_ms_kvarn_samples"] == times["kvarn"] and row["ttft_ms_kvarn"] == sorted(times["kvarn"])[1]
    assert row["ttft_ms_fp16_static_sdpa_samples"] == times["fp16"] and len(times["fp16"]) == 3
    # a run that failed reports its error, not a median of the samples it had before
    assert len(times["fp16_flash"]) == 1 and "ttft_ms_fp16_flash" not in row
    assert "OutOfMemoryError" in row["error_fp16_flash"]
    assert (row["ttft_ms_fp16"], row["ttft_fp16_baseline"]) == (row["ttft_ms_fp16_static_sdpa"], "static_sdpa")
    assert row["decode_tok_s_kvarn"] == row["decode_tok_s_fp16"] == 1.0
