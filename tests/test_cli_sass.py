"""``kvarn-cutlass sass`` beyond the fused prefill (tests/test_prefill_tools.py): the SASS counts, any
registered module by name, and the errors of a wrong selection."""

from __future__ import annotations

import json

import pytest

from kvarn_cutlass.cli import main
from kvarn_cutlass.cli.sass import find_tool, kernel_opcodes, summarize

LISTING = """
        Function : kvarn_x
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;          /* 0x0000000c0804723c */
        /*0020*/               @P0 HMMA.16816.F32 R4, R8, R14, R4 ;          /* 0x0000000e0804023c */
        /*0030*/                   IMMA.16832.S8.S8 R16, R20, R24, R16 ;     /* 0x000000181410747c */
        /*0040*/                   WARPGROUP.ARRIVE ;                        /* 0x0000000000007dc8 */
        /*0050*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;  /* 0x00000000041879f0 */
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;           /* 0x00000000000079c8 */
        /*0070*/                   STL [R1], R2 ;                            /* 0x0000000201007387 */
        /*0080*/                   LDL.64 R2, [R1] ;                         /* 0x0000000001027983 */
        /*0090*/                   EXIT ;                                    /* 0x000000000000794d */
"""


@pytest.mark.parametrize("argv,fragments", [
    (["--config", "r32c4"], ["--config", "'r32c4' is not a fused prefill config name"]),
    (["--bucket", "D96_T128_V2"], ["--bucket", "head_dim=96"]),
])
def test_a_malformed_option_is_a_usage_error(argv, fragments, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sass", *argv])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and all(f in err[0] for f in fragments), err


def test_kernel_opcodes_reads_one_kernel_of_a_listing():
    other = """
        Function : kvarn_y
        /*0000*/                   PREEXIT ;                                 /* 0x000000000000782d */
        /*0010*/              @!P1 ACQBULK ;                                 /* 0x000000000000782e */
        /*0020*/                   EXIT ;                                    /* 0x000000000000794d */
"""
    listing = LISTING + other
    assert kernel_opcodes(listing, "kvarn_y") == ["PREEXIT", "ACQBULK", "EXIT"]
    assert kernel_opcodes(listing, "kvarn_x")[:2] == ["LDC", "HMMA.16816.F32"]
    assert len(kernel_opcodes(listing, "kvarn_x")) == 10  # stops at the next kernel
    for absent in ("kvarn_z", "kvarn_"):  # a prefix of a kernel's name is not that kernel
        with pytest.raises(KeyError, match=absent):
            kernel_opcodes(listing, absent)


def test_summary_counts_a_listing():
    assert summarize(LISTING) == {
        "instructions": 10,
        "mma": {"HGMMA.64x64x16.F32": 1, "HMMA.16816.F32": 2, "IMMA.16832.S8.S8": 1},
        "warpgroup_arrive": 1, "warpgroup_depbar": 1, "ldl": 1, "stl": 1,
    }


def test_list_names_every_registered_module_once(capsys):
    from kvarn_cutlass.runtime import registry

    assert main(["sass", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = sorted(f"{family} {s.name}" for family, specs in registry.families().items() for s in specs)
    assert sorted(lines) == want and len(set(lines)) == len(lines)


def test_a_registered_module_by_name(capsys):
    """A decode module: its int8 tensor-core instructions (IMMA) and its kernels' resources."""
    pytest.importorskip("cuda.bindings")
    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("neither cuobjdump nor nvdisasm is installed")
    assert main(["sass", "--module", "decode_d128_t128_v2_s2", "--arch", "sm80"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["family"] == "decode" and s["source"] == "decode.cu" and s["target"] == "sm_80"
    assert set(s["kernels"]) == {"kvarn_decode_n1_d128_t128_v2_s2", "kvarn_decode_n2_d128_t128_v2_s2"}
    assert all(k["registers"] > 0 for k in s["kernels"].values())
    assert sum(n for op, n in s["sass"]["mma"].items() if op.startswith("IMMA")) > 0


@pytest.mark.parametrize("argv,fragments", [
    (["--module", "no_such_module"], ["'no_such_module' is not a registered kernel module", "--list"]),
    (["--module", "selftest", "--config", "r32c4n64"], ["--config", "fused prefill"]),
])
def test_a_wrong_selection_is_one_line(argv, fragments, capsys):
    assert main(["sass", *argv]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    for fragment in fragments:
        assert fragment in err[0], err[0]
