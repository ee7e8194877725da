"""GPU tests of the runtime: launches against torch references, CUDA graphs, driver errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvarn_cutlass import cli
from kvarn_cutlass.bench.timing import time_cuda
from kvarn_cutlass.runtime import CudaError, build, get_module, load_module
from kvarn_cutlass.runtime.selftest import (
    AXPY_SIGNATURE,
    CLUSTER_RANK_SIGNATURE,
    MIX_SIGNATURE,
    REVERSE_SIGNATURE,
    SELFTEST,
    axpy,
    mix_params,
    selftest_module,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KVARN_CUTLASS_CACHE", str(tmp_path_factory.getbasetemp() / "kvarn-cache"))


def _poisoned(n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("n", [1, 255, 256, 1000, 1 << 20, (65535 * 256) + 77])
def test_axpy_matches_torch(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, device="cuda", generator=g)
    y = torch.randn(n, device="cuda", generator=g)
    out = axpy(x, y, 0.75, out=_poisoned(n))
    torch.testing.assert_close(out, 0.75 * x + y, rtol=1e-6, atol=1e-6)


def test_mix_every_argument_kind():
    n, stride, offset, beta = 1001, 7, -5, 0.5
    x = torch.randn(n, device="cuda")
    out = _poisoned(n, torch.float64)
    kernel = selftest_module().kernel("kvarn_selftest_mix", MIX_SIGNATURE)
    kernel.launch((n + 127) // 128, 128, (out, x, mix_params(1.5, 3, 0.25, -0.5), offset, stride, beta, n))
    i = torch.arange(n, device="cuda")
    bias = torch.where(i % 2 == 1, -0.5, 0.25).double()
    expected = 1.5 * x.double()[(i * stride) % n] + bias + beta * (offset + 3)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [1024, 16384, 40000])  # 4 KiB, 64 KiB and 156 KiB of dynamic smem
def test_dynamic_shared_memory_above_48k(chunk):
    blocks = 3
    x = torch.randn(blocks * chunk, device="cuda")
    out = _poisoned(blocks * chunk)
    kernel = selftest_module().kernel("kvarn_selftest_reverse", REVERSE_SIGNATURE)
    kernel.launch(blocks, 256, (out, x, chunk), shared_mem=chunk * 4)
    torch.testing.assert_close(out, x.view(blocks, chunk).flip(1).reshape(-1), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
def test_cluster_launch():
    out = torch.full((16,), -7, dtype=torch.int32, device="cuda")
    kernel = selftest_module().kernel("kvarn_selftest_cluster_rank", CLUSTER_RANK_SIGNATURE)
    kernel.launch(16, 32, (out,), cluster=4)
    assert out.tolist() == [0, 1, 2, 3] * 4


def test_launch_uses_torch_current_stream():
    n = 1 << 22
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = _poisoned(n)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kernel = selftest_module().kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
    with torch.cuda.stream(side):
        kernel.launch(1024, 256, (out, x, y, 2.0, n))
        result = out.clone()  # ordered after the launch only if it went to `side`
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(result, 2.0 * x + y)
    out2 = _poisoned(n)
    side.wait_stream(torch.cuda.current_stream())  # the poison fill runs on the current stream
    kernel.launch(1024, 256, (out2, x, y, 2.0, n), stream=side)
    side.synchronize()
    torch.testing.assert_close(out2, 2.0 * x + y)


def test_graph_capture_and_replay_with_new_inputs():
    n = 4096
    x, y, out, out_eager = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), _poisoned(n), _poisoned(n)
    kernel = selftest_module().kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
    prepared = kernel.prepare(n // 256, 256, (out, x, y, -1.25, n))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prepared.launch()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        prepared.launch()
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(n, device="cuda", generator=g))
        y.copy_(torch.randn(n, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        kernel.launch(n // 256, 256, (out_eager, x, y, -1.25, n))
        torch.cuda.synchronize()
        torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
        torch.testing.assert_close(out, -1.25 * x + y)


def test_bad_launch_raises_cuda_error_naming_call_and_kernel():
    kernel = selftest_module().kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
    x = torch.zeros(4, device="cuda")
    with pytest.raises(CudaError, match=r"cuLaunchKernelEx.*kvarn_selftest_axpy") as info:
        kernel.launch(1, 4096, (x, x, x, 1.0, 4))
    assert info.value.call == "cuLaunchKernelEx" and info.value.kernel == "kvarn_selftest_axpy"
    assert info.value.error_name.startswith("CUDA_ERROR_")
    reverse = selftest_module().kernel("kvarn_selftest_reverse", REVERSE_SIGNATURE)
    with pytest.raises(CudaError, match=r"cuFuncSetAttribute.*kvarn_selftest_reverse"):
        reverse.launch(1, 256, (x, x, 4), shared_mem=1 << 20)
    torch.cuda.synchronize()  # the context is still healthy
    assert axpy(x + 1, x, 2.0).tolist() == [2.0] * 4


def test_signature_checked_against_kernel_parameters():
    module = selftest_module()
    with pytest.raises(TypeError, match="takes 5 parameters"):
        module.kernel("kvarn_selftest_axpy", AXPY_SIGNATURE + ("i32",))
    with pytest.raises(TypeError, match="more than the 4"):
        module.kernel("kvarn_selftest_axpy", AXPY_SIGNATURE[:4])
    with pytest.raises(ValueError, match=r"argument 2 \(bytes:8\): the kernel's parameter is 16 bytes"):
        module.kernel("kvarn_selftest_mix", ("ptr", "ptr", "bytes:8", "i32", "u32", "f64", "u64"))
    with pytest.raises(CudaError, match="cuModuleGetFunction.*no_such_kernel"):
        module.kernel("no_such_kernel", ("ptr",))


def test_wrong_arch_cubin_is_rejected():
    major, minor = torch.cuda.get_device_capability()
    other = "sm_80" if major != 8 else "sm_90"
    with pytest.raises(CudaError, match="cuModuleLoadData"):
        load_module(build(SELFTEST, other).cubin)


def test_get_module_is_cached_and_tensor_device_checked():
    assert get_module(SELFTEST) is get_module(SELFTEST, torch.cuda.current_device())
    kernel = selftest_module().kernel("kvarn_selftest_axpy", AXPY_SIGNATURE)
    with pytest.raises(ValueError, match=r"argument 1 \(ptr x\): tensor is on cpu"):
        kernel.launch(1, 32, (torch.zeros(4, device="cuda"), torch.zeros(4), None, 1.0, 4))


def test_time_cuda_times_the_work_it_calls():
    """Eager: fn runs warmup + runs times, rotating the sets; graph: one eager warm-up call and one
    captured call per set, replays call nothing. The time covers the work: a kernel spinning a known
    number of GPU cycles measures at least cycles / 5 GHz (no SM clock is faster), per call in a graph
    too; a timer whose events missed the work (another stream, both recorded before it) would not."""
    cycles, sets, calls = 2_000_000, [0, 1, 2], []

    def spin(s):
        calls.append(s)
        torch.cuda._sleep(cycles)

    eager = time_cuda(spin, sets, warmup=3, runs=20)
    assert calls[:5] == [0, 1, 2, 0, 1] and len(calls) == 3 + 20
    assert (eager.runs, eager.calls_per_run, eager.graph) == (20, 1, False)
    calls.clear()
    graphed = time_cuda(spin, sets, warmup=3, runs=20, graph=True)
    assert calls == sets + sets
    assert (graphed.runs, graphed.calls_per_run, graphed.graph) == (20, 3, True)
    floor_us = cycles / 5e9 * 1e6
    assert eager.min_us >= floor_us and graphed.min_us >= floor_us, (eager, graphed)


def test_cli_bench_quick_records(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--section", "launch", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    (record,) = tmp_path.glob("*.json")
    doc = json.loads(record.read_text())
    launch = doc["sections"]["launch"]
    assert launch["provenance"]["gpu"] == torch.cuda.get_device_name()
    res = launch["results"]
    assert (res["calls"], res["repeats"], res["graph_gpu_us"]["runs"]) == (500, 3, 20)  # what --quick runs
    for key in ("prepared_launch_us", "kernel_launch_us", "torch_add_us"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), (key, res[key])
