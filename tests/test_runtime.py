"""CPU tests of the GPU runtime: compile, disk cache, registry, argument packing, CLI (no GPU needed)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing
import os
import re
import stat
import struct
import threading
from pathlib import Path

import pytest
import torch

from kvarn_cutlass import cli
from kvarn_cutlass.bench.record import gpu_slug, record_section
from kvarn_cutlass.runtime import (
    CompileError,
    KernelSpec,
    arch_target,
    build,
    cache_root,
    cached_artifact,
    compile_cubin,
    cubin_sm,
    cubin_symbols,
    normalize_arch,
    register,
)
from kvarn_cutlass.runtime import registry
from kvarn_cutlass.runtime import spec as spec_mod
from kvarn_cutlass.runtime.diskcache import read_cache_file, write_cache_file
from kvarn_cutlass.runtime.compiler import _nvcc_path, cubin_resources, kernel_resources, parse_ptxas_log
from kvarn_cutlass.runtime.module import Kernel, _parse_signature
from kvarn_cutlass.runtime.selftest import AXPY_SIGNATURE, MIX_SIGNATURE, SELFTEST, mix_params


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test gets its own empty cache root."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(root))
    return root


def _entries(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


# --- architectures ------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["sm90", "sm_90", "sm_90a", "90", 90, "9.0", " SM_90 "])
def test_normalize_arch(spelling):
    assert normalize_arch(spelling) == 90


@pytest.mark.parametrize(
    "bad, exc", [("sm_75", ValueError), ("hopper", ValueError), ("sm_86a", ValueError), (9.0, TypeError), (True, TypeError)]
)
def test_normalize_arch_rejects(bad, exc):
    with pytest.raises(exc, match="arch"):
        normalize_arch(bad)


def test_arch_target():
    assert arch_target(90) == "sm_90"
    assert arch_target("sm_90a") == "sm_90a"
    assert arch_target(90, arch_specific=True) == "sm_90a"
    assert arch_target(86, arch_specific=True) == "sm_86"


# --- compilation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a"])
def test_build_selftest_without_gpu(arch):
    compiled = build(SELFTEST, arch)
    assert compiled.cubin[:4] == b"\x7fELF"
    assert set(SELFTEST.kernel_names) <= cubin_symbols(compiled.cubin)
    assert cubin_sm(compiled.cubin) == normalize_arch(arch)
    assert compiled.target == arch
    assert set(compiled.resources) == set(SELFTEST.kernel_names), (compiled.cached, compiled.compiler, compiled.log)
    for res in compiled.resources.values():
        # Spills come from the compiler log, which NVRTC may leave empty once a CUDA context exists.
        assert res.registers > 0 and res.spill_store_bytes in (0, None) and res.spill_load_bytes in (0, None)
    assert compiled.compile_seconds > 0 and not compiled.cached


@pytest.mark.skipif(_nvcc_path() is None, reason="nvcc not installed")
def test_build_with_nvcc_backend():
    compiled = build(SELFTEST, "sm90", backend="nvcc")
    assert set(SELFTEST.kernel_names) <= cubin_symbols(compiled.cubin)
    assert compiled.compiler.startswith("nvcc") and cubin_sm(compiled.cubin) == 90
    assert not build(SELFTEST, "sm90", backend="nvrtc").cached  # one entry per compiler


def test_compile_error_carries_log_and_source_name(tmp_path):
    bad = tmp_path / "broken.cu"
    bad.write_text('extern "C" __global__ void k(float* p) { p[0] = undefined_name; }\n')
    with pytest.raises(CompileError, match=r"broken\.cu") as info:
        build(KernelSpec(str(bad), ("k",)), "sm90")
    assert "undefined_name" in info.value.log and info.value.source_name == "broken.cu"
    assert "undefined_name" in str(info.value)


def test_missing_kernel_symbol_is_a_compile_error(tmp_path):
    src = tmp_path / "mangled.cu"
    src.write_text("__global__ void k(float* p) { p[0] = 1.0f; }\n")  # C++ linkage: the symbol is mangled
    with pytest.raises(CompileError, match='extern "C"'):
        build(KernelSpec(str(src), ("k",)), "sm90")


def test_compile_cubin_rejects_arch_options():
    with pytest.raises(ValueError, match="-arch=sm_80"):
        compile_cubin("", "x.cu", "sm_90", options=["-arch=sm_80"])


def test_parse_ptxas_log():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kern_a' for 'sm_90'
ptxas info    : Function properties for kern_a
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 3.5 ms
ptxas info    : Function properties for _Z6helperf
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'kern_b' for 'sm_80'
ptxas info    : Function properties for kern_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 9 registers, 376 bytes cmem[0]
"""
    res = parse_ptxas_log(log)
    assert set(res) == {"kern_a", "kern_b"}
    a = res["kern_a"]
    assert (a.registers, a.shared_bytes, a.stack_bytes, a.spill_store_bytes, a.spill_load_bytes) == (255, 4096, 24, 8, 12)
    assert a.ptxas_ms == 3.5
    assert (res["kern_b"].registers, res["kern_b"].shared_bytes, res["kern_b"].stack_bytes) == (9, 0, 0)


_SPILL = """extern "C" __global__ void spiller(float* out, const float* x, int n) {
  __shared__ float s[300];
  float acc[64];
  for (int i = 0; i < 64; ++i) acc[i] = x[(threadIdx.x * 64 + i) % n];
  s[threadIdx.x % 300] = acc[threadIdx.x % 64];
  __syncthreads();
  float r = 0; for (int i = 0; i < 64; ++i) r += acc[(i * 7 + n) % 64] * s[i];
  out[threadIdx.x] = r;
}
extern "C" __global__ void plain(double* out) { __shared__ double t[10]; t[threadIdx.x % 10] = 1; __syncthreads(); out[0] = t[3]; }
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_cubin_resources_agree_with_ptxas(arch):
    for source, options in ((_SPILL, ("--maxrregcount=16",)), (_SPILL, ()), (SELFTEST.source_path.read_text(), ())):
        result = compile_cubin(source, "r.cu", arch, options)
        from_log = parse_ptxas_log(result.log)
        if not from_log:
            pytest.skip("NVRTC returned no ptxas report in this process (seen once a CUDA context exists)")
        from_elf = cubin_resources(result.cubin)
        assert set(from_elf) == set(from_log) and from_elf
        for name, res in from_elf.items():
            got = (res.registers, res.shared_bytes, res.stack_bytes)
            assert got == (from_log[name].registers, from_log[name].shared_bytes, from_log[name].stack_bytes), name
            assert res.spill_store_bytes is None
        assert result.resources == from_log  # with a full log, both sources combined equal the log


def test_resources_without_a_log():
    """NVRTC's log can come back empty (seen after CUDA driver init): the CUBIN still gives the essentials."""
    result = compile_cubin(_SPILL, "r.cu", "sm_90", ("--maxrregcount=16",))
    res = kernel_resources(result.cubin, "")["spiller"]
    assert res.registers == result.resources["spiller"].registers and res.stack_bytes > 0
    assert res.shared_bytes == 1200 and res.spill_store_bytes is None and res.ptxas_ms is None


def test_kernel_spec_validation():
    with pytest.raises(ValueError, match="kernel_names"):
        KernelSpec("selftest.cu", ("not a name",))
    with pytest.raises(ValueError, match="C identifier"):
        KernelSpec("selftest.cu", ("k",), defines={"1BAD": 1})
    with pytest.raises(TypeError, match="options"):
        KernelSpec("selftest.cu", ("k",), options="-lineinfo")
    s = KernelSpec("selftest.cu", "k", defines={"B": 2, "A": True})
    assert s.kernel_names == ("k",) and s.defines == (("A", "1"), ("B", "2")) and s.name == "selftest"
    assert hash(s) == hash(KernelSpec("selftest.cu", ("k",), defines=[("A", "1"), ("B", "2")]))
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        build(KernelSpec("nope.cu", ("k",)), "sm90")


# --- disk cache -----------------------------------------------------------------------------------


def test_second_build_is_a_cache_hit(cache_dir, monkeypatch):
    calls = []
    real = spec_mod.compile_cubin
    monkeypatch.setattr(spec_mod, "compile_cubin", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = build(SELFTEST, "sm90")
    (entry,) = _entries(cache_dir)
    mtime = entry.stat().st_mtime_ns
    second = build(SELFTEST, "sm90")
    assert len(calls) == 1 and not first.cached and second.cached
    assert second.cubin == first.cubin and second.resources == first.resources
    assert entry.stat().st_mtime_ns == mtime
    assert entry.parent.parent.name == "sm_90" and entry.name.startswith("selftest-")


def test_cache_key_covers_arch_defines_and_options(cache_dir):
    build(SELFTEST, "sm90")
    assert not build(SELFTEST, "sm80").cached
    assert not build(KernelSpec("selftest.cu", SELFTEST.kernel_names, defines={"KVARN_SELFTEST_BIAS": "1.0f"}), "sm90").cached
    assert not build(KernelSpec("selftest.cu", SELFTEST.kernel_names, options=("-lineinfo",)), "sm90").cached
    assert len(_entries(cache_dir)) == 4
    assert {p.parent.parent.name for p in _entries(cache_dir)} == {"sm_80", "sm_90"}


def test_cache_key_covers_source_edits(tmp_path, cache_dir):
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* p) { p[0] = 1.0f; }\n')
    spec = KernelSpec(str(src), ("k",))
    build(spec, "sm90")
    assert build(spec, "sm90").cached
    src.write_text('extern "C" __global__ void k(float* p) { p[0] = 2.0f; }\n')
    assert not build(spec, "sm90").cached
    (tmp_path / "common.cuh").write_text("// a header beside the source\n")
    assert not build(spec, "sm90").cached


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_damaged_entry_is_detected_and_rebuilt(cache_dir, damage):
    first = build(SELFTEST, "sm90")
    (entry,) = _entries(cache_dir)
    blob = entry.read_bytes()
    if damage == "flip":
        i = len(blob) - 100
        blob = blob[:i] + bytes([blob[i] ^ 0xFF]) + blob[i + 1 :]
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "empty":
        blob = b""
    else:
        blob = b"not a cache entry at all"
    entry.write_bytes(blob)
    again = build(SELFTEST, "sm90")
    assert not again.cached and again.cubin == first.cubin
    assert build(SELFTEST, "sm90").cached  # the rebuilt entry is valid


def test_cached_artifact_validation(cache_dir):
    with pytest.raises(ValueError, match="arch"):
        cached_artifact("kernels", "x", {"source": "s"}, lambda: b"")
    with pytest.raises(TypeError, match="JSON"):
        cached_artifact("kernels", "x", {"arch": 90, "obj": object()}, lambda: b"")
    with pytest.raises(ValueError, match="kind"):
        cached_artifact("../escape", "x", {"arch": 90}, lambda: b"")
    with pytest.raises(TypeError, match="must return bytes"):
        cached_artifact("kernels", "x", {"arch": 90}, lambda: "text")
    assert _entries(cache_dir) == []


def test_cached_artifact_build_runs_once(cache_dir):
    calls = []
    key = {"arch": "sm_90a", "source_sha256": "abc", "options": ["-O3"]}
    assert cached_artifact("gemm", "odd/name with spaces", key, lambda: calls.append(1) or b"payload") == b"payload"
    assert cached_artifact("gemm", "odd/name with spaces", key, lambda: calls.append(1) or b"other") == b"payload"
    assert len(calls) == 1
    (entry,) = _entries(cache_dir)
    assert entry.relative_to(cache_dir).parts[:2] == ("sm_90a", "gemm")
    assert entry.name.startswith("odd_name_with_spaces-")
    assert cache_root() == cache_dir


def _concurrent_worker(barrier, counter: str, out: str) -> None:
    """Child process: build one cached artifact and the selftest module, all children at once."""
    import time

    def slow_build() -> bytes:
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(0.3)  # widen the window in which the other processes would race
        return b"x" * 100_000

    barrier.wait()
    payload = cached_artifact("test", "shared", {"arch": 90}, slow_build)
    compiled = build(SELFTEST, "sm90")
    Path(out).write_bytes(struct.pack("<Q", len(payload)) + compiled.cubin)


def test_concurrent_builds_make_one_valid_entry(tmp_path, cache_dir):
    ctx = multiprocessing.get_context("fork")
    n = 4
    barrier = ctx.Barrier(n)
    counter = tmp_path / "counter"
    outs = [tmp_path / f"out{i}" for i in range(n)]
    procs = [ctx.Process(target=_concurrent_worker, args=(barrier, str(counter), str(o))) for o in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n
    assert counter.read_text() == "built\n"
    results = {o.read_bytes() for o in outs}
    assert len(results) == 1
    assert struct.unpack_from("<Q", results.pop())[0] == 100_000
    assert len(_entries(cache_dir)) == 2
    assert not [p for p in cache_dir.rglob("*") if p.name.endswith(".tmp")]
    assert build(SELFTEST, "sm90").cached


def test_cache_root_env_and_nothing_in_cwd(tmp_path, monkeypatch, cache_dir, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    build(SELFTEST, "sm90")
    build(SELFTEST, "sm80", backend="nvcc" if _nvcc_path() else None)
    assert cli.main(["build", "--arch", "sm90", "--family", "selftest", "--json"]) == 0
    capsys.readouterr()
    assert list(cwd.iterdir()) == []
    assert _entries(cache_dir) and all(p.is_relative_to(cache_dir) for p in _entries(cache_dir))


def test_cache_root_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("KVARN_CUTLASS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvarn-cutlass"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kvarn-cutlass"
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", "rel")
    assert cache_root() == Path.cwd() / "rel"


def test_unwritable_cache_root_names_the_override(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(blocker / "sub"))
    with pytest.raises(OSError, match="KVARN_CUTLASS_CACHE"):
        cached_artifact("kernels", "x", {"arch": 90}, lambda: b"")


# --- shared caches: permissions -------------------------------------------------------------------
def _mode_bits_deny_access() -> bool:
    """False for root (CAP_DAC_OVERRIDE), for whom chmod 0 does not stop a read."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_bytes(b"")
        probe.chmod(0)
        try:
            probe.read_bytes()
        except PermissionError:
            return True
        return False


needs_mode_bits = pytest.mark.skipif(not _mode_bits_deny_access(), reason="running as root: mode bits deny nothing")


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o077])
def test_entries_follow_the_umask(cache_dir, mask):
    """Entries used to be 0600 whatever the umask (tempfile.mkstemp): unreadable to every other user
    of a team, CI or sudo-built cache."""
    with _umask(mask):
        cached_artifact("kernels", "x", {"arch": 90}, lambda: b"payload")
    (entry,) = _entries(cache_dir)
    assert _mode(entry) == 0o666 & ~mask
    assert _mode(entry.parent) == 0o777 & ~mask
    for lock in entry.parent.glob("*.lock"):  # filelock may remove it on release
        assert _mode(lock) == 0o666 & ~mask


def test_write_cache_file_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "d" / "f.so"
    write_cache_file(path, b"one")
    write_cache_file(path, b"two")
    assert read_cache_file(path) == (b"two", "")
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.so"]


def test_read_cache_file_reasons(tmp_path):
    assert read_cache_file(tmp_path / "absent") == (None, "")
    assert read_cache_file(tmp_path / "absent" / "below") == (None, "")
    (tmp_path / "dir").mkdir()
    assert read_cache_file(tmp_path / "dir") == (None, "not a regular file")
    os.mkfifo(tmp_path / "fifo")
    assert read_cache_file(tmp_path / "fifo") == (None, "not a regular file")  # and did not wait for a writer


def _built_once(cache_dir) -> tuple[Path, list]:
    calls = []
    cached_artifact("kernels", "x", {"arch": 90}, lambda: calls.append(1) or b"payload")
    (entry,) = _entries(cache_dir)
    return entry, calls


def _rebuild(calls) -> bytes:
    return cached_artifact("kernels", "x", {"arch": 90}, lambda: calls.append(1) or b"payload")


def test_fifo_entry_is_rebuilt(cache_dir):
    entry, calls = _built_once(cache_dir)
    entry.unlink()
    os.mkfifo(entry)  # a plain read of it blocks until some writer opens it
    unblocked = []

    def unblock() -> None:  # a guard so that a regression fails instead of hanging the suite
        unblocked.append(1)
        with contextlib.suppress(OSError):
            os.close(os.open(entry, os.O_WRONLY | os.O_NONBLOCK))

    guard = threading.Timer(60, unblock)
    guard.start()
    try:
        assert _rebuild(calls) == b"payload" and len(calls) == 2
    finally:
        guard.cancel()
    assert not unblocked, "the cache blocked reading a FIFO entry"
    assert entry.is_file() and _rebuild(calls) == b"payload" and len(calls) == 2


def test_directory_entry_is_an_error_naming_the_path(cache_dir):
    entry, calls = _built_once(cache_dir)
    entry.unlink()
    entry.mkdir()
    with pytest.raises(OSError, match=f"{re.escape(str(entry))}.*KVARN_CUTLASS_CACHE"):
        _rebuild(calls)


@needs_mode_bits
def test_unreadable_entry_is_rebuilt(cache_dir):
    """Another user's private entry (or one from `sudo kvarn-cutlass build`): rebuilt and replaced."""
    entry, calls = _built_once(cache_dir)
    entry.chmod(0)
    assert _rebuild(calls) == b"payload" and len(calls) == 2
    assert _mode(entry) != 0 and _rebuild(calls) == b"payload" and len(calls) == 2


@needs_mode_bits
@pytest.mark.parametrize("readable", [True, False])
def test_read_only_cache_directory(cache_dir, readable):
    """A cache directory the process cannot write: a valid entry is served; a missing or unreadable
    one is an error naming the directory and KVARN_CUTLASS_CACHE (not a bare PermissionError)."""
    entry, calls = _built_once(cache_dir)
    if not readable:
        entry.chmod(0)
    entry.parent.chmod(0o555)
    try:
        if readable:
            assert _rebuild(calls) == b"payload" and len(calls) == 1
            with pytest.raises(OSError, match=f"{re.escape(str(entry.parent))}.*KVARN_CUTLASS_CACHE"):
                cached_artifact("kernels", "other", {"arch": 90}, lambda: b"other")
        else:
            with pytest.raises(OSError, match=f"{re.escape(str(entry.parent))}.*KVARN_CUTLASS_CACHE"):
                _rebuild(calls)
    finally:
        entry.parent.chmod(0o755)


# --- registry -------------------------------------------------------------------------------------


def test_registry_enumerates_selftest():
    fams = registry.families()
    assert fams["selftest"] == (SELFTEST,)
    assert SELFTEST in registry.specs()
    register("selftest", [SELFTEST])  # re-registration with the same specs is harmless
    with pytest.raises(ValueError, match="already registered"):
        register("selftest", [KernelSpec("selftest.cu", ("kvarn_selftest_axpy",))])


# --- argument packing (no driver calls) -----------------------------------------------------------


class _FakeModule:
    device_index = 0
    _ctx = 0


def _kernel(signature) -> Kernel:
    return Kernel(_FakeModule(), "k", _parse_signature("k", signature), func=None)


def _values(holders):
    return [bytes(h) if isinstance(h, ctypes.Array) else h.value for h in holders]


def test_pack_every_kind():
    k = _kernel(MIX_SIGNATURE)
    params = mix_params(1.5, -3, 0.25, 0.5)
    holders, array = k.pack([0x7F00_0000_1000, None, params, -7, 2**32 - 1, 0.125, 2**64 - 1])
    assert _values(holders) == [0x7F00_0000_1000, 0, params, -7, 2**32 - 1, 0.125, 2**64 - 1]
    assert [array[i] for i in range(len(holders))] == [ctypes.addressof(h) for h in holders]
    assert [ctypes.sizeof(h) for h in holders] == [8, 8, 16, 4, 4, 8, 8]
    assert k.signature == ("ptr", "ptr", "bytes:16", "i32", "u32", "f64", "u64")


def test_pack_takes_numpy_scalars_and_rounds_f32_as_ctypes_does():
    import numpy as np

    k = _kernel(AXPY_SIGNATURE)  # ptr, ptr, ptr, f32, i64
    x = 1 / 3  # not representable in f32: the slot holds the nearest float32
    holders, _ = k.pack([np.uint64(0x1000), None, 0x2000, np.float64(x), np.int32(-5)])
    assert _values(holders) == [0x1000, 0, 0x2000, ctypes.c_float(x).value, -5]


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((None, None, None, 1.0), TypeError, r"takes 5 arguments \(ptr, ptr, ptr, f32, i64\), got 4"),
        ((None, None, None, 1.0, 2.5), TypeError, r"argument 4 \(i64 n\): expected an int, got float"),
        ((None, None, None, 1.0, True), TypeError, r"argument 4 \(i64 n\): expected an int, got bool"),
        ((None, None, None, 1.0, 2**63), ValueError, r"argument 4 \(i64 n\): .* out of range"),
        ((None, None, None, torch.tensor(1.0), 4), TypeError, r"argument 3 \(f32 alpha\): .*Tensor.*synchronize"),
        ((None, "0x10", None, 1.0, 4), TypeError, r"argument 1 \(ptr x\): expected a CUDA tensor"),
        ((None, -1, None, 1.0, 4), ValueError, r"argument 1 \(ptr x\): address -1 is out of range"),
        ((None, None, None, 1e39, 4), ValueError, r"argument 3 \(f32 alpha\): 1e\+39 is out of range for f32"),
        ((torch.zeros(4), None, None, 1.0, 4), ValueError, r"argument 0 \(ptr out\): tensor is on cpu"),
    ],
)
def test_pack_errors_name_the_argument(args, exc, match):
    with pytest.raises(exc, match=match):
        _kernel(AXPY_SIGNATURE).pack(args)


def test_pack_struct_errors():
    k = _kernel(("bytes:16 params",))
    with pytest.raises(ValueError, match=r"argument 0 \(bytes:16 params\): expected 16 bytes, got 15"):
        k.pack([b"x" * 15])
    with pytest.raises(TypeError, match="expected bytes of length 16, got str"):
        k.pack(["x" * 16])
    with pytest.raises(TypeError, match="args must be a tuple or list"):
        k.pack(b"x" * 16)


@pytest.mark.parametrize(
    "signature, exc, match",
    [
        (("ptr", "float"), ValueError, r"signature entry 1 is 'float'"),
        (("bytes:0",), ValueError, "N > 0"),
        (("ptr two names",), ValueError, "entry 0"),
        ("ptr", TypeError, "tuple of str"),
        (("ptr", 3), ValueError, "entry 1 is 3"),
    ],
)
def test_signature_errors(signature, exc, match):
    with pytest.raises(exc, match=match):
        _parse_signature("k", signature)


def test_prepare_validates_launch_configuration():
    k = _kernel(("ptr", "i32"))
    prepared = k.prepare((4, 2), 128, (None, 3), shared_mem=1024, cluster=2)
    cfg = prepared._config
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (4, 2, 1, 128, 1, 1)
    assert cfg.sharedMemBytes == 1024 and cfg.numAttrs == 1 and cfg.attrs[0].value.clusterDim.x == 2
    with pytest.raises(ValueError, match="grid"):
        k.prepare(0, 128, (None, 3))
    with pytest.raises(TypeError, match="block"):
        k.prepare(1, (1, 1, 1, 1), (None, 3))
    with pytest.raises(ValueError, match="shared_mem"):
        k.prepare(1, 1, (None, 3), shared_mem=-1)
    with pytest.raises(TypeError, match="cluster"):
        k.prepare(1, 1, (None, 3), cluster="2")
    from cuda.bindings import driver

    pdl = k.prepare(8, 128, (None, 3), cluster=2, programmatic=True)._config
    ids = [a.id for a in pdl.attrs]
    assert pdl.numAttrs == 2 and ids == [driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                                         driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert pdl.attrs[1].value.programmaticStreamSerializationAllowed == 1
    assert k.prepare(1, 1, (None, 3))._config.numAttrs == 0
    with pytest.raises(TypeError, match="programmatic"):
        k.prepare(1, 1, (None, 3), programmatic=1)


# --- CLI and bench records ------------------------------------------------------------------------


def test_cli_build_json(capsys):
    assert cli.main(["build", "--arch", "sm90", "--arch", "sm_80", "--family", "selftest", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["kernels"]
    assert {(r["kernel"], r["target"]) for r in records} == {(k, t) for k in SELFTEST.kernel_names for t in ("sm_90", "sm_80")}
    assert all(r["registers"] > 0 and "module_compile_s" in r for r in records)


def test_cli_build_table_and_errors(capsys):
    assert cli.main(["build", "--arch", "sm90", "--family", "selftest", "--verbose"]) == 0
    table = capsys.readouterr().out
    assert all(k in table for k in SELFTEST.kernel_names)  # the table lists every kernel
    assert cli.main(["build", "--arch", "sm70"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sm_80 or newer" in err
    assert cli.main(["build", "--arch", "sm90", "--family", "nope"]) == 1
    assert "unknown kernel family" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["no-such-command"])
    assert info.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("command", [[], ["build"], ["bench"]])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0 and "usage: kvarn-cutlass" in capsys.readouterr().out


def test_cli_bench_list(capsys):
    assert cli.main(["bench", "--list"]) == 0
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()} >= {"copy", "launch"}


def test_record_section_merges(tmp_path):
    path = tmp_path / "docs" / "h200.json"
    prov = {"gpu": "NVIDIA H200", "date": "2025-01-01T00:00:00+00:00"}
    record_section("copy", {"peak_gb_per_s": 4000.0}, path, prov)
    record_section("launch", {"prepared_launch_us": 5.0}, path, prov)
    record_section("copy", {"peak_gb_per_s": 4100.0}, path, prov)
    doc = json.loads(path.read_text())
    assert doc["sections"]["copy"] == {"provenance": prov, "results": {"peak_gb_per_s": 4100.0}}
    assert doc["sections"]["launch"]["results"] == {"prepared_launch_us": 5.0}
    assert [p.name for p in path.parent.iterdir()] == ["h200.json"]
    assert gpu_slug("NVIDIA H200") == "h200" and gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_cubin_global_reads_exported_numbers():
    """An initialized extern "C" __device__ array comes back byte for byte; missing names raise KeyError."""
    import struct

    from kvarn_cutlass.runtime import cubin_global

    src = (
        'extern "C" __device__ const int exported_numbers[3] = {12345, -7, 1 << 30};\n'
        'extern "C" __device__ int zeroed[4];\n'
        'extern "C" __global__ void k(int* p) { p[threadIdx.x] = exported_numbers[threadIdx.x % 3] + zeroed[0]; }\n'
    )
    cubin = compile_cubin(src, "g.cu", "sm_90").cubin
    assert struct.unpack("<3i", cubin_global(cubin, "exported_numbers")) == (12345, -7, 1 << 30)
    with pytest.raises(KeyError, match="no_such_symbol"):
        cubin_global(cubin, "no_such_symbol")
    with pytest.raises(KeyError, match="zeroed"):  # not initialized: no bytes in the image
        cubin_global(cubin, "zeroed")
    with pytest.raises(ValueError, match="ELF"):
        cubin_global(b"not an elf", "exported_numbers")
