"""The graph-replayed generation path on CUDA (``kvarn_cutlass.hf.static_step``) and the e2e bench section.

Decides on the GPU what the CPU tests cannot: that the captured model step (device appends on the cache's
device lengths, ragged decode, transformers' own ops) replays to the eager loop's tokens token for token
and leaves the cache byte for byte as the eager loop does, while the sequence crosses several tile
boundaries inside the graph; that replays never synchronize; that a failed append inside the graph is
reported at the end with the cache restored; and that ``bench --section e2e`` runs end to end (a tiny plan,
in parts that merge, its granted-context check allocating under a GiB).
kvarn-ref-lm in float16 (8 q / 2 KV heads, head_dim 128).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from _helpers import REF_MODEL_DIR as MODEL_DIR, assert_same_snapshot, needs_ref_model, ref_model_on_cuda, snapshot  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_ref_model]


@pytest.fixture(scope="module")
def setup():
    return ref_model_on_cuda()


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> list:
    return (a != b).nonzero()[:1].tolist()


@pytest.mark.parametrize("batch,window", [(1, 128), (2, 256)])
def test_graph_decode_equals_eager_greedy_across_tile_boundaries(setup, batch, window):
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf.generate import StaticGreedy, greedy

    model, ids = setup
    prompt = torch.cat([ids[:, i * 1000:i * 1000 + 300] for i in range(batch)])
    new = 300  # 300 -> 599 tokens: tiles complete inside the graph at every 128 tokens past the window
    eager_cache = kh.KVarNCache(model.config, preset="k4v2_g128", window=window, max_seq_len=300 + new)
    want = greedy(model, prompt, new, eager_cache, chunk_size=128)
    cache = kh.KVarNCache(model.config, preset="k4v2_g128", window=window, max_seq_len=300 + new)
    run = StaticGreedy(model, prompt, new, cache, chunk_size=128)
    assert run.graph  # the CUDA default
    run.prefill()
    tiles_after_prefill = cache.library.num_tiles(0)
    for _ in range(new - 1):
        run.step()
    got = run.finish()
    assert cache.library.num_tiles(0) - tiles_after_prefill >= 2
    assert torch.equal(got, want), f"first difference at {_first_difference(got, want)}"
    assert_same_snapshot(snapshot(cache.library), snapshot(eager_cache.library))
    assert cache.get_seq_length() == eager_cache.get_seq_length() == 300 + new - 1


def test_graph_decode_with_a_transformers_static_cache_equals_eager_greedy(setup):
    from transformers import StaticCache

    from kvarn_cutlass.hf.generate import greedy, static_greedy

    model, ids = setup
    model.set_attn_implementation("sdpa")
    try:
        prompt, new = ids[:, :300], 100
        eager_cache = StaticCache(config=model.config, max_cache_len=400)
        want = greedy(model, prompt, new, eager_cache, chunk_size=128)
        cache = StaticCache(config=model.config, max_cache_len=400)
        got = static_greedy(model, prompt, new, cache, chunk_size=128)
    finally:
        model.set_attn_implementation("kvarn")
    assert torch.equal(got, want), f"first difference at {_first_difference(got, want)}"
    held = 300 + new - 1  # the last token is chosen, never fed back
    for i, (a, b) in enumerate(zip(cache.layers, eager_cache.layers)):
        assert int(a.cumulative_length) == int(b.cumulative_length) == held, f"layer {i}"
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)  # float16 [1, kv_heads, 400, head_dim]
            assert x.dtype == y.dtype == torch.float16 and x.shape == y.shape
            # the slots past the last position: neither path writes them
            assert not x[:, :, held:].any() and not y[:, :, held:].any(), f"layer {i} {name}: a slot past {held} written"
            xw, yw = x[:, :, :held].float(), y[:, :, :held].float()
            if i == 0:
                # layer 0's K/V are a function of the token and its position only (no attention before them):
                # the same bits, or the step writes another position
                assert torch.equal(xw, yw), f"layer 0 {name}: first difference at {_first_difference(xw, yw)}"
            else:
                # later layers' K/V carry SDPA's output over the masked static buffer, whose kernel is not bound to
                # the same bits eagerly and under capture: equal up to fp16 rounding
                torch.testing.assert_close(xw, yw, rtol=1e-2, atol=1e-2 * float(yw.abs().max()),
                                           msg=lambda m, i=i, name=name: f"layer {i} {name}: {m}")


def test_replayed_steps_never_synchronize_and_sync_every_streams_the_tokens(setup):
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf.generate import StaticGreedy, static_greedy

    model, ids = setup
    prompt = ids[:, :200]
    run = StaticGreedy(model, prompt, 40, kh.KVarNCache(model.config, window=128, max_seq_len=240))
    run.prefill()
    run.step()  # eager + capture: synchronizes, by design
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises from here on
    try:
        for _ in range(38):
            run.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    whole = run.finish()
    seen = []
    streamed = static_greedy(model, prompt, 40, kh.KVarNCache(model.config, window=128, max_seq_len=240),
                             sync_every=16, on_tokens=seen.append)
    assert [t.shape[1] for t in seen] == [16, 16, 8] and torch.equal(torch.cat(seen, 1).cuda(), streamed)
    assert torch.equal(streamed, whole)


def test_a_failed_append_inside_the_graph_raises_at_the_end_with_the_cache_restored(setup):
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf.generate import StaticGreedy

    model, ids = setup
    cache = kh.KVarNCache(model.config, window=128, max_seq_len=300)
    run = StaticGreedy(model, ids[:, :200], 60, cache)
    run.prefill()
    for _ in range(10):
        run.step()
    held = cache.get_seq_length()
    weight = model.model.layers[2].self_attn.k_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")  # the graph reads the weights in place: the next step's layer-2 keys are NaN
    try:
        for _ in range(5):
            run.step()
        with pytest.raises(ValueError, match="replayed step"):
            run.finish()
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert cache.get_seq_length() == held  # back to the state before the first failed step
    assert all(cache.library.seq_len(i) == held for i in range(cache.library.num_layers))


def test_graph_decode_needs_max_seq_len(setup):
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf.generate import static_greedy

    model, ids = setup
    cache = kh.KVarNCache(model.config, window=128)
    with pytest.raises(ValueError, match="max_seq_len >= 209"):
        static_greedy(model, ids[:, :200], 10, cache)
    assert cache.library is None


def test_cli_generate_decodes_from_a_graph_on_cuda(capsys):
    from kvarn_cutlass.cli import main

    base = ["generate", "--model", str(MODEL_DIR), "--prompt", "def add(a, b):\n    return a + b\n" * 30,
            "--max-new-tokens", "40", "--window", "128", "--device", "cuda", "--no-progress", "--json"]
    runs = {}
    for flag in ([], ["--no-graph"]):
        assert main(base + flag) == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    assert runs[False]["decode"] == "graph" and runs[True]["decode"] == "eager"
    assert runs[False]["per_prompt"][0]["quantized_tokens"] == runs[True]["per_prompt"][0]["quantized_tokens"]


def test_bench_e2e_runs_a_tiny_plan_in_parts_that_merge():
    from kvarn_cutlass.bench import e2e

    # granted contexts at 1/4 and 1/2 GiB (36 layers): a tiny plan allocates little, whoever shares the GPU
    plan = e2e.Plan(layers=2, prompt=640, new_tokens=6, batches=(1, 2), chunks=(256,), reps=1,
                    sweep=((1, (512,)),), sweep_steps=4, budgets_gib=(0.25, 0.5))
    res = e2e.run_plan(plan, ["gen-b1-c256", "gen-b2-c256", "sweep-b1"])
    assert [(r["batch"], r["chunk"]) for r in res["rows"]] == [(1, 256), (2, 256)] and res["granted_context"] == []
    for r in res["rows"]:
        for kind in e2e.KINDS:
            assert f"error_{kind}" not in r
            for key in ("decode_tok_s", "peak_mem_gib", "cache_bytes"):
                assert r[f"{key}_{kind}"] > 0
        assert "error_fp16_flash" not in r and r["ttft_ms_kvarn"] > 0
        assert r["ttft_ms_fp16"] == min(r["ttft_ms_fp16_flash"], r["ttft_ms_fp16_static_sdpa"])
        assert r["ttft_ms_fp16"] == r[f"ttft_ms_fp16_{r['ttft_fp16_baseline']}"]
        assert r["decode_fp16_baseline"] == "flash_varlen"  # the fp16 decode through FlashAttention-2
    assert all(p["decode_tok_s_kvarn"] > 0 and p["decode_tok_s_fp16"] > 0 for p in res["decode_sweep"])
    assert all(p["decode_fp16_baseline"] == "flash_varlen" for p in res["decode_sweep"])
    granted = e2e.run_plan(plan, ["granted"])  # no model: the allocations alone
    assert [g["budget_gib"] for g in granted["granted_context"]] == [0.25, 0.5] and "weights_gib" not in granted
    for g in granted["granted_context"]:
        for kind in e2e.KINDS:
            # the caches request exactly the computed bytes; the allocator's blocks hold at least that
            assert g[f"{kind}_requested_bytes"] == g[f"{kind}_bytes"] <= g["budget_bytes"]
            assert g[f"{kind}_allocated_bytes"] >= g[f"{kind}_requested_bytes"]
        assert g["fits"]
    merged = e2e.merge_results(res, granted)
    assert merged["rows"] == res["rows"] and merged["granted_context"] == granted["granted_context"]
    assert set(merged["parts"]) == {"gen-b1-c256", "gen-b2-c256", "sweep-b1", "granted"}
    json.dumps(merged)  # the record is JSON
