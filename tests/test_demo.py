"""``kvarn-cutlass demo``: its generator, its accuracy and memory figures against independent
computations, the sm_90 fused prefill kernel it builds on a CPU machine, and the GPU path."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvarn_cutlass.cli import main
from kvarn_cutlass.cli import demo
from kvarn_cutlass.format import PRESETS, TileSpec

from _helpers import SHARED

MODEL = SHARED / "models" / "kvarn-ref-lm"


def run_json(capsys, *argv: str) -> dict:
    assert main(["demo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- inputs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_rope_scores_depend_only_on_relative_position(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 1, 1, 64, generator=g), torch.randn(1, 1, 1, 64, generator=g)
    at = lambda x, p: demo.rope(x, torch.tensor([p]))  # noqa: E731
    s1 = float((at(q, 9) * at(k, 4)).sum())
    s2 = float((at(q, 1005) * at(k, 1000)).sum())
    assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-4), f"seed={seed}"
    assert float(at(q, 77).norm()) == pytest.approx(float(q.norm()), rel=1e-5), f"seed={seed}"  # rotations keep norms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generator_attention_is_local_and_peaked_like_a_trained_model(seed):
    """The docstring's claims at n = 2048: most attention on the newest 256 tokens, top key ~0.3,
    |q|, |k| ~ 12-15 (kvarn-ref-lm layers 1-5: 0.79-0.89, 0.24-0.34, 12-14)."""
    n = 2048
    q, k, v = demo.realistic_qkv(8, 2, n, 128, torch.Generator().manual_seed(seed))
    assert q.shape == (1, 8, n, 128) and k.shape == v.shape == (1, 2, n, 128) and q.dtype == torch.float32
    _, p = demo.exact_attention(q[:, :, -16:], k, v, 128**-0.5)
    window_share = float(p[..., -256:].sum(-1).mean())
    top = float(p.max(-1).values.mean())
    assert 0.6 < window_share < 0.95, window_share
    assert 0.1 < top < 0.6, top
    assert 8 < float(k.norm(dim=-1).mean()) < 20 and 8 < float(q.norm(dim=-1).mean()) < 20
    # keys have outlier channels: the largest per-channel spread is several times the median one
    spread = k.std(dim=2).mean(dim=(0, 1))
    assert float(spread.max() / spread.median()) > 2.5


def test_exact_attention_matches_sdpa_in_float64():
    seed = 21
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 8, 5, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 40, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 40, 32, generator=g, dtype=torch.float64)
    out, p = demo.exact_attention(q, k, v, 0.3)
    allowed = torch.arange(40)[None, :] <= torch.arange(35, 40)[:, None]  # query i at position 35 + i
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), f"seed={seed}"
    assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1))), f"seed={seed}"
    assert float(p[..., 0, 36:].abs().max()) == 0.0  # the first query sees nothing after position 35


# --- the CPU pipeline ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,tokens,chunk,window", [("k4v2_g128", 700, 256, 128), ("k4v4_g64", 530, 100, 192)])
def test_cpu_demo_figures(capsys, preset, tokens, chunk, window):
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--preset", preset, "--tokens", str(tokens),
                 "--chunk", str(chunk), "--window", str(window))
    assert r["device"] == "cpu" and r["tokens"] == tokens and r["shape"]["layers"] == 1
    Hkv, D = r["shape"]["kv_heads"], r["shape"]["head_dim"]
    # memory from the cache's documented layout: ceil((n - W) / T) tiles, the rest in the fp16 window
    T = PRESETS[preset][2]
    tiles = max(0, math.ceil((tokens - window) / T))
    want = tiles * Hkv * TileSpec(preset, D).tile_nbytes + (tokens - tiles * T) * Hkv * D * 2 * 2
    assert r["memory"]["kvarn_bytes"] == want
    assert r["memory"]["fp16_bytes"] == 2 * Hkv * tokens * D * 2
    pf, dc = r["accuracy"]["prefill_last_chunk"], r["accuracy"]["decode"]
    # the CPU prefill pipeline (int8 K scores) reproduces the float64 reference over the same cache
    assert pf["vs_reference_max"] < 5e-3
    # quantization error: present (tiles exist and get attention) but bounded
    assert 0 < pf["quantized_attention_share"] < 1 and 0 < dc["quantized_attention_share"] < 1
    assert 1e-4 < dc["vs_exact_max"] < 0.2 and 1e-4 < pf["vs_exact_max"] < 0.6
    # triangle inequality between the three errors of the prefill chunk
    assert abs(pf["vs_exact_max"] - pf["reference_vs_exact_max"]) <= pf["vs_reference_max"] + 1e-12
    assert dc["vs_reference_max"] is None  # the CPU decode is the reference itself: nothing to compare
    assert r["prefill_kernel_sm90"]["status"] == "skipped (--no-compile)"


def test_cpu_demo_text_report(capsys):
    assert main(["demo", "--device", "cpu", "--no-compile", "--tokens", "400", "--chunk", "256", "--window", "128"]) == 0
    out = capsys.readouterr().out
    for needle in ("quantization error", "float64 reference", "memory:", "fp16", "not run: no CUDA device",
                   "fused prefill kernel for sm_90 (NVRTC): skipped", "the chunk itself is exact"):
        assert needle in out, needle


@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="shared reference model not present")
def test_cpu_demo_with_a_model_uses_every_layer(capsys):
    pytest.importorskip("transformers")
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--model", str(MODEL), "--tokens", "300",
                 "--chunk", "128", "--window", "128")
    assert r["shape"] == {"layers": 6, "batch": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 128}
    assert "package" in r["source"]["text"]
    for phase in ("prefill_last_chunk", "decode"):
        per_layer = r["accuracy"][phase]["per_layer"]
        assert len(per_layer) == 6
        assert r["accuracy"][phase]["vs_exact_max"] == max(x["vs_exact"] for x in per_layer)
    assert r["accuracy"]["prefill_last_chunk"]["vs_reference_max"] < 5e-3
    assert r["memory"]["fp16_bytes"] == 6 * 2 * 2 * 300 * 128 * 2


@pytest.mark.parametrize("argv,fragment", [
    (["--window", "100"], "--window"),
    (["--tokens", "4", "--decode-steps", "4"], "--tokens"),
    (["--text", __file__], "--text needs --model"),
])
def test_bad_combinations_fail_with_one_line(capsys, argv, fragment):
    assert main(["demo", "--device", "cpu", "--no-compile", *argv]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


# --- the sm_90 fused prefill kernel (CPU machines) ----------------------------------------------------------
DEMO_ARGV = ["demo", "--device", "cpu", "--tokens", "300", "--chunk", "128", "--window", "128"]


def test_cpu_demo_builds_the_kernel_an_sm90_gpu_would_run(capsys):
    """The module and config are what prefill_attention selects on sm_90 for the demo's cache, the figures
    are the build's own; a second run reads the kernel cache."""
    import warnings

    from kvarn_cutlass.ops.prefill import UntunedPrefillConfigWarning, fused_spec, select_config, smem_bytes
    from kvarn_cutlass.runtime.spec import build

    spec = TileSpec("k4v2_g128", 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedPrefillConfigWarning)
        config = select_config(spec, "sm90")
    kspec = fused_spec(spec, torch.float16, torch.float16, config)
    first = run_json(capsys, *DEMO_ARGV[1:])["prefill_kernel_sm90"]
    second = run_json(capsys, *DEMO_ARGV[1:])["prefill_kernel_sm90"]
    assert first["status"] in ("compiled", "cached") and second["status"] == "cached", (first, second)
    compiled = build(kspec, "sm90")
    assert compiled.target == ("sm_90a" if kspec.arch_specific else "sm_90")  # wgmma configs need sm_90a
    for got in (first, second):
        assert got["module"] == kspec.name and got["config"] == config.name and got["target"] == compiled.target
        assert got["registers"] == compiled.resources["kvarn_prefill_fused"].registers
        assert got["dynamic_smem_bytes"] == smem_bytes(compiled.cubin) > 0
        assert got["compile_seconds"] == round(compiled.compile_seconds, 1)
    demo._report({**run_json(capsys, *DEMO_ARGV[1:], "--no-compile"), "prefill_kernel_sm90": second})
    assert f"config {config.name}; from the kernel cache" in capsys.readouterr().out


def test_a_failed_build_is_reported_and_the_demo_goes_on(monkeypatch, capsys):
    from kvarn_cutlass.runtime import spec as runtime_spec
    from kvarn_cutlass.runtime.errors import CompileError

    def broken(kspec, arch, backend=None):
        raise CompileError("prefill_fused.cu", "error: out of memory\n", (), reason="NVRTC failed")

    monkeypatch.setattr(runtime_spec, "build", broken)
    r = run_json(capsys, *DEMO_ARGV[1:])
    got = r["prefill_kernel_sm90"]
    assert got["status"] == "failed" and got["error"].startswith("CompileError: "), got
    assert r["accuracy"]["prefill_last_chunk"]["vs_reference_max"] < 5e-3  # the CPU figures are unaffected
    demo._report(r)
    assert "fused prefill kernel for sm_90 (NVRTC): failed (CompileError: " in capsys.readouterr().out


# --- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_demo_json(capsys):
    r = run_json(capsys, "--device", "cuda", "--tokens", "4096", "--chunk", "512")
    assert r["device"] == "cuda" and r["shape"]["q_heads"] == 32 and r["shape"]["kv_heads"] == 8
    pf, dc = r["accuracy"]["prefill_last_chunk"], r["accuracy"]["decode"]
    assert pf["vs_reference_max"] < 5e-3, pf  # the prefill kernels vs float64 over the same cache
    assert dc["vs_reference_max"] < 2e-3, dc  # the graph-replayed decode kernels
    assert dc["vs_exact_max"] < 0.2 and pf["vs_exact_max"] < 0.6
    d, p = r["speed"]["decode"], r["speed"]["prefill"]
    for key in ("kvarn_graph_us", "kvarn_eager_us", "sdpa_fp16_us", "sdpa_over_kvarn_graph"):
        assert d[key] > 0, key
    # SDPA replayed from a CUDA graph beside the eager call, or the reason it could not be captured
    assert d.get("sdpa_fp16_graph_us", 0) > 0 or "sdpa_fp16_graph_error" in d, d
    for key in ("kvarn_prompt_ms", "sdpa_flash_fp16_ms", "kvarn_over_sdpa"):
        assert p[key] > 0, key
    assert p["chunks"] == 8
    assert r["memory"]["fp16_bytes"] == 2 * 8 * 4096 * 128 * 2 and r["memory"]["fp16_over_kvarn"] > 3


@pytest.mark.gpu
@pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="shared reference model not present")
def test_gpu_demo_with_a_model(capsys):
    pytest.importorskip("transformers")
    r = run_json(capsys, "--device", "cuda", "--model", str(MODEL), "--tokens", "2048")
    assert r["shape"]["layers"] == 6
    assert r["accuracy"]["decode"]["vs_reference_max"] < 2e-3
    assert r["accuracy"]["prefill_last_chunk"]["vs_reference_max"] < 5e-3
    assert r["speed"]["decode"]["kvarn_graph_us"] > 0


def test_gpu_report_formats_every_gpu_field(capsys):
    """The text report's CUDA branch, fed a CPU result with the fields the CUDA path adds (it cannot
    run here); the GPU test above runs the real thing."""
    r = run_json(capsys, "--device", "cpu", "--no-compile", "--tokens", "300", "--chunk", "128", "--window", "128")
    r.update(device="cuda", gpu="NVIDIA H200", gpu_kernels="...")
    r["accuracy"]["decode"]["vs_reference_max"] = 3.5e-4
    r["speed"] = {"decode": {"kvarn_graph_us": 21.5, "kvarn_eager_us": 40.25, "sdpa_fp16_us": 53.75,
                             "sdpa_over_kvarn_graph": 2.5, "sdpa_fp16_graph_us": 12.25,
                             "sdpa_graph_over_kvarn_graph": 0.57, "rotated_sets": 3},
                  "prefill": {"kvarn_prompt_ms": 310.5, "sdpa_flash_fp16_ms": 31.25,
                              "kvarn_over_sdpa": 9.94, "chunks": 3}}
    demo._report(r)
    out = capsys.readouterr().out
    assert "demo on NVIDIA H200" in out and "GPU kernels vs the float64 reference" in out and "3.5e-04" in out
    for needle in ("21.5 us (CUDA graph; eager 40.25 us) vs SDPA fp16 eager 53.75 us (2.5x); CUDA graph 12.25 us (0.57x)",
                   "(attention and append): 310.5 ms vs SDPA flash fp16 31.25 ms (9.94x the SDPA time)"):
        assert needle in out, out
