"""GPU tile compression (ops.compress, csrc/compress.cu).

CPU part: every shape compiles with NVRTC for sm_90 and sm_80 with no GPU, every pair of input
dtype, scale dtype and V bits on sm_90 (the lloyd_max quantizer for every shape on sm_90; the GPU
part compiles every variant the cache can pick); the PTX holds no fused multiply-add but the fast
division's, the layer kernel asks for a cluster of T/16 CTAs on sm_90 only, the shared memory
each launch form reports fits its limit, the lloyd_max thresholds are compiled in exactly, the
tie tiles meet their decision boundaries, and the wrappers reject bad arguments with clear errors.
GPU part (``-m gpu``): records byte-identical to ``codec.encode_tiles`` for every preset x head_dim x
scale dtype x input dtype on random and adversarial tiles (lloyd_max: every preset x head_dim x scale
dtype, the input dtype cycling), on tiles whose codes sit on decision boundaries, through the
cluster and the one-CTA layer kernels; the fast division against __fdiv_rn; the codec's errors, a
rejected half writing nothing, every byte written, and a CUDA KVarNCache matching a CPU one.
"""

from __future__ import annotations

import itertools
import re
import struct
import zlib

import numpy as np

import pytest
import torch

from kvarn_cutlass import codec
from kvarn_cutlass.cache import KVarNCache
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, TileSpec, lloyd_max_thresholds
from kvarn_cutlass.ops import compress as C
from kvarn_cutlass.runtime.spec import build

from _helpers import require_disassembler

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.float16, torch.float32)


@pytest.fixture(autouse=True)
def _private_cache(kernel_cache_root, monkeypatch):
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", kernel_cache_root)


# ================================================================ CPU: compilation ===============
SHAPES = sorted({(T, D) for (_, _, T) in PRESETS.values() for D in HEAD_DIMS}, reverse=True)


def _max_registers(arch: str, kernel: str) -> int:
    # 512 threads per CTA, except the 128-thread cluster CTAs on sm_90 (the layer kernel's and the append's)
    cluster = kernel.startswith("kvarn_compress_t") or kernel.startswith("kvarn_append_compress_cluster_")
    return 255 if arch == "sm_90" and cluster else 128


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("T,D", SHAPES)
def test_compress_compiles_every_shape(arch, T, D):
    spec = C.compress_spec(T, D, torch.float16, torch.float16, 2)
    m = build(spec, arch)
    name, cta, append_compress, append_cluster, commit, snapshot = spec.kernel_names
    for kernel in (name, cta, append_compress, append_cluster):
        res = m.resources[kernel]
        assert res.registers <= _max_registers(arch, kernel), res
        if (T, D) == (128, 128):
            assert res.spill_store_bytes == 0 and res.stack_bytes == 0, res
    if arch == "sm_90":  # the compression kernels: no spills in any shape (sm_90, 2026-12)
        for kernel in (name, append_compress, append_cluster):
            assert m.resources[kernel].spill_store_bytes == 0, m.resources[kernel]
        if D <= 128:
            # the append's cluster form where it is picked by ops.compress.cluster_halves, which counts
            # 4 cluster CTAs per SM: 4 x 128 threads fit the 64K registers of an SM
            assert m.resources[append_cluster].registers <= 128, m.resources[append_cluster]
        # the one-CTA layer kernel at D = 256 (64 elements a thread, at the 128-register cap of 512
        # threads) parks one value in local memory for the whole kernel: one store and one load
        assert m.resources[cta].spill_store_bytes <= (4 if D == 256 else 0), m.resources[cta]
    for kernel in (commit, snapshot):  # 256 threads; copies and integer checks only
        res = m.resources[kernel]
        assert res.registers <= 64 and res.spill_store_bytes == 0 and res.stack_bytes == 0, res
    smem = C.kernel_smem_bytes(m.cubin)  # what the launches ask for, as the kernels report it
    # sm_80's opt-in limit per block, where the one-CTA form is the layer kernel; its layout is the same on
    # every arch, so the sm_90 builds (every shape in the default run) check it too
    assert smem["compress_cta"] <= 163 * 1024
    if arch == "sm_90":
        # a cluster's CTAs (the layer kernel's, the append's): several per SM, and no opt-in above 48 KB
        assert smem["compress"] <= 48 * 1024
    else:
        assert smem["compress"] == smem["compress_cta"]  # no clusters: the cluster forms are one CTA


def test_only_the_append_compression_waits_for_a_previous_kernel():
    """The append's compression may be a programmatic dependent launch after the fused prefill kernel
    (ops/append.py): on sm_90 both its forms wait (griddepcontrol.wait, SASS ACQBULK: before the fused form's
    window rewrite and at the launch's end); the layer kernels and the commit, never launched that way, do not;
    none of them lets a dependent launch early (PREEXIT); the sm_80 build has neither."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import disassemble, kernel_opcodes

    require_disassembler()
    spec = C.compress_spec(128, 128, torch.float16, torch.float16, 2)
    layer, cta, append_compress, append_cluster, commit, snapshot = spec.kernel_names
    for arch in ("sm_90", "sm_80"):
        sass = disassemble(build(spec, arch).cubin)
        for fn in spec.kernel_names:
            ops = kernel_opcodes(sass, fn)
            waits = arch == "sm_90" and fn in (append_compress, append_cluster)
            assert ("ACQBULK" in ops) == waits and "PREEXIT" not in ops, (arch, fn)


# lloyd_max on sm_90 only, one V width per shape (both widths for every head_dim): the quantizer
# changes the code decision, not the shape- or dtype-dependent parts tested above.
LM_SHAPES = [(T, D, 2 if T == 128 else 4) for T, D in SHAPES]


@pytest.mark.parametrize("T,D,v_bits", LM_SHAPES)
def test_compress_lloyd_max_compiles_every_shape_sm90(T, D, v_bits):
    spec = C.compress_spec(T, D, torch.float16, torch.float16, v_bits, "lloyd_max")
    m = build(spec, "sm_90")
    assert all(name.endswith("_lm") for name in spec.kernel_names)
    for name in spec.kernel_names[:4]:  # the codec's kernels and the append's compression (both forms)
        res = m.resources[name]
        assert res.registers <= _max_registers("sm_90", name) and res.spill_store_bytes == 0, res
        if (T, D) == (128, 128):
            assert res.stack_bytes == 0, res


def test_compress_quantizer_is_part_of_the_spec():
    uniform = C.compress_spec(128, 128, torch.float16, torch.float16, 2)
    assert uniform == C.compress_spec(128, 128, torch.float16, torch.float16, 2, "uniform")
    # unchanged by the quantizer option; the cache dtypes' modules also hold the append kernels
    assert uniform.kernel_names == tuple(f"kvarn_{r}_t128_d128_f16_s16_v2" for r in (
        "compress", "compress_cta", "append_compress", "append_compress_cluster", "append_commit", "append_snapshot"))
    assert C.compress_spec(128, 128, torch.float32, torch.float16, 2).kernel_names == (
        "kvarn_compress_t128_d128_f32_s16_v2", "kvarn_compress_cta_t128_d128_f32_s16_v2")
    assert not any(k.startswith("KVARN_LM_") for k, _ in uniform.defines)
    for v_bits in (2, 4):
        lm = C.compress_spec(128, 128, torch.float16, torch.float16, v_bits, "lloyd_max")
        assert lm.name != C.compress_spec(128, 128, torch.float16, torch.float16, v_bits).name
        assert lm.kernel_names[0] == f"kvarn_compress_t128_d128_f16_s16_v{v_bits}_lm"
        defines = dict(lm.defines)
        assert defines["KVARN_QUANT"] == "1" and dict(uniform.defines)["KVARN_QUANT"] == "0"
        # the literals are exact: they parse back to format.lloyd_max_thresholds bit for bit
        for bits in (4, v_bits):
            literals = defines[f"KVARN_LM_THR{bits}"].split(",")
            assert all(x.endswith("f") for x in literals)
            assert tuple(float.fromhex(x[:-1]) for x in literals) == lloyd_max_thresholds(bits)
        assert ("KVARN_LM_THR2" in defines) == (v_bits == 2)
    with pytest.raises(KeyError):
        C.compress_spec(128, 128, torch.float16, torch.float16, 2, "nearest")


@pytest.mark.parametrize("cluster_warps", [4, 16])
def test_cluster_warps_variants_compile(cluster_warps):
    """The A/B variants with more warps per cluster CTA (ops.compress.CLUSTER_WARPS): their own module and
    name, their cluster kernels (the layer kernel's and the append's) at 32 x cluster_warps threads without
    spills, the one-CTA kernels as in the shipped module (8 warps)."""
    base = C.compress_spec(128, 128, torch.float16, torch.float16, 2)
    spec = C.compress_spec(128, 128, torch.float16, torch.float16, 2, "uniform", cluster_warps)
    assert dict(base.defines)["KVARN_CW"] == str(C.DEFAULT_CLUSTER_WARPS) and dict(spec.defines)["KVARN_CW"] == str(cluster_warps)
    assert spec.name == base.name + f"_cw{cluster_warps}" and spec.kernel_names == base.kernel_names
    m, m0 = build(spec, "sm_90"), build(base, "sm_90")
    layer, cta, append_compress, append_cluster = spec.kernel_names[:4]
    for kernel in (layer, append_cluster):
        res = m.resources[kernel]
        assert res.spill_store_bytes == 0 and res.stack_bytes == 0, res
        assert res.registers <= (128 if cluster_warps == 16 else 255), res  # __launch_bounds__(32 * W, 1)
    for kernel in (cta, append_compress):
        a, b = m.resources[kernel], m0.resources[kernel]
        assert (a.registers, a.spill_store_bytes, a.stack_bytes, a.shared_bytes) == (
            b.registers, b.spill_store_bytes, b.stack_bytes, b.shared_bytes), kernel
    smem, smem0 = C.kernel_smem_bytes(m.cubin), C.kernel_smem_bytes(m0.cubin)
    assert smem["compress_cta"] == smem0["compress_cta"]
    assert (smem["compress"] > smem0["compress"]) == (cluster_warps > C.DEFAULT_CLUSTER_WARPS)  # part[W][D]


def test_cluster_warps_choice(monkeypatch):
    monkeypatch.delenv(C.CLUSTER_WARPS_ENV, raising=False)
    assert C.cluster_warps() == C.DEFAULT_CLUSTER_WARPS == 8
    monkeypatch.setenv(C.CLUSTER_WARPS_ENV, "4")
    assert C.cluster_warps() == 4
    for bad in ("3", "eight", "32"):
        monkeypatch.setenv(C.CLUSTER_WARPS_ENV, bad)
        with pytest.raises(ValueError, match=C.CLUSTER_WARPS_ENV):
            C.cluster_warps()
    with pytest.raises(ValueError, match="cluster_warps"):
        C.compress_spec(128, 128, torch.float16, torch.float16, 2, "uniform", 2)
    # the cluster-form threshold counts cluster warps per SM: 8 CTAs of 4 warps, 4 of 8, 2 of 16; a
    # 512-token chunk of 8 KV heads (64 halves) runs as clusters of the shipped width on an H200
    monkeypatch.setattr(C, "sm_count", lambda index: 132)
    assert [C.cluster_halves(8, 0, 32 * w) for w in (4, 8, 16)] == [132, 66, 33]
    assert C.cluster_halves(8, 0) == 66 >= 2 * 8 * 512 // 128


def test_cta_warps_variant_compiles():
    """The one-CTA forms with 32 warps (shipped up to head_dim 128) and 16 (the A/B variant there): the 16-warp
    module named apart, the 32-warp one-CTA kernels (the layer kernel's and the append's) at 1024 threads within 64
    registers and without spills at head_dim 64 and 128, the cluster kernels as in the 16-warp module; head_dim 256
    ships 16 and refuses 32 by name."""
    for D in (64, 128):
        spec = C.compress_spec(128, D, torch.float16, torch.float16, 2)
        base = C.compress_spec(128, D, torch.float16, torch.float16, 2, "uniform", C.DEFAULT_CLUSTER_WARPS, 16)
        assert dict(base.defines)["KVARN_OW"] == "16" and dict(spec.defines)["KVARN_OW"] == "32"
        assert base.name == spec.name + "_ow16" and spec.kernel_names == base.kernel_names
        m, m0 = build(spec, "sm_90"), build(base, "sm_90")
        layer, cta, append_compress, append_cluster = spec.kernel_names[:4]
        for kernel in (cta, append_compress):
            res = m.resources[kernel]
            assert res.registers <= 64 and res.spill_store_bytes == 0 and res.stack_bytes == 0, (D, kernel, res)
        for kernel in (layer, append_cluster):
            a, b = m.resources[kernel], m0.resources[kernel]
            assert (a.registers, a.spill_store_bytes, a.shared_bytes) == (b.registers, b.spill_store_bytes,
                                                                         b.shared_bytes), kernel
        smem, smem0 = C.kernel_smem_bytes(m.cubin), C.kernel_smem_bytes(m0.cubin)
        assert smem["compress"] == smem0["compress"] and smem["compress_cta"] > smem0["compress_cta"]  # part[W][D]
    assert dict(C.compress_spec(128, 256, torch.float16, torch.float16, 2).defines)["KVARN_OW"] == "16"
    with pytest.raises(ValueError, match="cta_warps=32.*head_dim=256"):
        C.compress_spec(128, 256, torch.float16, torch.float16, 2, "uniform", C.DEFAULT_CLUSTER_WARPS, 32)
    with pytest.raises(ValueError, match="cta_warps"):
        C.compress_spec(128, 128, torch.float16, torch.float16, 2, "uniform", C.DEFAULT_CLUSTER_WARPS, 8)


def test_cta_warps_choice(monkeypatch):
    monkeypatch.delenv(C.CTA_WARPS_ENV, raising=False)
    shapes = [(128, 64), (128, 128), (128, 256), (64, 64), (64, 128)]
    assert [C.cta_warps(t, d) for t, d in shapes] == [C.default_cta_warps(t, d) for t, d in shapes] == [32, 32, 16,
                                                                                                        16, 16]
    monkeypatch.setenv(C.CTA_WARPS_ENV, "16")
    assert [C.cta_warps(t, d) for t, d in shapes] == [16] * 5
    monkeypatch.setenv(C.CTA_WARPS_ENV, "32")
    assert [C.cta_warps(t, d) for t, d in shapes] == [32, 32, 16, 32, 32]  # 256: 32 does not compile there
    for bad in ("8", "thirty-two", "64"):
        monkeypatch.setenv(C.CTA_WARPS_ENV, bad)
        with pytest.raises(ValueError, match=C.CTA_WARPS_ENV):
            C.cta_warps(128, 128)


def test_layer_layout_is_read_per_kernel_not_per_name():
    # the cluster-warps variants' modules share function names; the 4-warp layout must not be reused for
    # the 8-warp kernel (launched with 128 threads it would deadlock at its first 256-thread barrier)
    class FakeKernel:
        name = "kvarn_compress_t128_d128_f16_s16_v2"

        def __init__(self, threads):
            self.threads = threads

        def attribute(self, attr):
            return {"REQUIRED_CLUSTER_WIDTH": 8, "MAX_THREADS_PER_BLOCK": self.threads}[attr]

    four, eight = FakeKernel(128), FakeKernel(256)
    assert C._layer_layout(four) == (8, 128)
    assert C._layer_layout(eight) == (8, 256)
    assert C._layer_layout(four) == (8, 128)


# Every pair of values of (input dtype, scale dtype, V bits) once: 6 compiles instead of all 12
# combinations; each axis changes its own part of the kernel (loads, scale stores, V packing), and
# the GPU identity tests below compile and run all 12.
DTYPE_PAIRS = [(ind, sd, 2 if (i + j) % 2 == 0 else 4)
               for i, ind in enumerate(IN_DTYPES) for j, sd in enumerate(SCALE_DTYPES)]


@pytest.mark.parametrize("in_dtype,scale_dtype,v_bits", DTYPE_PAIRS)
def test_compress_compiles_every_dtype_pair_sm90(in_dtype, scale_dtype, v_bits):
    spec = C.compress_spec(128, 128, in_dtype, scale_dtype, v_bits)
    m = build(spec, "sm_90")
    assert set(spec.kernel_names) <= set(m.resources)


def _ptx(defines: dict, arch: str = "compute_90", source: str | None = None) -> str:
    from cuda.bindings import nvrtc

    from kvarn_cutlass.runtime.compiler import cuda_include_dirs

    src = source or C.compress_spec(128, 128, torch.float16, torch.float16, 2).source_path.read_text()
    defines = dict(defines)
    prog = nvrtc.nvrtcCreateProgram(src.encode(), b"compress.cu", 0, [], [])[1]
    try:
        opts = [f"-arch={arch}".encode(), b"--std=c++17", b"-default-device", b"--fmad=false"]
        opts += [f"-I{d}".encode() for d in (str(C.compress_spec(128, 128, torch.float16, torch.float16, 2).source_path.parent),
                                              *cuda_include_dirs())]
        opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        n = nvrtc.nvrtcGetPTXSize(prog)[1]
        buf = b" " * n
        nvrtc.nvrtcGetPTX(prog, buf)
        return buf.decode(errors="replace")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_DIV_RN = """__device__ __forceinline__ float div_rn(float a, Recip d) {
  const float q0 = __fmul_rn(a, d.y);
  const float q1 = __fmaf_rn(__fmaf_rn(-d.b, q0, a), d.y, q0);
  return __fmaf_rn(__fmaf_rn(-d.b, q1, a), d.y, q1);
}"""


@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_compress_ptx_has_only_correctly_rounded_arithmetic(quantizer):
    """No approximate or flush-to-zero instruction; every fused multiply-add is one of the fast
    division's (the same source with div_rn spelled as __fdiv_rn has none: no mul + add was
    contracted, --fmad=false), which also keeps correctly rounded reciprocals and IEEE divisions for
    out-of-range operands."""
    spec = C.compress_spec(128, 128, torch.bfloat16, torch.float16, 2, quantizer)
    src = spec.source_path.read_text()
    assert src.count(_DIV_RN) == 1  # the sequence documented (and proved) in compress.cu
    strip = lambda ptx: "\n".join(ln for ln in ptx.splitlines() if not ln.strip().startswith("//"))  # noqa: E731
    text = strip(_ptx(spec.defines))
    assert "mad.f32" not in text and ".approx" not in text and ".ftz" not in text
    assert "div.rn.f32" in text and "sqrt.rn.f32" in text and "rcp.rn.f32" in text
    assert text.count("fma.rn.f32") >= 4
    ieee = strip(_ptx(spec.defines, source=src.replace(_DIV_RN, _DIV_RN.split("{")[0] + "{ return __fdiv_rn(a, d.b); }")))
    assert "fma." not in ieee and "mad.f32" not in ieee
    if quantizer == "lloyd_max":
        # every threshold is compared as an immediate (no table in memory): setp.gt.f32 ..., 0fXXXXXXXX
        compared = set(re.findall(r"setp\.gt\.f32\s+%p\d+, %f\d+, 0f([0-9A-F]{8});", text))
        for bits in (4, 2):
            want = {struct.pack(">f", t).hex().upper() for t in lloyd_max_thresholds(bits)}
            assert want <= compared, sorted(want - compared)
        assert ".local" not in text


@pytest.mark.parametrize("T", [64, 128])
def test_layer_kernel_asks_for_a_cluster_per_record_half_on_sm90(T):
    """The layer kernel's and the append's cluster-form record half runs on a cluster of T / 16 CTAs of
    32 x DEFAULT_CLUSTER_WARPS threads on sm_90 (ops.compress and ops.append read the width back from the loaded kernel) and on
    one CTA of 512 for sm_80; the one-CTA forms and the other append kernels never ask for a cluster."""
    spec = C.compress_spec(T, 64, torch.float16, torch.float16, 4)
    layer, cta, append, append_cluster, commit, snapshot = spec.kernel_names
    for arch, ranks in (("compute_90", T // 16), ("compute_80", None)):
        ptx = _ptx(spec.defines, arch=arch)
        entries = dict(re.findall(r"\.entry (\w+)\((.*?)\n\s*\{", ptx, re.S))
        assert set(spec.kernel_names) <= set(entries)
        directive = lambda name: re.search(rf"\.entry {name}\(.*?\)(.*?)\{{", ptx, re.S).group(1)  # noqa: E731
        for kernel in (layer, append_cluster):
            assert ("reqnctapercluster" in directive(kernel)) == (ranks is not None), kernel
            threads = 32 * (C.DEFAULT_CLUSTER_WARPS if ranks is not None else C.default_cta_warps(T, 64))
            assert re.search(rf"\.maxntid {threads}, 1, 1", directive(kernel)), kernel
            if ranks is not None:
                assert re.search(rf"\.reqnctapercluster {ranks}, 1, 1", directive(kernel)), kernel
        for kernel in (cta, append, commit, snapshot):
            assert "reqnctapercluster" not in directive(kernel), kernel


def test_compress_registered():
    from kvarn_cutlass.runtime import registry

    fam = registry.families()
    assert "compress" in fam
    names = {n for s in fam["compress"] for n in s.kernel_names}
    per_input_dtype = 2 * 2 * 3 * 2 * 2  # T x v_bits (the presets) x D x scale dtype x quantizer
    # the codec's 2 kernels for 3 input dtypes; the 4 append kernels for the 2 cache dtypes
    assert len(names) == 2 * 3 * per_input_dtype + 4 * 2 * per_input_dtype
    assert C.kernel_name(128, 128, torch.float16, torch.float16, 2) in names
    assert C.kernel_name(64, 256, torch.float32, torch.float32, 4, "lloyd_max") in names
    assert C.kernel_name(64, 256, torch.bfloat16, torch.float32, 4, "lloyd_max", "append_commit") in names


# ================================================================ CPU: argument checks ===========
def test_compress_rejects_bad_arguments():
    spec = TileSpec()
    k = torch.zeros(2, 128, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="k is on cpu"):
        C.compress_tiles(k, k, spec)
    with pytest.raises(TypeError, match="spec must be"):
        C.compress_tiles(k, k, "k4v2_g128")
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        C.compress_tiles(k.numpy(), k, spec)
    with pytest.raises(TypeError, match="v has dtype torch.int32"):
        C.compress_tiles(k, k.to(torch.int32), spec)
    with pytest.raises(ValueError, match=r"k must have shape \[\.\.\., 128, 128\]"):
        C.compress_tiles(k[:, :64], k, spec)
    with pytest.raises(ValueError, match=r"k must have shape \[batch, heads, n_tiles\*128, 128\]"):
        C.compress_layer(torch.zeros(1, 2, 100, 128), torch.zeros(1, 2, 100, 128), spec)
    with pytest.raises(ValueError, match="k is on cpu"):
        C.compress_layer(torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, 128), spec)


def test_error_messages_follow_codec_order():
    f16 = torch.float16
    assert C.error_message(1 << 6 | 1 << 0, f16) == "k contains NaN or Inf"
    assert C.error_message(1 << 9 | 1 << 3, f16).startswith("v has values of magnitude > 2^48")
    assert C.error_message(1 << 1 | 1 << 3, f16) == (
        "K chan step overflows torch.float16: the input's magnitude needs scale_dtype=torch.float32"
    )
    assert C.error_message(1 << 5, torch.float32).startswith("V tok min overflows torch.float32")
    with pytest.raises(ValueError):
        C.error_message(1 << 20, f16)
    # lloyd_max stores the min (the mean) before the step (the RMS about it): the codec raises on the min
    assert C.error_message(1 << 1 | 1 << 2, f16, "lloyd_max") == (
        "K chan min overflows torch.float16: the input's magnitude needs scale_dtype=torch.float32"
    )
    assert C.error_message(1 << 1 | 1 << 2, f16, "uniform").startswith("K chan step")
    assert C.error_message(1 << 4 | 1 << 5 | 1 << 1, f16, "lloyd_max").startswith("K chan step")  # K half first
    assert C.error_message(1 << 4 | 1 << 5, f16, "lloyd_max").startswith("V tok min")
    assert C.error_message(1 << 0 | 1 << 2, f16, "lloyd_max").startswith("K row_scale")
    with pytest.raises(ValueError, match="quantizer"):
        C.error_message(1 << 1, f16, "nearest")


# ================================================================ GPU: byte identity ============
def _gen(kind: str, n: int, T: int, D: int, g: torch.Generator) -> torch.Tensor:
    """float32 [n, T, D] test tiles."""
    if kind == "randn":
        return torch.randn(n, T, D, generator=g)
    if kind == "outliers":  # scaled randn with a few large channels, per-record scale
        x = torch.randn(n, T, D, generator=g) * torch.exp(torch.randn(n, 1, 1, generator=g))
        ch = torch.randint(0, D, (n, 4), generator=g)
        for i in range(n):
            x[i, :, ch[i]] *= 20.0
        return x
    if kind == "rope":  # RoPE-like: per-channel-pair rotation of a slowly varying vector by position
        pos = torch.arange(T, dtype=torch.float64)[:, None]
        freq = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) / (D // 2))
        ang = pos * freq
        base = torch.randn(n, 1, D, generator=g, dtype=torch.float64) * 3 + torch.randn(n, T, D, generator=g, dtype=torch.float64) * 0.3
        a, b = base[..., : D // 2], base[..., D // 2 :]
        out = torch.cat((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), -1)
        return out.float()
    raise ValueError(kind)


def _sanitize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # +0.0 turns -0.0 into +0.0: the codec's min/max of mixed-sign zeros is not defined bit for bit
    # (see ops/compress.py); every other value is kept.
    return x.to(dtype) + 0.0


def _check_identity(k: torch.Tensor, v: torch.Tensor, spec: TileSpec, poison: int = 0xAB,
                    seed: int | None = None) -> None:
    ref = codec.encode_tiles(k, v, spec)
    out = torch.full(ref.shape, poison, dtype=torch.uint8, device="cuda")
    got = C.compress_tiles(k.cuda(), v.cuda(), spec, out=out)
    assert got.data_ptr() == out.data_ptr()
    got = got.cpu()
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()
        first = bad[0].tolist()
        secs = {name: spec.section(name) for name in spec.section_names()}
        where = next(n for n, (o, s) in secs.items() if o <= first[-1] < o + s)
        raise AssertionError(
            ("" if seed is None else f"seed={seed}: ")
            + f"{len(bad)} bytes differ ({spec.preset}, D={spec.head_dim}, {spec.scale_dtype}, {k.dtype}); "
            f"first at {first} in section {where!r}: got {int(got[tuple(first)])}, want {int(ref[tuple(first)])}"
        )


COMBOS = [
    (p, D, sd, ind) for p in PRESETS for D in HEAD_DIMS for sd in SCALE_DTYPES for ind in IN_DTYPES
]
# lloyd_max: every preset x head_dim x scale dtype, the input dtype cycling through the three (it only
# changes the load, which the uniform combos cover in full): 24 compiled variants rather than 72.
LM_COMBOS = [
    (p, D, sd, IN_DTYPES[i % len(IN_DTYPES)])
    for i, (p, D, sd) in enumerate(itertools.product(PRESETS, HEAD_DIMS, SCALE_DTYPES))
]
QCOMBOS = [("uniform", *c) for c in COMBOS] + [("lloyd_max", *c) for c in LM_COMBOS]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,in_dtype", QCOMBOS)
@pytest.mark.parametrize("kind", ["randn", "outliers", "rope"])
def test_gpu_identity_random(quantizer, preset, D, scale_dtype, in_dtype, kind):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    seed = zlib.crc32(repr((quantizer, preset, D, scale_dtype, in_dtype, kind)).encode())
    g = torch.Generator().manual_seed(seed)
    T = spec.tile_tokens
    for _ in range(3):
        k = _sanitize(_gen(kind, 12, T, D, g), in_dtype)
        v = _sanitize(_gen(kind, 12, T, D, g), in_dtype)
        _check_identity(k, v, spec, seed=seed)


def _adversarial(T: int, D: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    r = lambda: torch.randn(T, D, generator=g)  # noqa: E731
    big = 6.0e4 if dtype == torch.float16 else 1.0e6
    cases = {
        "zeros": torch.zeros(T, D),
        "constant_channels": torch.randn(1, D, generator=g).expand(T, D).clone(),
        "constant_tokens": torch.randn(T, 1, generator=g).expand(T, D).clone(),
        "constant": torch.full((T, D), 3.25),
        "one_channel": torch.zeros(T, D).index_fill_(1, torch.tensor([5]), 1.0),
        "one_token": torch.zeros(T, D).index_fill_(0, torch.tensor([3]), -2.0),
        "outliers_near_max": r().clamp(-3, 3) * (big / 3),
        "outlier_entries": r().index_put_((torch.tensor([0, T - 1]), torch.tensor([1, D - 2])), torch.tensor([big, -big])),
        "one_huge_token": torch.cat((r()[: T - 1], r()[:1] * big / 4)),
        "ties": torch.randint(-2, 3, (T, D), generator=g).float() * 0.5,
        "binary": torch.randint(0, 2, (T, D), generator=g).float(),
        "tiny": r() * 1e-6,
        # zero lines (smallest scales) and the lloyd_max refit's sparse axes (issue 18)
        "subnormal_constant": torch.full((T, D), 3 * 2.0**-24),
        "negative_subnormal_constant": torch.full((T, D), -5 * 2.0**-24),
        "constant_per_token": (torch.arange(T, dtype=torch.float32)[:, None] - T / 2 + 0.5).expand(T, D) / 8,
        "sparse": torch.where(torch.rand(T, D, generator=g) < 0.02, r(), torch.zeros(T, D)),
    }
    if dtype == torch.float16:
        cases["fp16_denormals"] = torch.randint(-40, 41, (T, D), generator=g).float() * 2.0**-24
        cases["fp16_mixed_denormals"] = r() * 2.0**-20
    else:
        cases["huge_range"] = r() * 1e12
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer,preset,D,scale_dtype,in_dtype", QCOMBOS)
def test_gpu_identity_adversarial(quantizer, preset, D, scale_dtype, in_dtype):
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, quantizer=quantizer)
    T = spec.tile_tokens
    cases = _adversarial(T, D, in_dtype)
    seed = zlib.crc32(repr((quantizer, preset, D, scale_dtype, in_dtype)).encode())
    g = torch.Generator().manual_seed(seed)  # the random partner of each adversarial half
    for name, x in cases.items():
        for kx, vx in ((x, x), (x, torch.randn(T, D, generator=g)), (torch.randn(T, D, generator=g), x)):
            k, v = _sanitize(kx[None], in_dtype), _sanitize(vx[None], in_dtype)
            try:
                codec.encode_tiles(k, v, spec)
            except ValueError as e:
                with pytest.raises(ValueError, match=str(e).split(":")[0]):
                    C.compress_tiles(k.cuda(), v.cuda(), spec)
                continue
            try:
                _check_identity(k, v, spec)
            except AssertionError as e:
                raise AssertionError(f"case {name} (seed={seed}, cases seed=7): {e}") from None


# ---- tiles whose codes sit exactly on a decision boundary ----------------------------------------
# With sinkhorn_iters=0 the normalization keeps r = s = 1 (row_scale = col_scale = 1), so u is the
# rotated tile y, and float32 WHT of these inputs is exact (D = 64 or 256: sqrt(D) is a power of two):
# * K: one nonzero input channel, x[t, 1] = a_t * sqrt(D), rotates to y[t, c] = +-a_t: every K axis
#   (a channel over tokens) is a or -a, whose fields mirror a's (the codec's sums are sign-symmetric).
# * V (uniform, float16 scales): x[t, :8] = (sqrt(D) / 8) * H8 @ v_t rotates to y[t, c] = v_t[c % 8]:
#   eight values per token, exact when each v has few significant bits.
# The decision of an element is then made at the boundary itself: z = (u - min) / step equal to a
# lloyd_max threshold (ties go to the lower code) or to k + 1/2 for uniform (rint: to the even code).
# A division that is not the correctly rounded quotient moves z off the boundary and the code by one.

def _f32_walk(v: np.float32, z_of, target: np.float32, steps: int = 64) -> np.float32 | None:
    """The float32 near v whose z_of(v) is exactly target (by ulps), or None."""
    for _ in range(steps):
        z = z_of(v)
        if z == target:
            return v
        v = np.nextafter(v, np.float32(np.inf) if z < target else np.float32(-np.inf))
    return None


def _lloyd_max_tie_axis(T: int, sd: torch.dtype, t: float) -> np.ndarray:
    """A lloyd_max axis a [T] float32 holding one element whose final z is exactly the threshold t.
    Skewed fillers (exponential quantiles less their mean) fix min and step; the tie element is put
    at the previous round's boundary until the fields stop moving (tests/test_codec.py::_tie_axis
    explains the rounds and the scaling that float32 steps need)."""
    for seed in range(16):
        q = (np.arange(T - 1) + 0.5) / (T - 1)
        base = np.random.default_rng(seed).permutation(-np.log1p(-q) - 1)
        scale = 1.0
        for _ in range(3):
            fill = (base * scale).astype(np.float32)
            u = np.concatenate([fill, np.zeros(1, np.float32)])
            for _ in range(20):
                step, low, _ = codec._quantize(torch.from_numpy(u)[None], 4, -1, sd, "axis", "lloyd_max")
                st, lo = np.float32(step.item()), np.float32(low.item())
                v = _f32_walk(np.float32(lo + st * np.float32(t)), lambda x: np.float32(np.float32(x - lo) / st), np.float32(t))
                if v is None:
                    break
                new = np.concatenate([fill, np.array([v], np.float32)])
                if (new == u).all():
                    break
                u = new
            else:
                break
            if v is None:
                break
            significand = float(st) / 2.0 ** np.floor(np.log2(float(st)))
            if sd == torch.float16 or significand < 1.01:
                return u
            scale *= 1.004 / significand
    raise AssertionError(f"no lloyd_max tie axis for t={t}, T={T}, {sd}")


def _tie_tiles(quantizer: str, T: int, D: int, sd: torch.dtype, v_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (k, v) [n, T, D] whose codes meet the decision boundaries exactly (see above); v is
    None where there is no construction (lloyd_max V axes, uniform V with float32 scales)."""
    root = float(D) ** 0.5
    axes = []
    if quantizer == "lloyd_max":
        axes = [_lloyd_max_tie_axis(T, sd, t) for t in lloyd_max_thresholds(4)]  # K codes are 4-bit
    else:
        # min -1 and max 1: lo = -1, step = stored(2 / 15); ties at z = k + 1/2 for every k
        rng = np.random.default_rng(T + D)
        step = np.float32(torch.tensor(2.0 / 15).to(sd).item())
        ties = [_f32_walk(np.float32(-1 + step * np.float32(k + 0.5)), lambda x: np.float32(np.float32(x + 1) / step),
                          np.float32(k + 0.5)) for k in range(15)]
        ties = [x for x in ties if x is not None]
        fill = rng.uniform(-0.99, 0.99, T - 2 - len(ties)).astype(np.float32)
        axes = [rng.permutation(np.concatenate([[-1.0, 1.0], ties, fill]).astype(np.float32))]
    k = torch.zeros(len(axes), T, D)
    k[:, :, 1] = torch.from_numpy(np.stack(axes)) * root
    if quantizer == "lloyd_max" or sd != torch.float16:
        return k, None
    # V (uniform, float16 scales): per token the values -1, 1 and six boundaries m + 1/2 (m cycling)
    qmax = 2**v_bits - 1
    step = float(torch.tensor(2.0 / qmax).to(torch.float16))  # exact: 11 bits
    h8 = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(8)] for i in range(8)], dtype=torch.float64)
    v = torch.zeros(1, T, D)
    for t in range(T):
        mids = [-1 + step * ((t + i) % qmax + 0.5) for i in range(6)]  # exact in float32 (<= 17 bits)
        vals = torch.tensor([-1.0, 1.0] + mids, dtype=torch.float64)
        v[0, t, :8] = (root / 8 * h8 @ vals).float()
    return k, v


def _boundary_hits(x: torch.Tensor, spec: TileSpec, half: str) -> int:
    """How many elements of the rotated tiles x have z exactly on a decision boundary, with the fields
    of their records (the codec's)."""
    f = codec.unpack_fields(codec.encode_tiles(x, x, spec), spec)
    y = codec.wht(x.float())
    if half == "K":
        u, low, step = y.transpose(-1, -2), f.chan_min[..., None], f.chan_step[..., None]  # [n, D, T]
    else:
        u, low, step = y, f.tok_min[..., None], f.tok_step[..., None]  # [n, T, D]
    assert bool((f.row_scale == 1).all()) and bool((f.col_scale == 1).all())
    z = ((u - low) / torch.where(step > 0, step, torch.ones_like(step))).double()
    if spec.quantizer == "lloyd_max":
        bounds = torch.tensor(lloyd_max_thresholds(4 if half == "K" else spec.v_bits), dtype=torch.float64)
        return int((z[..., None] == bounds).any(-1).sum())
    return int(((z - z.floor()) == 0.5).sum())


@pytest.mark.parametrize("quantizer,T,D,scale_dtype", [("lloyd_max", 64, 64, torch.float16), ("lloyd_max", 128, 256, torch.float32),
                                                      ("uniform", 64, 256, torch.float16), ("uniform", 128, 64, torch.float32)])
def test_tie_tiles_meet_the_decision_boundaries(quantizer, T, D, scale_dtype):
    # the constructions' promise, checked with the codec: lloyd_max, every K axis (D per tile) its
    # threshold, over the tiles every threshold; uniform, the D/2 axes +a (-a has other fields) every
    # midpoint (float16 steps) or most (float32); uniform V (float16 scales) six midpoints per token
    spec = TileSpec(preset=f"k4v2_g{T}", head_dim=D, scale_dtype=scale_dtype, sinkhorn_iters=0, quantizer=quantizer)
    k, v = _tie_tiles(quantizer, T, D, scale_dtype, spec.v_bits)
    hits = _boundary_hits(k, spec, "K")
    if quantizer == "lloyd_max":
        assert hits == 15 * D, hits
    else:
        assert hits >= D // 2 * (15 if scale_dtype == torch.float16 else 10), hits
    if v is not None:
        assert _boundary_hits(v, spec, "V") == 6 * T * D // 8
    else:
        assert quantizer == "lloyd_max" or scale_dtype != torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_gpu_decision_boundary_ties(quantizer, preset, D, scale_dtype):
    # exact ties: lloyd_max z == t_j (the lower code), uniform z == k + 1/2 (the even code)
    spec = TileSpec(preset=preset, head_dim=D, scale_dtype=scale_dtype, sinkhorn_iters=0, quantizer=quantizer)
    k, v = _tie_tiles(quantizer, spec.tile_tokens, D, scale_dtype, spec.v_bits)
    _check_identity(k, k.flip(0), spec)
    if v is not None:
        _check_identity(v.expand(len(k), -1, -1), v.expand(len(k), -1, -1), spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("iters", [0, 1, 2, 7])
def test_gpu_identity_sinkhorn_iters(quantizer, iters):
    spec = TileSpec(sinkhorn_iters=iters, quantizer=quantizer)
    g = torch.Generator().manual_seed(iters)
    k = _sanitize(_gen("outliers", 8, 128, 128, g), torch.float16)
    v = _sanitize(_gen("rope", 8, 128, 128, g), torch.float16)
    _check_identity(k, v, spec, seed=iters)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_gpu_every_byte_written_and_lead_dims(quantizer):
    spec = TileSpec(preset="k4v4_g64", head_dim=64, quantizer=quantizer)
    g = torch.Generator().manual_seed(3)
    k = _sanitize(torch.randn(2, 3, 64, 64, generator=g), torch.bfloat16)
    v = _sanitize(torch.randn(2, 3, 64, 64, generator=g), torch.bfloat16)
    for poison in (0x00, 0xAB, 0xFF):
        _check_identity(k, v, spec, poison=poison, seed=3)
    got = C.compress_tiles(k.cuda(), v.cuda(), spec)
    assert got.shape == (2, 3, spec.tile_nbytes)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_mixed_input_dtypes_and_strided_input():
    spec = TileSpec()
    g = torch.Generator().manual_seed(5)
    k = _sanitize(torch.randn(4, 128, 128, generator=g), torch.float16)
    v = _sanitize(torch.randn(4, 128, 128, generator=g), torch.bfloat16)
    ref = codec.encode_tiles(k, v, spec)
    assert torch.equal(C.compress_tiles(k.cuda(), v.cuda(), spec).cpu(), ref)
    # token-strided views: every other head of a bigger buffer
    kb = torch.zeros(8, 128, 128, dtype=torch.float16, device="cuda")
    kb[::2] = k.cuda()
    assert torch.equal(C.compress_tiles(kb[::2], v.cuda(), spec).cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "quantizer,preset,D",
    [("uniform", "k4v2_g128", 128), ("uniform", "k4v4_g64", 256), ("uniform", "k4v2_g64", 64),
     ("lloyd_max", "k4v2_g128", 128), ("lloyd_max", "k4v4_g64", 64)],
)
def test_gpu_compress_layer_into_pool_slice(quantizer, preset, D):
    spec = TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
    T = spec.tile_tokens
    B, H, n_tiles, extra = 2, 3, 2, 64
    g = torch.Generator().manual_seed(11)
    full_k = _sanitize(torch.randn(B, H, n_tiles * T + extra, D, generator=g), torch.float16).cuda()
    full_v = _sanitize(torch.randn(B, H, n_tiles * T + extra, D, generator=g), torch.float16).cuda()
    k, v = full_k[:, :, extra:], full_v[:, :, extra:]  # a token-offset view, like the cache's stream
    pool = torch.full((B, 5, H, spec.tile_nbytes), 0xAB, dtype=torch.uint8, device="cuda")
    got = C.compress_layer(k, v, spec, out=pool[:, 1 : 1 + n_tiles])
    assert got.data_ptr() == pool[:, 1].data_ptr()
    tiles = lambda x: x.reshape(B, H, n_tiles, T, D).transpose(1, 2).cpu()  # noqa: E731
    ref = codec.encode_tiles(tiles(k), tiles(v), spec)
    assert torch.equal(pool[:, 1 : 1 + n_tiles].cpu(), ref)
    assert bool((pool[:, 0] == 0xAB).all()) and bool((pool[:, 1 + n_tiles :] == 0xAB).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
def test_gpu_errors_match_codec(quantizer):
    spec = TileSpec(quantizer=quantizer)
    g = torch.Generator().manual_seed(2)
    good = torch.randn(2, 128, 128, generator=g, dtype=torch.float32)
    nan = good.clone()
    nan[1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        C.compress_tiles(nan.cuda(), good.cuda(), spec)
    with pytest.raises(ValueError, match="v contains NaN or Inf"):
        C.compress_tiles(good.cuda(), nan.cuda(), spec)
    huge = good * 2.0**50
    with pytest.raises(ValueError, match="v has values of magnitude"):
        C.compress_tiles(good.cuda(), huge.cuda(), spec)
    # float16 scale overflow: bfloat16 input of magnitude 1e12
    big = (torch.randn(1, 128, 128, generator=g) * 1e12).to(torch.bfloat16)
    with pytest.raises(ValueError) as ref:
        codec.encode_tiles(big, big, spec)
    with pytest.raises(ValueError) as got:
        C.compress_tiles(big.cuda(), big.cuda(), spec)
    assert str(got.value) == str(ref.value)
    # the flag was reset: a good launch afterwards succeeds, and matches
    _check_identity(good[:1], good[:1], spec)
    # deferred check
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    C.compress_tiles(big.cuda(), big.cuda(), spec, error_flag=flag)
    with pytest.raises(ValueError, match="overflows torch.float16"):
        C.check_error_flag(flag, spec)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "quantizer,preset,D,dtype",
    [("uniform", "k4v2_g128", 128, torch.float16), ("uniform", "k4v4_g64", 64, torch.bfloat16),
     ("lloyd_max", "k4v2_g128", 128, torch.float16), ("lloyd_max", "k4v4_g64", 64, torch.bfloat16)],
)
def test_gpu_cache_matches_cpu_cache(quantizer, preset, D, dtype):
    kw = dict(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=D, preset=preset, dtype=dtype, quantizer=quantizer)
    T = PRESETS[preset][2]
    cpu = KVarNCache(**kw, device="cpu", window=T, sink_tokens=T)
    gpuc = KVarNCache(**kw, device="cuda", window=T, sink_tokens=T)
    g = torch.Generator().manual_seed(1)
    for n in (5, 200, 1, 3 * T + 7, 64, 2 * T):
        for layer in range(2):
            k = _sanitize(torch.randn(2, 3, n, D, generator=g) * 2, dtype)
            v = _sanitize(torch.randn(2, 3, n, D, generator=g), dtype)
            cpu.append(layer, k, v)
            gpuc.append(layer, k.cuda(), v.cuda())
            assert gpuc.num_tiles(layer) == cpu.num_tiles(layer)
            assert torch.equal(gpuc.tile_bytes(layer).cpu(), cpu.tile_bytes(layer))
    assert cpu.num_tiles(0) > 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_cache_error_leaves_cache_unchanged():
    c = KVarNCache(1, 1, 2, 128, dtype=torch.bfloat16, device="cuda", window=128)
    S = 13
    g = torch.Generator(device="cuda").manual_seed(S)
    k = torch.randn(1, 2, 100, 128, generator=g, device="cuda").to(torch.bfloat16)
    c.append(0, k, k)
    before = (c.seq_len(0), c.num_tiles(0), c.window_kv(0)[0].clone())
    big = (torch.randn(1, 2, 200, 128, generator=g, device="cuda") * 1e12).to(torch.bfloat16)
    with pytest.raises(ValueError):
        c.append(0, big, big)
    assert (c.seq_len(0), c.num_tiles(0)) == before[:2], f"seed={S}"
    assert torch.equal(c.window_kv(0)[0], before[2]), f"seed={S}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_fast_division_is_the_ieee_quotient(tmp_path):
    """kvc::div_rn (the kernel's division by a shared divisor) against __fdiv_rn on the device, on the
    operands of tests/test_compress_emulation.py::test_fast_division_is_the_ieee_quotient plus 2^24
    random ones over the admitted ranges (divisor in [2^-32, 2^32], dividend 0 or in [2^-92, 2^92]);
    and outside them kvc::divisor_ok / dividend_ok must say no (there the kernel divides by IEEE)."""
    from kvarn_cutlass.runtime.spec import CSRC_DIR, KernelSpec, get_kernel

    probe = """
extern "C" __global__ void kvarn_divtest(const float* a, const float* b, float* fast, float* ieee, int* in_range, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  fast[i] = kvc::div_rn(a[i], kvc::recip(b[i]));
  ieee[i] = __fdiv_rn(a[i], b[i]);
  in_range[i] = kvc::divisor_ok(b[i]) && kvc::dividend_ok(a[i]);
}
"""
    base = C.compress_spec(128, 128, torch.float16, torch.float16, 2)
    src = tmp_path / "divtest.cu"
    src.write_text(base.source_path.read_text() + probe)
    spec = KernelSpec(str(src), ("kvarn_divtest",), defines=base.defines, options=base.options + (f"-I{CSRC_DIR}",))
    kernel = get_kernel(spec, "kvarn_divtest", ("ptr a", "ptr b", "ptr fast", "ptr ieee", "ptr in_range", "i32 n"))
    seed = 17
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1 << 24
    bits_b = torch.randint(0, 2**23, (n,), device="cuda", generator=g, dtype=torch.int64)
    bits_b[: n // 4] = 2**23 - 1  # all-ones significands: a * RN(1/b) furthest from a / b
    e_b = torch.randint(127 - 34, 127 + 34, (n,), device="cuda", generator=g)
    e_a = torch.randint(127 - 96, 127 + 96, (n,), device="cuda", generator=g)
    sign = lambda: torch.randint(0, 2, (n,), device="cuda", generator=g) << 31  # noqa: E731
    b = ((e_b << 23) | bits_b | sign()).to(torch.int32).view(torch.float32)
    a = ((e_a << 23) | torch.randint(0, 2**23, (n,), device="cuda", generator=g) | sign()).to(torch.int32).view(torch.float32)
    near = (b * torch.randint(0, 32, (n,), device="cuda", generator=g).float() / 2)  # quotients at k / 2
    a = torch.where(torch.rand(n, device="cuda", generator=g) < 0.25, near, a)
    a[:64] = torch.tensor([0.0, -0.0, 2.0**-92, -(2.0**-92), 2.0**92, 2.0**-93, 2.0**93, 1e-40] * 8)
    fast, ieee = torch.empty_like(a), torch.empty_like(a)
    in_range = torch.empty(n, dtype=torch.int32, device="cuda")
    kernel.launch((n + 255) // 256, 256, (a, b, fast, ieee, in_range, n))
    ok = in_range.bool()
    a64, b64 = a.double(), b.double()
    want_ok = (b64.abs() >= 2.0**-32) & (b64.abs() <= 2.0**32) & ((a64 == 0) | ((a64.abs() >= 2.0**-92) & (a64.abs() <= 2.0**92)))
    assert torch.equal(ok, want_ok), f"seed={seed}: the range checks differ from the documented ranges"
    assert int(ok.sum()) > n // 2
    bad = ok & ((fast != ieee) | ((fast == 0) != (ieee == 0)))
    assert not bool(bad.any()), (f"seed={seed}: {int(bad.sum())} quotients differ, first a={a[bad][0].item()!r} "
                                 f"b={b[bad][0].item()!r}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["k4v2_g128", "k4v4_g64"])
def test_gpu_rejected_half_writes_nothing(preset):
    # a NaN in one token (of a non-first rank of the cluster) rejects its whole record half: the
    # half's bytes stay as they were, the other half and the other records are written
    spec = TileSpec(preset=preset)
    T, nb = spec.tile_tokens, spec.tile_nbytes
    g = torch.Generator().manual_seed(23)
    k = _sanitize(torch.randn(3, T, 128, generator=g), torch.float16)
    v = _sanitize(torch.randn(3, T, 128, generator=g), torch.float16)
    ref = codec.encode_tiles(k, v, spec)
    bad = k.clone()
    bad[1, 3 + T // 16, 9] = float("nan")  # token T/16 + 3: rank 3 of the cluster
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full((3, nb), 0xAB, dtype=torch.uint8, device="cuda")
    C.compress_tiles(bad.cuda(), v.cuda(), spec, out=out, error_flag=flag)
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        C.check_error_flag(flag, spec)
    out = out.cpu()
    k_end = spec.offset("v_codes")
    assert torch.equal(out[[0, 2]], ref[[0, 2]])
    assert bool((out[1, :k_end] == 0xAB).all()) and torch.equal(out[1, k_end:], ref[1, k_end:])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90 (clusters)")
@pytest.mark.parametrize("cluster_warps", [4, 16])
@pytest.mark.parametrize("quantizer,preset,D", [("uniform", "k4v2_g128", 128), ("lloyd_max", "k4v4_g64", 256),
                                                ("uniform", "k4v2_g64", 64)])
def test_gpu_identity_of_the_cluster_warps_variants(monkeypatch, cluster_warps, quantizer, preset, D):
    # the layer kernel's cluster form with 4 or 16 warps per CTA ($KVARN_COMPRESS_CLUSTER_WARPS), few records
    monkeypatch.setenv(C.CLUSTER_WARPS_ENV, str(cluster_warps))
    spec = TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
    T = spec.tile_tokens
    seed = zlib.crc32(repr((cluster_warps, quantizer, preset, D)).encode())
    g = torch.Generator().manual_seed(seed)
    k = _sanitize(_gen("outliers", 3, T, D, g), torch.float16)
    v = _sanitize(_gen("rope", 3, T, D, g), torch.float16)
    _check_identity(k, v, spec, seed=seed)
    kernel = C._kernel(torch.cuda.current_device(), C.compress_spec(T, D, torch.float16, spec.scale_dtype, spec.v_bits,
                                                                    quantizer, cluster_warps))
    assert C._layer_layout(kernel) == (T // 16, 32 * cluster_warps)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer,preset,D", [("uniform", "k4v2_g128", 128), ("lloyd_max", "k4v4_g64", 128),
                                                ("uniform", "k4v2_g64", 64), ("lloyd_max", "k4v2_g128", 64)])
@pytest.mark.parametrize("warps", C.CTA_WARPS)
def test_gpu_identity_of_the_cta_warps_variant(monkeypatch, quantizer, preset, D, warps):
    # the one-CTA layer kernel at each width ($KVARN_COMPRESS_CTA_WARPS), a launch of more halves than fit as clusters
    monkeypatch.setenv(C.CTA_WARPS_ENV, str(warps))
    spec = TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
    T = spec.tile_tokens
    index = torch.cuda.current_device()
    ranks = T // 16 if torch.cuda.get_device_capability(index)[0] >= 9 else 1
    n = C.cluster_halves(ranks, index, 32 * C.DEFAULT_CLUSTER_WARPS) // 2 + 1
    seed = zlib.crc32(repr((f"ow{warps}", quantizer, preset, D)).encode())
    g = torch.Generator().manual_seed(seed)
    k = _sanitize(_gen("outliers", n, T, D, g), torch.float16)
    v = _sanitize(_gen("rope", n, T, D, g), torch.float16)
    _check_identity(k, v, spec, seed=seed)
    kspec = C.compress_spec(T, D, torch.float16, spec.scale_dtype, spec.v_bits, quantizer, C.DEFAULT_CLUSTER_WARPS,
                            warps)
    assert C._layer_layout(C._kernel(index, kspec, "compress_cta")) == (1, 32 * warps)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("quantizer", ["uniform", "lloyd_max"])
@pytest.mark.parametrize("preset,D", [("k4v2_g128", 128), ("k4v4_g64", 256), ("k4v2_g64", 64)])
def test_gpu_identity_cluster_and_one_cta_layer_kernels(quantizer, preset, D):
    # a launch of few records runs the cluster kernel, one of more halves than fit as clusters the
    # one-CTA kernel (ops.compress picks by the device's SM count): both byte-identical to the codec
    spec = TileSpec(preset=preset, head_dim=D, quantizer=quantizer)
    T = spec.tile_tokens
    index = torch.cuda.current_device()
    ranks = T // 16 if torch.cuda.get_device_capability(index)[0] >= 9 else 1
    many = C.cluster_halves(ranks, index) // 2 + 1
    seed = zlib.crc32(repr((quantizer, preset, D)).encode())
    g = torch.Generator().manual_seed(seed)
    for n in (3, many):
        k = _sanitize(_gen("outliers", n, T, D, g), torch.bfloat16)
        v = _sanitize(_gen("rope", n, T, D, g), torch.bfloat16)
        _check_identity(k, v, spec, seed=seed)
