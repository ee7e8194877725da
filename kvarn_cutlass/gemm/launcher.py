"""``KScoreGemm``: the sm_90 K-score GEMM prepared once for a problem, launched cheaply.

    g = KScoreGemm(M=4096, N=128, K=256, L=128, out_dtype="f16")      # D=128; picks a config (configs.py)
    g.run(qi8, codes, a, bias, row_scale, scale, out)                   # on torch's current stream

Shapes (per batch l = head * n_tiles + tile, see :mod:`.prep`):
    qi8 int8 [L, M, K]; codes int8 [L, N, K] (token-major); a, bias f32 [L, M]; row_scale f32 [L, N];
    out [L, M, N] (f16/f32 per config; int32 for the "s32" accumulator test path).
K is the GEMM depth: K = 2 * head_dim for the prep kernels' operands (centered codes ``[16*(c-8) ++ (c-8)]``
against the two-level fold ``[hi ++ lo]``).  The config table stays keyed by head_dim: a config is
selected for the bucket of D = K // 2 (tile_k divides D, hence K) and validated for the real K.

``run`` does no emission, compilation, allocation or synchronisation: the kernel ``Params`` bytes
(TMA descriptors) are built by the config's host helper once per (pointer set, scale) and the packed
launch is kept in a small cache; afterwards a call is a dict lookup plus ``cuLaunchKernelEx``.
Tensors are validated when their pointer set is first seen; keep them alive and in place.
"""
from __future__ import annotations

from typing import Any

import torch

from .compile import GemmBinary, KvarnKScoreArgs, build_gemm
from .config import GemmConfig, validate_for_problem

__all__ = ["KScoreGemm"]

_OUT_TORCH = {"f16": torch.float16, "f32": torch.float32, "s32": torch.int32}


class KScoreGemm:
    """One compiled config bound to one problem shape (M, N, K, L) on one device."""

    MAX_CACHED = 64

    def __init__(self, M: int, N: int, K: int, L: int, out_dtype: str = "f16", config: GemmConfig | None = None,
                 device: Any = None):
        from .. import runtime as rt

        if config is None:
            from .configs import select_config

            if K % 2:
                raise ValueError(f"K={K} must be 2 * head_dim (the [hi ++ lo] operands of gemm.prep)")
            config = select_config(90, M=M, N=N, head_dim=K // 2, L=L, out_dtype=out_dtype)
        if config.out_dtype != out_dtype:
            raise ValueError(f"config out_dtype {config.out_dtype!r} != requested {out_dtype!r}")
        ok, why = validate_for_problem(config, M, N, K, L)
        if not ok:
            raise ValueError(f"config {config.name} cannot run M={M} N={N} K={K} L={L}: {why}")
        self.M, self.N, self.K, self.L = M, N, K, L
        self.config = config
        self.out_torch_dtype = _OUT_TORCH[config.out_dtype]
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        arch = rt.device_arch(self.device)
        if arch != 90:
            raise RuntimeError(f"KScoreGemm needs an sm_90 GPU (wgmma, sm_90a cubin); device {self.device} is sm_{arch}")
        self.binary: GemmBinary = build_gemm(config, 90)
        self.host = self.binary.host()
        self.module = rt.load_module(self.binary.cubin, self.device)
        self.kernel = self.module.kernel(self.binary.entry, (f"bytes:{self.host.params_size}",))
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self._cache: dict[tuple, Any] = {}
        self._workspace = None
        self.grid: tuple[int, int, int] | None = None

    # -----------------------------------------------------------------------------------------
    def _check(self, name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (M={self.M} N={self.N} K={self.K} L={self.L}), got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, the GEMM on {self.device}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} data_ptr must be 16-byte aligned for TMA")

    def _prepare(self, qi8, codes, a, bias, row_scale, scale: float, out):
        M, N, K, L = self.M, self.N, self.K, self.L
        self._check("qi8", qi8, (L, M, K), torch.int8)
        self._check("codes", codes, (L, N, K), torch.int8)
        self._check("out", out, (L, M, N), self.out_torch_dtype)
        if self.config.out_dtype != "s32":
            self._check("a", a, (L, M), torch.float32)
            self._check("bias", bias, (L, M), torch.float32)
            self._check("row_scale", row_scale, (L, N), torch.float32)
        args = KvarnKScoreArgs()
        args.ptr_a, args.ptr_b, args.ptr_d = qi8.data_ptr(), codes.data_ptr(), out.data_ptr()
        args.ptr_row_a = a.data_ptr() if a is not None else 0
        args.ptr_row_bias = bias.data_ptr() if bias is not None else 0
        args.ptr_col_scale = row_scale.data_ptr() if row_scale is not None else 0
        args.lda, args.batch_a = K, M * K
        args.ldb, args.batch_b = K, N * K
        args.ldd, args.batch_d = N, M * N
        args.batch_row, args.batch_col = M, N
        args.M, args.N, args.K, args.L = M, N, K, L
        args.scale = float(scale)
        args.sm_count = self.sm_count
        args.workspace = 0
        ws = self.host.workspace_size(args)
        if ws > 0:
            if self._workspace is None or self._workspace.numel() < ws:
                self._workspace = torch.zeros(ws, dtype=torch.uint8, device=self.device)
            args.workspace = self._workspace.data_ptr()
        params, grid = self.host.params(args)
        self.grid = grid
        cl = self.host.cluster
        return self.kernel.prepare(grid, self.host.threads, (params,), shared_mem=self.host.smem_size,
                                   cluster=cl if cl != (1, 1, 1) else None)

    def run(self, qi8: torch.Tensor, codes: torch.Tensor, a: torch.Tensor | None, bias: torch.Tensor | None,
            row_scale: torch.Tensor | None, scale: float, out: torch.Tensor, stream: Any = None) -> torch.Tensor:
        """Enqueue ``out = scale * row_scale * (a * (qi8 @ codes^T) + bias)`` on ``stream`` (torch's current
        stream by default).  Returns ``out``.  CUDA-graph capturable."""
        key = (qi8.data_ptr(), codes.data_ptr(), out.data_ptr(),
               a.data_ptr() if a is not None else 0, bias.data_ptr() if bias is not None else 0,
               row_scale.data_ptr() if row_scale is not None else 0, scale)
        pl = self._cache.get(key)
        if pl is None:
            if len(self._cache) >= self.MAX_CACHED:
                self._cache.clear()
            pl = self._cache[key] = self._prepare(qi8, codes, a, bias, row_scale, scale, out)
        pl.launch(stream)
        return out

    def __repr__(self) -> str:
        return f"KScoreGemm(M={self.M}, N={self.N}, K={self.K}, L={self.L}, config={self.config.name})"
