"""``tools/e2e_profile.py`` without a GPU: its interval arithmetic on made-up kernel events, its kernel groups on
real kernel names, and a dry run of every phase on the CPU (a tiny shape; CPU ops in place of kernels)."""

from __future__ import annotations

import json

import pytest

from _helpers import load_tool

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tool():
    return load_tool("e2e_profile")


def test_busy_time_is_the_union_of_the_kernels_and_the_gaps_are_what_lies_between(tool):
    # two runs of a phase (us): [0, 100) and [50, 150) overlap, a 150 us gap, [300, 350), a 3 us gap, [353, 383),
    # a 617 us gap, [1000, 1040)
    events = [("sm90_xmma_gemm_f16", 0, 100), ("void at::native::vectorized_elementwise_kernel", 50, 100),
              ("kvarn_decode_n", 300, 50), ("kvarn_decode_n", 353, 30), ("flash_fwd_splitkv_kernel", 1000, 40)]
    r = tool.analyse(events, wall_ms=1.0, per=2, top=2)
    assert r["busy_ms"] == pytest.approx((150 + 50 + 30 + 40) / 1e3 / 2)
    assert r["profiled_span_ms"] == pytest.approx(1040 / 1e3 / 2)
    # per run: the gaps over 5 us (150 and 617, not 3), their sum; the largest gap as it is
    assert (r["gaps_over_5us"], r["gap_ms_over_5us"], r["largest_gap_ms"]) == (1.0, pytest.approx(0.3835), 0.617)
    assert r["launches"] == 2.5 and r["busy_of_wall"] == pytest.approx(0.135)
    assert r["groups"]["kvarn decode"] == {"ms": pytest.approx(0.04), "count": 1.0}
    assert list(r["groups"])[0] == "gemm" and [t["name"] for t in r["top"]] == [
        "sm90_xmma_gemm_f16", "void at::native::vectorized_elementwise_kernel"]
    assert tool.analyse([], wall_ms=1.0, per=1, top=3)["busy_ms"] == 0.0


@pytest.mark.parametrize("name,group", [
    ("kvarn_prefill_fused_r32c4n64", "kvarn prefill"), ("kvarn_compress_layer", "kvarn append/compress"),
    ("kvarn_append_commit", "kvarn append/compress"), ("kvarn_decode_n_d128", "kvarn decode"),
    ("kvarn_wht_d128_f16_f16", "kvarn rotation"), ("kvarn_dequant_tiles", "kvarn other"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "flash attention"),
    ("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN", "gemm"), ("void gemv2T_kernel_val<int, int, __half>", "gemm"),
    ("void at::native::reduce_kernel<512, 1>", "norm/reduce"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>", "elementwise"),
    ("aten::mm", "gemm"), ("something_else", "other"),
])
def test_kernel_groups(tool, name, group):
    assert tool.group_of(name) == group


def test_a_cpu_dry_run_profiles_every_phase_of_both_caches(tool, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert tool.main(["--device", "cpu", "--tiny", "--layers", "1", "--prompt", "160", "--chunk", "64", "--steps", "2",
                      "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    text = capsys.readouterr().out
    for kind in ("kvarn", "fp16"):
        for phase in ("prefill", "decode"):
            r = res[kind][phase]
            assert r["wall_ms"] > 0 and r["busy_ms"] > 0 and r["launches"] > 0 and r["groups"], (kind, phase)
            assert f"== {kind} {phase}: wall" in text
        assert "gemm" in res[kind]["prefill"]["groups"]
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--steps", "0"])
