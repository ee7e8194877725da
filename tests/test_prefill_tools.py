"""The fused prefill kernel's tooling without a GPU: config names, `tune --kernel prefill` argument
handling and dry run, `sass` of the fused kernel."""
from __future__ import annotations

import json

import pytest

from kvarn_cutlass.cli import main
from kvarn_cutlass.ops.prefill import CANDIDATES, FusedConfig
from kvarn_cutlass.ops.prefill_tune import DEFAULT_BUCKETS, parse_bucket

from _helpers import load_tool, require_disassembler


def test_config_names_round_trip_and_bad_names_are_refused():
    assert len({c.name for c in CANDIDATES}) == len(CANDIDATES)
    for c in CANDIDATES:
        assert FusedConfig.from_name(c.name) == c
    for bad in ("r32c4", "r33c4n64", "x", "r32c4n64g3", None):
        with pytest.raises(ValueError):
            FusedConfig.from_name(bad)


def test_buckets_parse_to_their_tile_spec():
    for key in DEFAULT_BUCKETS:
        spec = parse_bucket(key)
        assert f"D{spec.head_dim}_T{spec.tile_tokens}_V{spec.v_bits}" in key
        assert (spec.quantizer == "lloyd_max") == key.endswith("_lm")


@pytest.mark.parametrize("args, words", [
    (["--kernel", "prefill", "--buckets", "D96_T128_V2"], ["head_dim=96"]),
    (["--kernel", "prefill", "--buckets", "D128_T32_V2"], ["no preset has that tile size"]),
    (["--kernel", "prefill", "--buckets", "M4096_T128_D128_f16"], ["is not a prefill bucket", "D128_T128_V2"]),
])
def test_tune_prefill_bad_buckets_fail_with_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", *args, "--dry-run"])
    assert e.value.code not in (0, None)
    err = capsys.readouterr().err + str(e.value)
    for w in words:
        assert w in err, err


def test_tune_prefill_dry_run_lists_the_candidates_that_fit(capsys):
    assert main(["tune", "--kernel", "prefill", "--dry-run", "--buckets", "D128_T128_V2", "D256_T128_V2",
                 "D128_T64_V2"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed, key = {}, None
    for line in out:
        if not line.startswith(" "):
            key = line.split(":")[0]
            listed[key] = []
        else:
            listed[key].append(line.strip())
    # D=256 takes 32-token blocks (mma.sync, or wgmma with one or two consumer warpgroups) and, with wgmma and two
    # consumer warpgroups, 64-token ones; T=64 tiles take 64-token blocks as one block, 32-token ones as two
    assert listed["D256_T128_V2"] == ["r16c4n32", "r16c8n64wg", "r16c4n32wg", "r16c8n32wg"]
    assert "r32c4n64g2" in listed["D128_T128_V2"] and "r16c8n64" in listed["D128_T128_V2"]
    assert all(FusedConfig.from_name(n).fits(128, 64) for n in listed["D128_T64_V2"])
    assert len(listed["D128_T128_V2"]) == sum(c.fits(128, 128) for c in CANDIDATES)


def test_sass_of_the_fused_kernel(tmp_path, capsys):
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import find_tool

    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("neither cuobjdump nor nvdisasm is installed")
    listing = tmp_path / "k.sass"
    assert main(["sass", "--config", "r32c4n64", "-o", str(listing)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["config"] == "r32c4n64" and s["threads"] == 256
    assert sum(n for op, n in s["sass"]["mma"].items() if op.startswith("HMMA")) > 0
    assert s["kernels"]["kvarn_prefill_fused"]["spill_store_bytes"] == 0 and 0 < s["dynamic_smem_bytes"] <= 227 * 1024
    assert "HMMA" in listing.read_text()


def test_sass_of_the_d256_wgmma_config(capsys):
    """head_dim 256 on wgmma: S as m64n32k16 (32-token blocks), P.V as one m64n256k16 per k-step, no local
    memory; 384 threads."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import find_tool

    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("neither cuobjdump nor nvdisasm is installed")
    assert main(["sass", "--bucket", "D256_T128_V2", "--config", "r16c8n32wg"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["config"] == "r16c8n32wg" and s["threads"] == 384 and s["target"] == "sm_90a"
    mma = s["sass"]["mma"]
    assert any(op.startswith("HGMMA.64x32x16.F32") for op in mma) and any(op.startswith("HGMMA.64x256x16.F32") for op in mma)
    assert s["sass"]["ldl"] == s["sass"]["stl"] == 0 and 0 < s["dynamic_smem_bytes"] <= 227 * 1024


def test_every_prefill_variant_substitution_applies_to_the_kernel_source():
    """tools/prefill_variants.py's variants are text substitutions of csrc/prefill_fused.cu: each one's text must
    still be in the source (use_source refuses a variant whose text is gone, on the GPU, after the build)."""
    tool = load_tool("prefill_variants")
    src = load_tool("prefill_phases").SHIPPED_SOURCE.read_text()
    assert tool.VARIANTS["shipped"] == []
    for name, subs in tool.VARIANTS.items():
        for old, new in subs:
            assert old in src and old != new, (name, old)


def test_whole_source_variant_replaces_the_shipped_source(tmp_path):
    """A NAME=PATH variant of tools/prefill_variants.py builds from the file at PATH: its one substitution takes
    the whole shipped text (present, as use_source requires) to the file's."""
    tool = load_tool("prefill_variants")
    src = load_tool("prefill_phases").SHIPPED_SOURCE.read_text()
    other = tmp_path / "older.cu"
    other.write_text(src.replace("constexpr bool", "constexpr  bool"))
    [(old, new)] = tool.whole_source_variant(str(other))
    assert old == src and new == other.read_text() and new != src


@pytest.mark.parametrize("bucket, groups", [("D128_T128_V2", 2), ("D256_T128_V2", 1)])
def test_hand_off_variants_compile_to_the_form_they_name(bucket, groups):
    """The stage hand-off's A/B forms build for sm_90a: with mbarriers the kernel waits by try_wait (SASS SYNCS
    ... TRYWAIT), with named barriers it has none; the shipped rule takes mbarriers with two producer groups only."""
    pytest.importorskip("cuda.bindings")
    import re

    import torch

    import kvarn_cutlass.ops.prefill as OP
    from kvarn_cutlass.cli.sass import disassemble
    from kvarn_cutlass.ops.prefill import select_config
    from kvarn_cutlass.runtime.spec import build

    require_disassembler()
    tool = load_tool("prefill_variants")
    spec = parse_bucket(bucket)
    cfg = select_config(spec, "sm90")
    try:
        for name, mbar in (("shipped", groups == 2), ("mbar_every_config_hint", True), ("named_every_config", False)):
            tool.use_source(name, tool.VARIANTS[name])  # the tool's own build of the variant: OP.fused_spec
            m = build(OP.fused_spec(spec, torch.float16, torch.float16, cfg), "sm_90")
            assert bool(re.search(r"SYNCS\.PHASECHK", disassemble(m.cubin))) == mbar, (bucket, name)
    finally:
        tool.use_source("shipped", [])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_hand_off_forms_give_the_same_bits(D):
    """The stage hand-off orders the same arithmetic whichever barriers carry it: the tuned kernel with mbarriers
    in every config and with named barriers in every config (tools/prefill_variants.py's A/B forms) write
    bit-identical outputs, over tiles, window and a causal chunk."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import kvarn_cutlass as kc
    from kvarn_cutlass.runtime.arch import device_arch

    if device_arch() < 90:
        pytest.skip("the tuned wgmma configs need sm_90")
    tool = load_tool("prefill_variants")
    g = torch.Generator(device="cuda").manual_seed(D)
    cache = kc.KVarNCache(1, 1, 2, D, window=256, device="cuda")
    k = torch.randn(1, 2, 1500, D, device="cuda", dtype=torch.float16, generator=g)
    cache.append(0, k, torch.randn_like(k))
    q = torch.randn(1, 8, 700, D, device="cuda", dtype=torch.float16, generator=g) * 0.3
    kn = torch.randn(1, 2, 700, D, device="cuda", dtype=torch.float16, generator=g)
    vn = torch.randn_like(kn)
    outs = {}
    try:
        for name in ("mbar_every_config", "named_every_config"):
            tool.use_source(name, tool.VARIANTS[name])
            outs[name] = kc.prefill_attention(q, kn, vn, cache, 0, append=False).clone()
    finally:
        tool.use_source("shipped", [])
    a, b = outs.values()
    assert torch.isfinite(a).all() and torch.equal(a, b)
