"""CPU tests of decode: every shipped kernel variant compiles (NVRTC, sm_90 and sm_80) without spills,
the kernel's record layout comes from kvarn_cutlass.format, its fragment plumbing (ldmatrix, byte
permutes, masks, mma.sync layouts, the shared-memory swizzle and exchange buffers) computes the intended
products (a model of one warp with the PTX semantics of each instruction), argument validation."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch

import kvarn_cutlass as kc
from kvarn_cutlass import decode
from kvarn_cutlass.format import HEAD_DIMS, PRESETS, QUANTIZERS, SCALE_DTYPES, TileSpec, codebook
from kvarn_cutlass.runtime import build
from kvarn_cutlass.runtime.registry import families

from _helpers import load_tool, require_disassembler


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("spec", decode.decode_specs(), ids=lambda s: s.name)
def test_variant_compiles(spec, arch):
    mod = build(spec, arch)
    for name in spec.kernel_names:
        assert name in mod.resources
        res = mod.resources[name]
        # uniform: no spills; lloyd_max with G > 4 (the _n2 kernel: two 4-head blocks of scores and outputs,
        # two table levels each) or head_dim 256 spills up to 64 bytes at its register bound (measured
        # sm_90: <= 28, sm_80: <= 64)
        limit = 64 if name.endswith("_lm") and ("_n2_" in name or "_d256_" in name) else 0
        assert res.spill_store_bytes is not None and res.spill_store_bytes <= limit, (name, res)


def test_registered_family():
    fams = families()
    assert "decode" in fams
    assert len(fams["decode"]) == len(PRESETS) * len(HEAD_DIMS) * len(SCALE_DTYPES) * len(QUANTIZERS)
    names = {s.name for s in fams["decode"]}
    assert "decode_d128_t128_v2_s2" in names and "decode_d128_t128_v2_s2_lm" in names


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_spec_carries_the_format_layout(preset, head_dim, scale_dtype, quantizer):
    """Every record offset the kernel uses is a define taken from TileSpec (none written in the .cu file)."""
    ts = TileSpec(preset=preset, head_dim=head_dim, scale_dtype=scale_dtype, quantizer=quantizer)
    ks = decode.decode_spec(ts)
    d = dict(ks.defines)
    assert int(d["KVD_REC"]) == ts.tile_nbytes
    for name in ts.section_names():
        assert int(d[f"KVD_OFF_{name.upper()}"]) == ts.offset(name), name
    sfx = d["KVD_SFX"]
    assert ks.kernel_names == (f"kvarn_decode_n1_{sfx}", f"kvarn_decode_n2_{sfx}")
    assert sfx.endswith("_lm") == (quantizer == "lloyd_max")
    assert ("KVD_KTH0" in d) == (quantizer == "lloyd_max")


def test_no_record_offsets_in_the_source():
    """The .cu file reads offsets only through the KVD_OFF_* / KVD_REC defines, with no fallback values."""
    src = decode.decode_spec(TileSpec()).source_path.read_text()
    for name in TileSpec().section_names():
        assert f"KVD_OFF_{name.upper()}" in src
    assert "#ifndef KVD_D\n" not in src and "#define KVD_D " not in src


@pytest.mark.parametrize("bits", [2, 4])
def test_lm_tables(bits):
    """Two int8 levels of the lloyd_max books within 1/(508 s) of the centroids; the 2-bit book is
    c[0] + a0 k + g1 bit1(k) exactly (what the kernel uses for 2-bit V)."""
    book = codebook("lloyd_max", bits)
    s, th, tl = decode.lm_tables(book)
    for c, h, lo in zip(book, th, tl):
        assert abs((h + lo / 254) / s - c) <= 1 / (508 * s) + 1e-12
        assert max(abs(h), abs(lo)) <= 127
    if bits == 2:
        a0, g1 = book[1] - book[0], book[2] - 2 * book[1] + book[0]
        for k, c in enumerate(book):
            assert book[0] + a0 * k + g1 * ((k >> 1) & 1) == c


def _cpu_cache(**kw):
    args = dict(num_layers=1, batch_size=2, num_kv_heads=2, head_dim=64, preset="k4v2_g64", window=64)
    args.update(kw)
    c = kc.KVarNCache(**args)
    g = torch.Generator().manual_seed(0)
    c.append(0, torch.randn(2, 2, 5, 64, generator=g), torch.randn(2, 2, 5, 64, generator=g))
    return c


def test_q_type_and_dtype_errors():
    c = _cpu_cache()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        decode.decode_attention([1.0], c, 0)
    with pytest.raises(TypeError, match="q has dtype torch.float32"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64), c, 0)


@pytest.mark.parametrize(
    "shape", [(2, 4, 64), (1, 4, 1, 64), (2, 3, 1, 64), (2, 4, 2, 64), (2, 4, 1, 128), (2, 18, 1, 64)]
)
def test_q_shape_errors(shape):
    c = _cpu_cache()
    with pytest.raises(ValueError, match=r"q must have shape \[batch=2"):
        decode.decode_attention(torch.zeros(*shape, dtype=torch.float16), c, 0)


def test_q_device_and_cache_errors():
    c = _cpu_cache()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64, dtype=torch.float16), c, 0)
    with pytest.raises(TypeError, match="cache must be a KVarNCache"):
        decode.decode_attention(torch.zeros(2, 4, 1, 64, dtype=torch.float16), "cache", 0)


def test_graph_needs_max_seq_len_and_cuda():
    with pytest.raises(ValueError, match="max_seq_len"):
        decode.DecodeGraph(_cpu_cache(), 0, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        decode.DecodeGraph(_cpu_cache(max_seq_len=4096), 0, 4)


def test_plan_needs_cuda_cache():
    with pytest.raises(ValueError, match="cache must be on a CUDA device"):
        decode.DecodePlan(_cpu_cache())


def test_ragged_argument_errors():
    ts = TileSpec(preset="k4v2_g64", head_dim=64)
    tiles = torch.zeros(2, 4, 2, ts.tile_nbytes, dtype=torch.uint8)
    win = torch.zeros(2, 2, 64, 64, dtype=torch.float16)
    sink = torch.zeros(2, 2, 0, 64, dtype=torch.float16)
    lens = torch.zeros(2, dtype=torch.int32)
    q = torch.zeros(2, 4, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="tiles must be a contiguous uint8"):
        decode.decode_attention_ragged(q, tiles[..., :-16], win, win, sink, sink, lens, lens, lens, ts)
    with pytest.raises(TypeError, match="spec must be a TileSpec"):
        decode.decode_attention_ragged(q, tiles, win, win, sink, sink, lens, lens, lens, "k4v2_g64")
    with pytest.raises(ValueError, match="tiles must be on a CUDA device"):
        decode.decode_attention_ragged(q, tiles, win, win, sink, sink, lens, lens, lens, ts)


def test_scale_validation():
    from kvarn_cutlass._validate import resolve_scale

    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        resolve_scale(-1.0, 64)
    with pytest.raises(TypeError, match="scale must be a positive finite number"):
        resolve_scale("0.1", 64)
    assert resolve_scale(None, 64) == 0.125 and resolve_scale(2, 64) == 2.0


def test_exact_blocks_and_layout():
    """The host's numbers come from the compiled kernel (kvarn_decode_layout_<suffix>)."""
    for preset in PRESETS:
        for d in HEAD_DIMS:
            for sd in SCALE_DTYPES:
                ts = TileSpec(preset=preset, head_dim=d, scale_dtype=sd)
                lay = decode.kernel_layout(ts)
                assert lay.exact_tokens in (32, 64)
                # the ring (3-4 iterations of records) plus the fold / P' / query buffers, within 227 KiB
                assert 2 * ts.tile_nbytes * (128 // ts.tile_tokens) < lay.smem_bytes <= 227 * 1024, (ts, lay)
                te = lay.exact_tokens
                assert decode.exact_blocks(ts, 256, 0) == 256 // te
                assert decode.exact_blocks(ts, 256, 100) == -(-356 // te)
                assert decode.exact_blocks(ts, 0, 0) == 1


def test_split_cost_model():
    """The split cost model alone: batch 1 / 4k spreads to 2 tiles per split; batch 16 / 32k fills one wave of
    4 resident blocks per SM (of S = 4..8 a 3-block wave or a partial second wave is slower; the shorter blocks
    that were faster still are plan_splits' raise, tested below)."""
    def best(pairs, cap, occ=4, min_tps=2):
        cands = range(1, min(4 * 132 * occ // pairs, -(-cap // min_tps)) + 1)
        return min(cands, key=lambda s: (decode.split_cost(s, pairs, cap, 132, occ, min_tps), s))

    assert best(8, 33) == 17
    assert best(128, 257) == 4
    assert decode.split_cost(5, 128, 257, 132, 4, 2) > decode.split_cost(8, 128, 257, 132, 4, 2)
    assert 33 <= best(8, 1025) <= 66


def test_min_tps_env(monkeypatch):
    monkeypatch.setenv("KVARN_DECODE_MIN_TPS", "3")
    assert decode.min_tiles_per_split() == 3
    monkeypatch.delenv("KVARN_DECODE_MIN_TPS")
    assert decode.min_tiles_per_split() == decode.MIN_TILES_PER_SPLIT


def test_programmatic_launch_choice(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(decode, "_arch_of", lambda index: 90)
    monkeypatch.delenv(decode.PDL_ENV, raising=False)
    assert decode.programmatic_launch(dev) is True  # on by default from sm_90
    monkeypatch.setenv(decode.PDL_ENV, "0")
    assert decode.programmatic_launch(dev) is False
    monkeypatch.setenv(decode.PDL_ENV, "1")
    assert decode.programmatic_launch(dev) is True
    monkeypatch.setattr(decode, "_arch_of", lambda index: 80)  # no griddepcontrol before sm_90
    assert decode.programmatic_launch(dev) is False
    monkeypatch.setenv(decode.PDL_ENV, "yes")
    with pytest.raises(ValueError, match=decode.PDL_ENV):
        decode.programmatic_launch(dev)


@pytest.mark.parametrize("which", [0, 1])
def test_kernel_waits_for_the_previous_kernel_before_any_memory_read(which):
    """Programmatic dependent launch is safe only if the kernel reads nothing before griddepcontrol.wait (SASS
    ACQBULK on sm_90): no global or shared load, atomic or cp.async comes first; launch_dependents (PREEXIT)
    follows it. The sm_80 build has neither."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import disassemble, kernel_opcodes

    require_disassembler()
    ks = decode.decode_spec(TileSpec("k4v2_g128", 128))
    fn = ks.kernel_names[which]
    for arch, has in (("sm90", True), ("sm80", False)):
        ops = kernel_opcodes(disassemble(build(ks, arch).cubin), fn)
        assert ("ACQBULK" in ops) == has and ("PREEXIT" in ops) == has, (arch, fn)
        if has:
            first = ops.index("ACQBULK")
            reads = [o for o in ops[:first] if o.startswith(("LDG", "LDS", "LD.", "LDSM", "ATOM", "RED", "LDGSTS"))]
            assert not reads and first < ops.index("PREEXIT"), (fn, ops[:first + 2])


@pytest.mark.parametrize("which", [0, 1])
def test_prefetch_variant_reads_only_the_tile_count_and_table_before_the_wait(which):
    """The prefetch variant's one exception to the rule above: before griddepcontrol.wait its first threads load
    the tile count and one table entry at GPU scope (LDG.E.STRONG.GPU: no L1 line that a later load could hit
    stale) and ask L2 for the record (UBLKPF.L2, a hint); no other load, no shared memory, atomic or cp.async.
    The tile loop is the shipped one: the same warp-instructions an iteration (tools/decode_sass_loop.py)."""
    pytest.importorskip("cuda.bindings")
    from kvarn_cutlass.cli.sass import disassemble, kernel_opcodes

    require_disassembler()
    v = decode.DecodeVariant(prefetch=2)
    ks = decode.decode_spec(TileSpec("k4v2_g128", 128), v)
    fn = ks.kernel_names[which]
    ops = kernel_opcodes(disassemble(build(ks, "sm90").cubin), fn)
    first = ops.index("ACQBULK")
    mem = [o for o in ops[:first] if o.startswith(("LDG", "LDS", "LD.", "LDSM", "ST", "ATOM", "RED", "UBLK", "CCTL"))]
    assert mem == ["LDG.E.STRONG.GPU", "LDG.E.STRONG.GPU", "UBLKPF.L2"], mem
    assert "UBLKPF.L2" not in ops[first:]
    shipped_spec = decode.decode_spec(TileSpec("k4v2_g128", 128))
    shipped = kernel_opcodes(disassemble(build(shipped_spec, "sm90").cubin), shipped_spec.kernel_names[which])
    assert "UBLKPF.L2" not in shipped
    # after the wait the floating-point and tensor-core work is the shipped kernel's (bit-identical outputs)
    arith = re.compile(r"^(FFMA|FMUL|FADD|FMNMX|FSETP|FSEL|MUFU|F2F|F2I|I2F|F2FP|HADD2|HFMA2|HMUL2|IMMA|HMMA)\b")
    after = lambda o: sorted(x for x in o[o.index("ACQBULK"):] if arith.match(x))  # noqa: E731
    assert after(ops) == after(shipped)


def _tile_loop_counts(*variants) -> list[dict]:
    """tools/decode_sass_loop.py's row (d128 k4v2 n1: instructions a warp an iteration, registers, residency) of
    each variant."""
    tool = load_tool("decode_sass_loop")
    rows = []
    for variant in variants:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            tool.main(["--only", "d128 k4v2_g128 n1", "--variant", str(variant)])
        rows.append(json.loads(buf.getvalue()))
    return rows


def test_prefetch_variant_keeps_the_tile_loop():
    """The prefetch sits before the kernel's wait, outside the tile loop: the loop issues the shipped kernel's
    warp-instructions an iteration, at the shipped registers and residency."""
    require_disassembler()
    rows = _tile_loop_counts(decode.DecodeVariant(), decode.DecodeVariant(prefetch=2))
    keys = ("iteration", "max_warp", "registers", "blocks_per_sm")
    assert [rows[1][k] for k in keys] == [rows[0][k] for k in keys], rows


@pytest.mark.parametrize("which", [0, 1])
def test_q_first_variant_reads_q_before_the_ring_s_first_copies(which):
    """q_first moves the tile split's query loads (LDG.E.U16, fp16 q) ahead of its ring's first record copies:
    between the block barrier before them and the last query load, the shipped kernel issues the ring's
    cp.async copies (LDGSTS) of its first records, the variant none; the kernel's loads are the same kinds."""
    from collections import Counter

    from kvarn_cutlass.cli.sass import disassemble, kernel_opcodes

    require_disassembler()

    def prologue(variant):
        ks = decode.decode_spec(TileSpec("k4v2_g128", 128), variant)
        ops = kernel_opcodes(disassemble(build(ks, "sm90").cubin), ks.kernel_names[which])
        last_q = max(k for k, o in enumerate(ops) if o.startswith("LDG.E.U16"))
        bar = max(k for k, o in enumerate(ops[:last_q]) if o.startswith("BAR.SYNC"))
        loads = Counter(o for o in ops if o.startswith(("LDG", "LDGSTS")))
        return sum(o.startswith("LDGSTS") for o in ops[bar:last_q]), loads

    copies, loads = prologue(decode.DecodeVariant())
    copies_qf, loads_qf = prologue(decode.DecodeVariant(q_first=1))
    assert copies >= 2 * 8 and copies_qf == 0, (copies, copies_qf)
    assert set(loads_qf) == set(loads), (loads, loads_qf)


def test_run_max_variant_takes_the_head_max_off_the_common_path():
    """run_max: the one walked tile-loop iteration (the rare rescale not taken) has no cross-lane max before the
    first exponential of the scores: the shipped loop's first MUFU.EX2 after the score MMAs follows SHFL.BFLY
    reductions (the tile's head max), the variant's does not; fewer warp-instructions an iteration at the
    shipped residency (tools/decode_sass_loop.py)."""
    require_disassembler()

    from kvarn_cutlass.cli.sass import disassemble

    tool = load_tool("decode_sass_loop")

    def shfl_before_first_ex2(variant):
        ks = decode.decode_spec(TileSpec("k4v2_g128", 128), variant)
        ops = tool.walk_ops(tool.parse(disassemble(build(ks, "sm90").cubin), ks.kernel_names[0]), True, 1)
        # the score MMAs: the first four-IMMA run of the iteration (P' x V's follow the exponentials)
        last_score_imma = next(k for k in range(len(ops)) if ops[k].startswith("IMMA") and not
                               any(o.startswith("IMMA") for o in ops[k + 1:k + 40]))
        first_ex2 = next(k for k in range(last_score_imma, len(ops)) if ops[k].startswith("MUFU.EX2"))
        return sum(o.startswith("SHFL") for o in ops[last_score_imma:first_ex2])

    assert shfl_before_first_ex2(decode.DecodeVariant()) >= 3
    assert shfl_before_first_ex2(decode.DecodeVariant(run_max=1)) == 0
    rows = _tile_loop_counts(decode.DecodeVariant(), decode.DecodeVariant(run_max=1))
    assert rows[1]["max_warp"] < rows[0]["max_warp"] and rows[1]["blocks_per_sm"] == rows[0]["blocks_per_sm"], rows


def test_ticket_fences_once_without_sc():
    """The ticket is thread 0's acq_rel atomic between two block barriers: one non-SC fence before it
    (MEMBAR.ALL.GPU, then the atomic and the L1 invalidation of its acquire) and no sequentially consistent fence
    (MEMBAR.SC.GPU, which every thread issued on both sides of the ticket before), in both kernels of the module;
    merge_group takes a second ticket (the pair's) in its group mergers."""
    require_disassembler()
    from kvarn_cutlass.cli.sass import disassemble

    def fences(text):
        sass = disassemble(build(decode.decode_spec(TileSpec(), decode.DecodeVariant.parse(text)), "sm90").cubin)
        return {k: len(re.findall(k, sass)) for k in ("MEMBAR.SC.GPU", "MEMBAR.ALL.GPU", "ATOMG", "CCTL.IVALL")}

    assert fences("default") == {"MEMBAR.SC.GPU": 0, "MEMBAR.ALL.GPU": 2, "ATOMG": 2, "CCTL.IVALL": 2}
    assert fences("merge_group=8") == {"MEMBAR.SC.GPU": 0, "MEMBAR.ALL.GPU": 4, "ATOMG": 4, "CCTL.IVALL": 4}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_merge_copies_set_addresses_once_a_batch(head_dim):
    """The final merge's batch copies (LDGSTS after the ticket's atomic) go in one straight run a batch, at most 8
    instructions a copy and at least 8 copies (the lane's addresses set once a batch: chunk lane + 32 i is row
    RI i + lr's chunk CI i + lc), not from a loop that computes each copy's 64-bit address (27 instructions a copy
    before), in both kernels."""
    require_disassembler()
    from kvarn_cutlass.cli.sass import disassemble

    tool = load_tool("decode_sass_loop")

    def merge_copies(text):  # per kernel: (copy loops' instructions per copy, the longest straight run's)
        ks = decode.decode_spec(TileSpec(head_dim=head_dim), decode.DecodeVariant.parse(text))
        sass = disassemble(build(ks, "sm90").cubin)
        out = []
        for name in ks.kernel_names:
            ins = tool.parse(sass, name)
            atom = next(a for a, _, o, _ in ins if o.startswith("ATOMG"))
            loops = [[x[2] for x in ins if t <= x[0] <= a] for a, _, o, t in ins
                     if o == "BRA" and t is not None and atom < t < a]
            loop = [sum(len(ops) for ops in loops if "LDGSTS" in " ".join(ops) and len(ops) < 80)]
            copies = [i for i, x in enumerate(ins) if x[0] > atom and x[2].startswith("LDGSTS")]
            runs, run = [], [copies[0]]
            for i in copies[1:]:
                if any(x[2].startswith(("BRA", "LDGDEPBAR")) for x in ins[run[-1] + 1:i]):
                    runs.append(run)
                    run = [i]
                else:
                    run.append(i)
            runs.append(run)
            best = max(runs, key=len)
            out.append((loop[0], (best[-1] - best[0] + 1) / len(best), len(best)))
        return out

    for loop, per_copy, n in merge_copies("default"):
        assert loop == 0 and n >= 8 and per_copy <= 8, (loop, per_copy, n)


def test_merge_group_workspace_holds_a_row_and_a_ticket_per_group():
    """merge_group=g adds, per (sequence, KV head), ceil(S / g) + ceil(E / g) partial rows and tickets (the
    kernel's pair_rows and ticket layout); other variants add none."""
    V = decode.DecodeVariant
    assert decode.merge_groups(65, 8, V()) == 0 and decode.merge_groups(65, 8, V(trace=1)) == 0
    assert decode.merge_groups(65, 8, V(merge_group=8)) == 9 + 1
    assert decode.merge_groups(17, 8, V(merge_group=8)) == 3 + 1
    assert decode.merge_groups(16, 3, V(merge_group=32)) == 1 + 1
    B, Hkv, G, D, S, E = 2, 3, 4, 64, 17, 5
    for v, groups in ((V(), 0), (V(merge_group=4), 5 + 2)):
        ws = decode.DecodeWorkspace(torch.device("cpu"), B, Hkv, G, D, S, E, variant=v)
        rows = B * Hkv * (S + E + groups) * G
        assert (ws.po.numel(), ws.pm.numel(), ws.pl.numel()) == (rows * D, rows, rows)
        assert ws.tickets.numel() == B * Hkv * (1 + groups) and not ws.tickets.any()


# --- occupancy variants (docs/perf-notes.md, "Decode occupancy") ---------------------------------------------
# What each A/B candidate claims for its G <= 4 kernel on sm_90 (this NVRTC): (TileSpec arguments, variant,
# resident blocks per SM). The set knobs' register bounds hold for any compiler; the defaults' residencies are
# this compiler's (d128 k4v4 and d256: shared memory bound; d64: its 80 registers).
OCCUPANCY_CLAIMS = [
    pytest.param(kw, variant, blocks, id=f"{label}-{variant}")
    for label, kw, variant, blocks in [
        ("d128_k4v2", {}, "default", 4),
        ("d128_k4v2", {}, "ring=2", 5),
        ("d128_k4v2", {}, "ring=2,min_blocks=5", 5),
        ("d128_k4v2", {}, "ring=2,min_blocks=6", 6),
        ("d128_k4v4", {"preset": "k4v4_g128"}, "default", 3),
        ("d128_k4v4", {"preset": "k4v4_g128"}, "ring=2", 5),  # 96 registers since the merge's copies were unrolled
        ("d128_k4v4", {"preset": "k4v4_g128"}, "ring=2,min_blocks=5", 5),
        ("d64_k4v2", {"head_dim": 64}, "default", 6),
        ("d64_k4v2", {"head_dim": 64}, "ring=2,min_blocks=8", 8),
        ("d256_k4v2", {"head_dim": 256}, "default", 2),
        ("d256_k4v2", {"head_dim": 256}, "ring=2", 3),
        # plan_variant's two-level merge: as many blocks as the shipped kernel, at every head_dim and preset
        ("d128_k4v2", {}, "merge_group=12", 4),
        ("d128_k4v4", {"preset": "k4v4_g128"}, "merge_group=12", 3),
        ("d64_k4v2", {"head_dim": 64}, "merge_group=12", 6),
        ("d256_k4v2", {"head_dim": 256}, "merge_group=12", 2),
    ]
]


def test_variant_text_form_and_env(monkeypatch):
    V = decode.DecodeVariant
    for text in ("default", "ring=2", "ring=2,min_blocks=5", "min_blocks=6,min_blocks_g8=2", "prefetch=2",
                 "ring=2,prefetch=1", "q_first=1", "prefetch=2,q_first=1", "run_max=1",
                 "ring=2,run_max=1", "trace=1", "merge_group=8", "merge_group=8,trace=1"):
        assert str(V.parse(text)) == text
    assert V.parse(" ring = 2 , min_blocks=5 ") == V(ring=2, min_blocks=5) and V.parse("") == V()
    assert V(ring=2, min_blocks=5).suffix == "_ns2_mb5" and V().suffix == ""
    assert V(ring=2, min_blocks=5, min_blocks_g8=2).defines() == {"KVD_NS": 2, "KVD_MINB1": 5, "KVD_MINB2": 2}
    assert V(ring=2, prefetch=1).suffix == "_ns2_pf1" and V(prefetch=2).defines() == {"KVD_PREFETCH": 2}
    assert V(run_max=1, trace=1).suffix == "_rm1_tr1"
    assert V(run_max=1, trace=1).defines() == {"KVD_RUN_MAX": 1, "KVD_TRACE": 1}
    for bad in ("ring", "ring=x", "ring=2,ring=3", "rings=2", "ring=1", "min_blocks=33", "ring=2;min_blocks=5",
                "prefetch=0", "prefetch=9", "q_first=0", "q_first=2", "split_k=1", "run_max=0", "trace=2", "merge_lean=1", "ticket=1", "merge_copy=1", "merge_group=1", "merge_group=33"):
        with pytest.raises(ValueError):
            V.parse(bad)
    with pytest.raises(ValueError):
        V(ring=True)
    with pytest.raises(TypeError, match="variant must be a DecodeVariant"):
        decode.decode_spec(TileSpec(), "ring=2")
    monkeypatch.setenv(decode.VARIANT_ENV, "ring=2,min_blocks=6")
    assert decode.decode_variant() == V(ring=2, min_blocks=6)
    monkeypatch.delenv(decode.VARIANT_ENV)
    assert decode.decode_variant() == V()


def test_default_variant_is_the_shipped_spec():
    """No knob set, no define and no name change: the default variant's module is the registered one (one cache
    entry, the shipped CUBIN); a set knob renames the kernels and the module, so variants coexist."""
    ts = TileSpec()
    assert decode.decode_spec(ts, decode.DecodeVariant()) == decode.decode_spec(ts)
    assert not {"KVD_NS", "KVD_MINB1", "KVD_MINB2"} & set(dict(decode.decode_spec(ts).defines))
    ks = decode.decode_spec(ts, decode.DecodeVariant(ring=2, min_blocks=5))
    assert ks.name == "decode_d128_t128_v2_s2_ns2_mb5"
    assert ks.kernel_names == ("kvarn_decode_n1_d128_t128_v2_s2_ns2_mb5", "kvarn_decode_n2_d128_t128_v2_s2_ns2_mb5")
    assert dict(ks.defines)["KVD_NS"] == "2" and dict(ks.defines)["KVD_MINB1"] == "5"


def _text_sections(cubin: bytes, variant: decode.DecodeVariant) -> dict[str, bytes]:
    """Machine code of each kernel of a CUBIN, keyed by the kernel's name less the variant's suffix."""
    from kvarn_cutlass.runtime.compiler import _elf_sections

    return {sec.name.removesuffix(variant.suffix): cubin[sec.offset:sec.offset + sec.size]
            for sec in _elf_sections(cubin) if sec.name.startswith(".text.")}


def test_knobs_set_to_the_defaults_compile_to_the_shipped_code():
    """The knobs only replace the kernel's own defaults: set to them (d128: ring 3, 4 and 3 blocks) the machine
    code is the shipped kernels' byte for byte (only the names differ)."""
    ts, same = TileSpec(), decode.DecodeVariant(ring=3, min_blocks=4, min_blocks_g8=3)
    shipped = _text_sections(build(decode.decode_spec(ts), "sm_90").cubin, decode.DecodeVariant())
    assert len(shipped) == 2
    assert _text_sections(build(decode.decode_spec(ts, same), "sm_90").cubin, same) == shipped


@pytest.mark.parametrize("kw,variant,blocks", OCCUPANCY_CLAIMS)
def test_occupancy_variant_builds_without_spills_at_its_residency(kw, variant, blocks):
    """Each candidate compiles without spills (ptxas report and no stack frame) and holds the resident blocks it
    claims; a set min_blocks bounds the registers to 65,536 / (128 x min_blocks) rounded down to 8."""
    ts, v = TileSpec(**kw), decode.DecodeVariant.parse(variant)
    mod = build(decode.decode_spec(ts, v), "sm_90")
    for name in decode.decode_spec(ts, v).kernel_names:
        res = mod.resources[name]
        assert res.spill_store_bytes == 0 and res.stack_bytes == 0, (name, res)
    n1, n2 = decode.residency(ts, v)
    assert n1.blocks == blocks, n1
    if v.min_blocks:
        assert n1.registers <= 65536 // (128 * v.min_blocks) // 8 * 8 and n1.by_registers >= v.min_blocks, n1
    assert n2.blocks >= 1 and n2.registers >= n1.registers


def test_smaller_ring_frees_one_slot_of_records():
    """d128 k4v2: ring 2 takes one ring slot (one 13,824-byte record) less shared memory than the shipped 3, and
    keeps TE (so E and the exact partials stay the same: outputs at equal splits are bit-identical)."""
    ts = TileSpec()
    a, b = decode.kernel_layout(ts), decode.kernel_layout(ts, None, decode.DecodeVariant(ring=2))
    assert a.smem_bytes - b.smem_bytes == ts.tile_nbytes and a.exact_tokens == b.exact_tokens


def test_variants_keep_the_floating_point_operations():
    """Only occupancy changes: the d128 k4v2 candidates' kernels have the same floating-point, conversion and
    tensor-core instructions as the shipped ones (ptxas made the same FMA contractions), which bit-identical
    outputs at equal splits need (the GPU tests compare the outputs)."""
    from kvarn_cutlass.cli.sass import disassemble

    variants = [decode.DecodeVariant.parse(v) for v in ("default", "ring=2", "ring=2,min_blocks=5", "ring=2,min_blocks=6")]
    try:
        sass = {v: disassemble(build(decode.decode_spec(TileSpec(), v), "sm_90").cubin) for v in variants}
    except FileNotFoundError as e:
        pytest.skip(str(e))
    arith = re.compile(r"^(FFMA|FMUL|FADD|FMNMX|FSETP|FSEL|MUFU|F2F|F2I|I2F|F2FP|HADD2|HFMA2|HMUL2|IMMA|HMMA)\b")

    def ops(v):
        out = {}
        for fn in sass[v].split("Function : ")[1:]:
            found = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", fn)
            out[fn.split()[0].removesuffix(v.suffix)] = sorted(o for o in found if arith.match(o))
        return out

    base = ops(variants[0])
    assert len(base) == 2 and all(base.values())
    for v in variants[1:]:
        assert ops(v) == base, v


def test_split_plan_uses_the_variants_residency():
    """b1 / 4k and b1 / 128k of the bench (8 KV heads, 132 SMs): the shipped kernel's plans (4 resident blocks,
    SATURATING_BLOCKS); a 6-block variant, modelled as saturating at its residency, fills one wave of its
    residency; the shipped saturation stays for the default whatever its residency (d64: 6)."""
    V = decode.DecodeVariant
    plan = lambda pairs, cap, occ, v: decode.plan_splits(pairs, cap, 132, occ, 2, decode.split_saturation(v, occ))  # noqa: E731
    assert plan(8, 1025, 4, V()) == 65 and plan(8, 33, 4, V()) == 17
    assert plan(8, 1025, 6, V(ring=2, min_blocks=6)) == 94 and plan(8, 33, 6, V(ring=2, min_blocks=6)) == 17
    assert decode.split_saturation(V(), 6) == decode.SATURATING_BLOCKS
    assert decode.split_saturation(V(ring=2), 3) == decode.SATURATING_BLOCKS


@pytest.mark.parametrize("pairs", [1, 8, 16, 128, 256, 1024])
@pytest.mark.parametrize("cap", [1, 2, 17, 33, 129, 257, 1025, 4097])
@pytest.mark.parametrize("occ", [1, 4, 6])
def test_split_plan_bounds_block_length(pairs, cap, occ):
    """plan_splits: at least the split cost model's choice; no block longer than MAX_TILES_PER_SPLIT tiles
    unless that would take more than MAX_WAVES_SHORT_BLOCKS waves; never more splits than ceil(cap / min_tps)
    or than that wave bound needs; and the raise binds only where the model's blocks are long."""
    sms, min_tps = 132, 2
    s = decode.plan_splits(pairs, cap, sms, occ, min_tps)
    s_cap = max(1, min(decode.MAX_WAVES * sms * occ // pairs, -(-cap // min_tps)))
    modelled = min(range(1, s_cap + 1), key=lambda k: (decode.split_cost(k, pairs, cap, sms, occ, min_tps), k))
    wave_bound = max(1, decode.MAX_WAVES_SHORT_BLOCKS * sms * occ // pairs)
    assert s >= modelled
    assert s <= max(modelled, wave_bound) and s <= max(modelled, -(-cap // min_tps))
    if -(-cap // decode.MAX_TILES_PER_SPLIT) <= wave_bound:
        assert -(-cap // s) <= decode.MAX_TILES_PER_SPLIT
    if -(-cap // modelled) <= decode.MAX_TILES_PER_SPLIT:
        assert s == modelled


def test_split_plan_of_the_bench_shapes():
    """The plans the decode bench and the e2e bench run (8 KV heads, 4 resident blocks, 132 SMs): batch 1 as the
    cost model picks; batch 16 raised to blocks of at most 16 tiles (32k: 17 splits of 16 tiles, measured
    157-158 us at S = 18 / 24 against 175 at the model's S = 4)."""
    plan = lambda pairs, cap: decode.plan_splits(pairs, cap, 132, 4, 2)  # noqa: E731
    assert [plan(8, c) for c in (33, 129, 257, 1025)] == [17, 65, 65, 65]
    assert [plan(128, c) for c in (33, 129, 257, 1025)] == [4, 9, 17, 65]




def test_plan_variant_takes_ring2_for_grids_of_two_waves_and_merge_groups_below(monkeypatch):
    """plan_variant on the bench shapes (8 KV heads, 132 SMs, the shipped kernel 4 resident blocks, ring 2 5, 8
    exact blocks): ring 2 where the shipped plan's grid is at least two waves of ring 2's residency (batch 16:
    128 x (4 + 8) = 1,536 blocks at 4k and more at longer contexts); below that the two-level merge where the plan
    has at least 33 splits (batch 1 from 8k: S = 33, 65), the shipped kernel at fewer (b1/4k: S = 17) or where the
    two-level kernel would hold fewer blocks; the shipped kernel wherever ring 2 holds no more blocks and S is
    small; $KVARN_DECODE_VARIANT decides when set."""
    V, ring2, grouped = decode.DecodeVariant, decode.RING2_VARIANT, decode.MERGE_GROUP_VARIANT
    occ = {V(): 4, ring2: 5, grouped: 4}
    monkeypatch.setattr(decode, "occupancy", lambda spec, device, variant=V(): occ[variant])
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "exact_blocks", lambda spec, window, sink, device=None, variant=None: 8)
    monkeypatch.delenv(decode.VARIANT_ENV, raising=False)
    spec, dev = TileSpec(), torch.device("cuda", 0)
    pick = lambda batch, cap: decode.plan_variant(batch, 8, cap, 256, 0, dev, spec)  # noqa: E731
    splits = lambda batch, cap: decode.plan_splits(batch * 8, cap, 132, 4, 2)  # noqa: E731
    assert [splits(1, c) for c in (33, 65, 129, 1025)] == [17, 33, 65, 65]
    assert [pick(16, c) for c in (33, 129, 257, 1025)] == [ring2] * 4
    assert [pick(1, c) for c in (33, 65, 129, 257, 1025)] == [V()] + [grouped] * 4
    assert pick(2, 1025) == grouped and pick(4, 1025) == ring2  # 16 x 73 = 1,168 blocks; 32 x 73 = 2,336
    occ[grouped] = 3
    assert pick(1, 1025) == V()
    occ[grouped], occ[ring2] = 4, 4
    assert pick(16, 1025) == grouped and pick(16, 257) == V()  # the shipped plan's S = 65 and 17
    monkeypatch.setenv(decode.VARIANT_ENV, "ring=2,min_blocks=6")
    assert pick(1, 33) == V(ring=2, min_blocks=6)
    monkeypatch.setenv(decode.VARIANT_ENV, "default")
    occ[ring2] = 5
    assert pick(16, 257) == V() and pick(1, 1025) == V()


def test_exact_blocks_last_for_grids_of_two_waves(monkeypatch):
    """The bench shapes' grids (132 SMs): batch 16 (ring 2, 5 blocks: 128 x (5 + 8) = 1,664 blocks at 4k and more
    beyond) takes its exact blocks last, batch 1 (at most 8 x (65 + 8) = 584 blocks of 4) in turn per pair."""
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "occupancy", lambda spec, device, variant: 5 if variant.ring == 2 else 4)
    spec, dev = TileSpec(), torch.device("cuda", 0)
    assert decode.exact_blocks_last(128 * (5 + 8), dev, spec, decode.RING2_VARIANT)
    assert not decode.exact_blocks_last(8 * (65 + 8), dev, spec, decode.DecodeVariant())
    assert decode.exact_blocks_last(2 * 132 * 4, dev, spec, decode.DecodeVariant())
    assert not decode.exact_blocks_last(2 * 132 * 5 - 1, dev, spec, decode.RING2_VARIANT)


# --- a model of one warp: PTX semantics of ldmatrix.trans, prmt, mma.m16n8k32, and the kernel's indices ----
def prmt(a: int, b: int, s: int) -> int:
    """__byte_perm(a, b, s): byte k of the result = byte (s >> 4k) & 7 of b:a (no sign mode in the kernel)."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    assert all(((s >> (4 * k)) & 8) == 0 for k in range(4))
    return sum(((src >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))


def ldsm4t(smem: np.ndarray, addr: list[int]) -> list[list[int]]:
    """ldmatrix.x4.trans.b16: lane l gives the row address of row l % 8 of matrix l // 8; lane (g, q) gets
    r[m] = elem(row 2q, col g) | elem(row 2q + 1, col g) << 16 of matrix m (elements: u16 of the row)."""
    out = []
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        regs = []
        for m in range(4):
            def elem(row):
                a = addr[8 * m + row] + 2 * g
                return int(smem[a]) | int(smem[a + 1]) << 8
            regs.append(elem(2 * q) | elem(2 * q + 1) << 16)
        out.append(regs)
    return out


def _bytes(w: int, signed: bool) -> list[int]:
    b = [(w >> (8 * i)) & 0xFF for i in range(4)]
    return [x - 256 if signed and x > 127 else x for x in b]


def mma(a_frag, b_frag, a_signed: bool) -> np.ndarray:
    """D[16][8] = A[16][32] x B[32][8] from the 32 lanes' fragments (PTX m16n8k32 .row.col, s8 B):
    a[r] = A[g + 8 (r % 2)][4q + 16 (r / 2) + i], b[r] = B[4q + 16 r + i][g], byte i."""
    A = np.zeros((16, 32), np.int64)
    Bm = np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for r in range(4):
            row = g + 8 * (r & 1)
            k0 = 4 * q + 16 * (r >> 1)
            A[row, k0:k0 + 4] = _bytes(a_frag[lane][r], a_signed)
        for r in range(2):
            Bm[4 * q + 16 * r:4 * q + 16 * r + 4, g] = _bytes(b_frag[lane][r], True)
    return A @ Bm


def c_frag(Dm: np.ndarray, lane: int) -> list[int]:
    """d[0..1] = D[g][2q, 2q + 1], d[2..3] = D[g + 8][2q, 2q + 1]."""
    g, q = lane >> 2, lane & 3
    return [Dm[g, 2 * q], Dm[g, 2 * q + 1], Dm[g + 8, 2 * q], Dm[g + 8, 2 * q + 1]]


def swz(cpr: int, i: int) -> int:
    """csrc/decode.cu swz<CPR>."""
    L = i >> 3
    f = {1: (L & 1) << 1, 2: (L & 1) | ((L & 2) << 1), 4: (L >> 1) & 3, 8: ((L >> 1) & 6) | (L & 1)}[cpr]
    return i ^ f


def ldsm_row(lane: int) -> int:
    """csrc/decode.cu ldsm_row: the channel (K) or token (V) whose row lane gives to ldmatrix."""
    m, k = lane >> 3, lane & 7
    return 16 * (m >> 1) + 2 * (m & 1) + 4 * (k >> 1) + (k & 1)


@pytest.mark.parametrize("cpr", [1, 2, 4, 8])
def test_swizzle_spreads_every_ldmatrix_phase(cpr):
    """Each matrix of every ldmatrix (rows ldsm_row + 32 k, one chunk column) hits 8 distinct 16-byte bank
    groups; swz is a permutation of 128-chunk blocks, periodic in them (the cp.async offsets)."""
    for base in range(0, 128, 32):
        for col in range(cpr):
            for m in range(4):
                groups = {swz(cpr, (base + ldsm_row(8 * m + k)) * cpr + col) % 8 for k in range(8)}
                assert len(groups) == 8, (cpr, base, col, m)
    assert sorted(swz(cpr, i) for i in range(128)) == list(range(128))
    assert all(swz(cpr, i + 128) == swz(cpr, i) + 128 for i in range(128))
    for i0 in range(0, 128, cpr):  # the V rows: chunk c of a row is the row's chunk 0 XOR c
        assert all(swz(cpr, i0 + c) == swz(cpr, i0) ^ c for c in range(cpr))


def _fold_words(Bmat: np.ndarray, D: int) -> np.ndarray:
    """The fold's stores (fold_tiles): Bmat[c][col] int8 (col = 2 head + level, heads 0..7) -> fragB words
    [nb][s][72]: unit u (k-step u / 8, half u / 4 % 2, quad u % 4) of head h at lane 8 (h % 4) + 4 lev + quad."""
    KS = D // 32
    words = np.zeros((2, KS, 72), np.int64)
    for h in range(8):
        nb, hl = h >> 2, 8 * (h & 3)
        for u in range(D // 4):
            c0 = (u >> 3) * 32 + ((u >> 2) & 1) * 16 + (u & 3) * 4
            for lev in range(2):
                w = sum((int(Bmat[c0 + i, 2 * h + lev]) & 0xFF) << (8 * i) for i in range(4))
                words[nb, u >> 3, 2 * (hl + 4 * lev + (u & 3)) + ((u >> 2) & 1)] = w
    return words


@pytest.mark.parametrize("T", [64, 128])
@pytest.mark.parametrize("D", [64, 128])
def test_score_fragments(T, D):
    """K codes (channel-major nibbles, swizzled as load_record stores them) x the folded query (as the fold
    stores it) through ldmatrix / prmt / masks / C input: lane (g, q) of the warp with tokens tb + [0, 32)
    ends with sum_c B[c][col] (code[c][t] - 8) (x 16 for the odd token) for t = tb + 4g + 2m + {0, 1}
    (m-block m) and the columns 2q' + {0, 1} of both n-blocks (heads q and q + 4)."""
    rng = np.random.default_rng(T + D)
    KS, KCPR = D // 32, T // 32
    codes = rng.integers(0, 16, (D, T))
    Bmat = rng.integers(-127, 128, (D, 16))
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8).reshape(-1)  # channel c: T/2 bytes
    smem = np.zeros(packed.size, np.uint8)
    for i in range(packed.size // 16):
        dst = swz(KCPR, i)
        smem[16 * dst:16 * dst + 16] = packed[16 * i:16 * i + 16]
    words = _fold_words(Bmat, D)
    S = Bmat.astype(np.int64).sum(0)  # the fold's centering sums, per column
    for kc in range(KCPR):  # warp chunk: tokens tb = 32 kc
        for nb in range(2):
            acc = [[[0] * 4 for _ in range(2)] for _ in range(32)]
            for lane in range(32):  # C input (kci): -8 S for the even-token rows, -128 S for the odd ones
                col = 2 * ((lane & 3) + 4 * nb)
                for m in range(2):
                    acc[lane][m] = [-8 * S[col], -8 * S[col + 1], -128 * S[col], -128 * S[col + 1]]
            for s in range(KS):
                addr = [16 * swz(KCPR, ldsm_row(lane) * KCPR + kc) + s * 512 * KCPR for lane in range(32)]
                r = ldsm4t(smem, addr)
                a = [[], []]
                for lane in range(32):
                    x0, y0 = prmt(r[lane][0], r[lane][1], 0x6420), prmt(r[lane][0], r[lane][1], 0x7531)
                    x1, y1 = prmt(r[lane][2], r[lane][3], 0x6420), prmt(r[lane][2], r[lane][3], 0x7531)
                    a[0].append([x0 & 0x0F0F0F0F, x0 & 0xF0F0F0F0, x1 & 0x0F0F0F0F, x1 & 0xF0F0F0F0])
                    a[1].append([y0 & 0x0F0F0F0F, y0 & 0xF0F0F0F0, y1 & 0x0F0F0F0F, y1 & 0xF0F0F0F0])
                bfr = [[int(words[nb, s, 2 * lane]), int(words[nb, s, 2 * lane + 1])] for lane in range(32)]
                for m in range(2):
                    Dm = mma(a[m], bfr, a_signed=False)
                    for lane in range(32):
                        acc[lane][m] = [x + y for x, y in zip(acc[lane][m], c_frag(Dm, lane))]
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                for m in range(2):
                    for half in range(2):  # rows g (even token), g + 8 (odd token, codes x 16)
                        t = 32 * kc + 4 * g + 2 * m + half
                        for lev in range(2):
                            want = (16 if half else 1) * int(((codes[:, t] - 8) * Bmat[:, 2 * (q + 4 * nb) + lev]).sum())
                            assert acc[lane][m][2 * half + lev] == want, (kc, nb, lane, m, half, lev)


@pytest.mark.parametrize("VB", [2, 4])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_value_fragments(VB, D):
    """P' words through the warp's exchange buffer (writer: lane (g, q) holds tokens 4g .. 4g + 3 of head q)
    and V codes (token-major, swizzled) through ldmatrix / prmt / masks: lane (g, q) ends with
    sum_t code[t][c] P[t][col] x (in-place factor of c) for its channels c = chunk * VCHC + VRUN g + e."""
    rng = np.random.default_rng(VB * D)
    VR = D * VB // 8
    VCPR, VCHC = VR // 16, 128 // VB
    VRUN, VMB = VCHC // 8, VCHC // 16
    T = 128
    codes = rng.integers(0, 1 << VB, (T, D))
    per = 8 // VB
    packed = np.zeros((T, VR), np.int64)
    for c in range(D):
        packed[:, c // per] |= codes[:, c] << (VB * (c % per))
    packed = packed.astype(np.uint8).reshape(-1)
    smem = np.zeros(packed.size, np.uint8)
    for i in range(packed.size // 16):
        dst = swz(VCPR, i)
        smem[16 * dst:16 * dst + 16] = packed[16 * i:16 * i + 16]
    for kc in range(4):
        tb = 32 * kc
        P = rng.integers(-127, 128, (32, 8))  # [token][col = 2 head + level] of the warp's tokens
        buf = np.zeros(64, np.int64)  # writer
        for lane in range(32):
            g, q = lane >> 2, lane & 3
            for lev in range(2):
                w = sum((int(P[4 * g + i, 2 * q + lev]) & 0xFF) << (8 * i) for i in range(4))
                buf[((4 * lev + q) * 4 + (g & 3)) * 2 + (g >> 2)] = w
        bv = []
        for lane in range(32):  # reader
            g, q = lane >> 2, lane & 3
            i0 = (((g & 1) * 4 + (g >> 1)) * 4 + q) * 2
            bv.append([int(buf[i0]), int(buf[i0 + 1])])
        vsw = [16 * swz(VCPR, (tb + ldsm_row(lane)) * VCPR) for lane in range(32)]
        for c in range(VCPR):
            r = ldsm4t(smem, [v ^ (16 * c) for v in vsw])
            for jm in range(VMB):
                mask = (0x03030303 << (2 * jm)) if VB == 2 else (0x0F0F0F0F << (4 * jm))
                a = []
                for lane in range(32):
                    rr = r[lane]
                    z0, zh0 = prmt(rr[0], rr[1], 0x6420), prmt(rr[0], rr[1], 0x7531)
                    z1, zh1 = prmt(rr[2], rr[3], 0x6420), prmt(rr[2], rr[3], 0x7531)
                    a.append([z0 & mask, zh0 & mask, z1 & mask, zh1 & mask])
                Dm = mma(a, bv, a_signed=False)
                E1 = 4 if VB == 2 else 2
                fac = 1 << (VB * jm)
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    d = c_frag(Dm, lane)
                    for e, pair in ((jm, (d[0], d[1])), (E1 + jm, (d[2], d[3]))):
                        ch = c * VCHC + VRUN * g + e
                        for lev, got in enumerate(pair):
                            want = fac * int((codes[tb:tb + 32, ch] * P[:, 2 * q + lev]).sum())
                            assert got == want, (kc, c, jm, lane, e, lev)


def test_lm_selectors_pair_with_the_packing_order():
    """lloyd_max: the nibble selectors of the lookups give the four bytes of x in the order 0, 2, 1, 3 for the
    low (even token / channel 4g + 0) and the high nibbles; the fold and the P' words are packed in that
    order; lut16 returns table[code] for all 16 codes."""
    rng = np.random.default_rng(3)
    table = rng.integers(-127, 128, 16)
    words = [sum((int(table[4 * w + j]) & 0xFF) << (8 * j) for j in range(4)) for w in range(4)]

    def lut16(sel):
        s7 = sel & 0x7777
        hm = prmt(0x0000FF00, 0, (sel >> 3) & 0x1111)
        lo, hi = prmt(words[0], words[1], s7), prmt(words[2], words[3], s7)
        return (lo & ~hm & 0xFFFFFFFF) | (hi & hm)

    for _ in range(300):
        nib = rng.integers(0, 16, (4, 2))  # [byte i][low, high nibble]
        x = sum(int(nib[i, 0] | nib[i, 1] << 4) << (8 * i) for i in range(4))
        se = (x & 0x0F0F) | ((x >> 12) & 0xF0F0)
        so = ((x >> 4) & 0x0F0F) | ((x >> 16) & 0xF0F0)
        for sel, par in ((se, 0), (so, 1)):
            assert _bytes(lut16(sel), True) == [int(table[nib[i, par]]) for i in (0, 2, 1, 3)]


def test_identity_tile_table():
    """Entry [b, g] is the pool slot b * cap + g of the pool's records."""
    pool = torch.zeros(3, 5, 2, 16, dtype=torch.uint8)
    t = decode.identity_tile_table(pool)
    assert t.dtype == torch.int32 and t.shape == (3, 5) and t.is_contiguous()
    assert torch.equal(t.view(-1), torch.arange(15, dtype=torch.int32))
    flat = pool.view(-1, 2, 16)
    assert flat[int(t[2, 3])].data_ptr() == pool[2, 3].data_ptr()
    assert decode.identity_tile_table(torch.zeros(2, 7, 2, 16, dtype=torch.uint8)).shape == (2, 7)


@pytest.mark.gpu
def test_plan_reads_the_caches_device_lengths_without_a_refresh():
    """DecodePlan.lens is the cache's device_lengths(), not a copy to refresh: a decode launched after an
    append, a truncate and the restore of a failed deferred block reads the lengths of that moment."""
    from kvarn_cutlass import reference

    B, Hkv, D = 2, 2, 128
    c = kc.KVarNCache(1, B, Hkv, D, window=256, device="cuda", max_seq_len=4096)
    gen = torch.Generator(device="cuda").manual_seed(5)
    kv = lambda n: [torch.randn(B, Hkv, n, D, generator=gen, device="cuda").half() for _ in range(2)]  # noqa: E731
    c.append(0, *kv(700))
    plan = decode.get_plan(c)
    assert plan.lens.data_ptr() == c.device_lengths().data_ptr()
    q = torch.randn(B, 4 * Hkv, 1, D, generator=gen, device="cuda").half()

    def decode_matches_the_reference(what):
        out = torch.full_like(q, float("nan"))
        plan.launch(q, 0, out)
        ref = reference.attention(q, c, 0)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"seed=5, {what}: {err}"

    decode_matches_the_reference("after the prompt")
    c.append(0, *kv(1))
    decode_matches_the_reference("after an append")
    c.truncate(0, c.seq_len(0) - 40)
    decode_matches_the_reference("after a truncate")
    before = c.seq_len(0)
    bad = kv(1)
    bad[1][0, 1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="v contains NaN"):
        with c.deferred_checks():
            c.append(0, *kv(130))  # completes a tile
            c.append(0, *bad)
    assert c.seq_len(0) == before
    decode_matches_the_reference("after a failed block")


@pytest.mark.gpu
def test_plan_launch_fast_path_equals_the_full_path():
    """DecodePlan.launch keeps one launch per (layer, scale) and then only rewrites the q and out addresses:
    over fresh q and out tensors, a second dtype, a non-contiguous q, another scale, a pool that grows (no
    max_seq_len) and a second layer, every output equals decode_attention_ragged's (the full checks and a
    launch prepared for these arguments), bit for bit; bad arguments still raise."""
    B, Hkv, D, G = 2, 2, 128, 4
    c = kc.KVarNCache(2, B, Hkv, D, window=256, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(8)
    kv = lambda n: [torch.randn(B, Hkv, n, D, generator=gen, device="cuda").half() for _ in range(2)]  # noqa: E731
    c.append(0, *kv(200))  # no tile yet: the plan launches on its stand-in pool
    c.append(1, *kv(900))
    plan = decode.DecodePlan(c)

    def full(q, layer, scale):
        pool, table = c.tile_pool(layer), c.tile_table(layer)
        if pool.shape[1] == 0:
            pool, table = plan._empty_pool, plan._empty_table
        buf, lens = c.buffers(layer), c.device_lengths()
        return decode.decode_attention_ragged(q.contiguous(), pool, buf["window_k"], buf["window_v"], buf["sink_k"],
                                              buf["sink_v"], lens[layer, 0], lens[layer, 1], lens[layer, 2], c.spec,
                                              scale=scale, workspace=plan.workspace(G), tile_table=table)

    steps = [(0, torch.float16, None, False)] * 3 + [(0, torch.bfloat16, None, False), (0, torch.float16, None, True),
                                                     (0, torch.float16, 0.05, False), (1, torch.float16, None, False)]
    for i, (layer, dtype, scale, strided) in enumerate(steps * 3):
        if i == len(steps):
            c.append(0, *kv(200))  # layer 0's pool grows: its launch and the workspace move
        q = torch.randn(B, Hkv * G, 1, D, generator=gen, device="cuda").to(dtype)
        if strided:
            q = torch.randn(B, 1, Hkv * G, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        plan.launch(q, layer, out, scale)
        assert torch.equal(out, full(q, layer, scale)), f"seed=8, step {i}"
    assert c.num_tiles(0) > 0
    q = torch.randn(B, Hkv * G, 1, D, generator=gen, device="cuda").half()
    with pytest.raises(ValueError, match="q must have shape"):
        plan.launch(q[:1], 0, torch.empty_like(q[:1]))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        plan.launch(q, 0, torch.empty_like(q).float())
    with pytest.raises(TypeError, match="scale"):
        plan.launch(q, 0, torch.empty_like(q), True)
    with pytest.raises(ValueError, match="layer"):
        plan.launch(q, 2, torch.empty_like(q))


def test_a_cache_with_a_decode_plan_is_freed_when_dropped(monkeypatch):
    """get_plan keeps one plan per cache, and the plan (which holds its cache) does not keep the cache alive:
    a table of plans keyed weakly by cache would, and every cache that ever decoded would keep its GPU
    memory (the e2e bench's rows after a batch-16 row measured ~9.6 GiB more peak memory for both caches)."""
    import gc
    import weakref

    class StandInPlan:  # DecodePlan needs CUDA; what matters here is that a plan holds its cache
        def __init__(self, cache):
            self.cache = cache

    monkeypatch.setattr(decode, "_check_cache", lambda cache: None)
    monkeypatch.setattr(decode, "DecodePlan", StandInPlan)
    c = kc.KVarNCache(2, 1, 2, 128, device="cpu")
    plan = decode.get_plan(c)
    assert decode.get_plan(c) is plan and plan.cache is c
    alive = weakref.ref(c)
    del c, plan
    gc.collect()
    assert alive() is None, "the cache outlived every reference to it but its plan's"
