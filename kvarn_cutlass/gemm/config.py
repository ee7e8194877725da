"""``GemmConfig``: one point of the sm_90 K-score GEMM design space, and its validators.

Validators return ``(ok, reason)`` so planners/tuners can filter and explain rejections.

Terminology (CUTLASS 3.x): ``tile`` is the CTA work tile (M x N x K) handed to the
CollectiveBuilders.  For the *pingpong* schedule each consumer warp group owns one whole work tile,
so tile_m = 64 is the natural size (two warp groups alternate between tiles); for *cooperative*
(and stream-K, which is cooperative with a stream-K tile scheduler) the two consumer warp groups
split tile_m, so tile_m must be a multiple of 128.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

__all__ = [
    "GemmConfig",
    "KERNEL_SCHEDULES",
    "EPILOGUE_SCHEDULES",
    "OUT_DTYPES",
    "validate_config",
    "validate_for_problem",
]

# kernel schedule -> (CUTLASS mainloop schedule tag, tile scheduler tag, default epilogue)
KERNEL_SCHEDULES: dict[str, tuple[str, str, str]] = {
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "void", "tma"),
    "cooperative": ("cutlass::gemm::KernelTmaWarpSpecializedCooperative", "void", "tma_cooperative"),
    "streamk": (
        "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
        "cutlass::gemm::StreamKScheduler",
        "tma_cooperative",
    ),
}
EPILOGUE_SCHEDULES: dict[str, str] = {
    "tma": "cutlass::epilogue::TmaWarpSpecialized",
    "tma_cooperative": "cutlass::epilogue::TmaWarpSpecializedCooperative",
}
# out dtype -> (C++ element, bytes).  "s32" writes the raw int32 accumulator (identity epilogue):
# the bit-exact test path, not a production output.
OUT_DTYPES: dict[str, tuple[str, int]] = {
    "f16": ("cutlass::half_t", 2),
    "f32": ("float", 4),
    "s32": ("int32_t", 4),
}
_VALID_EPILOGUE = {
    "pingpong": {"tma"},
    "cooperative": {"tma_cooperative"},
    "streamk": {"tma_cooperative"},
}


@dataclasses.dataclass(frozen=True, order=True)
class GemmConfig:
    """A CUTLASS 3.x sm_90 int8 (s8 x s8 -> s32) GEMM with the K-score EVT epilogue.

    A is row-major M x K (int8 folded queries), B is column-major K x N (int8 token-major codes),
    D is row-major M x N per batch.  ``stages=0`` lets the builder carve out the epilogue smem
    (``StageCountAutoCarveout``).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    kernel_schedule: str = "cooperative"
    epilogue_schedule: str = ""  # "" -> the kernel schedule's natural epilogue
    out_dtype: str = "f16"
    stages: int = 0
    align_a: int = 16
    align_b: int = 16

    # ---- derived -------------------------------------------------------------------------------
    @property
    def epilogue(self) -> str:
        return self.epilogue_schedule or KERNEL_SCHEDULES.get(self.kernel_schedule, ("", "", "tma"))[2]

    @property
    def align_d(self) -> int:
        """16-byte TMA store alignment in elements: 8 for f16, 4 for f32/s32."""
        return 16 // OUT_DTYPES[self.out_dtype][1]

    @property
    def tile(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (self.cluster_m, self.cluster_n, 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GemmConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown GemmConfig fields {sorted(unknown)}")
        return cls(**d)

    def replace(self, **kw) -> "GemmConfig":
        return dataclasses.replace(self, **kw)

    @property
    def name(self) -> str:
        """Readable, unique name (every field that changes the source appears)."""
        ep = self.epilogue
        st = f"_s{self.stages}" if self.stages else ""
        return (
            f"kscore_sm90_{self.tile_m}x{self.tile_n}x{self.tile_k}_c{self.cluster_m}x{self.cluster_n}"
            f"_{self.kernel_schedule}_epi_{ep}_{self.out_dtype}_a{self.align_a}b{self.align_b}{st}"
        )

    @property
    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def validate_config(cfg: GemmConfig) -> tuple[bool, str]:
    """Problem-independent validity of a config for sm_90 int8 wgmma.  Returns ``(ok, reason)``."""
    if cfg.kernel_schedule not in KERNEL_SCHEDULES:
        return False, f"unknown kernel_schedule {cfg.kernel_schedule!r}; one of {sorted(KERNEL_SCHEDULES)}"
    if cfg.epilogue not in EPILOGUE_SCHEDULES:
        return False, f"unknown epilogue_schedule {cfg.epilogue!r}; one of {sorted(EPILOGUE_SCHEDULES)}"
    if cfg.epilogue not in _VALID_EPILOGUE[cfg.kernel_schedule]:
        return False, (
            f"epilogue {cfg.epilogue!r} does not pair with kernel schedule {cfg.kernel_schedule!r} "
            f"(needs {sorted(_VALID_EPILOGUE[cfg.kernel_schedule])})"
        )
    if cfg.out_dtype not in OUT_DTYPES:
        return False, f"unknown out_dtype {cfg.out_dtype!r}; one of {sorted(OUT_DTYPES)}"
    if cfg.align_a != 16 or cfg.align_b != 16:
        return False, "int8 TMA operands need 16-element (16-byte) alignment for A and B"
    if cfg.kernel_schedule == "pingpong":
        if cfg.tile_m != 64:
            return False, "pingpong: each consumer warp group owns a whole tile; tile_m must be 64"
    else:
        if cfg.tile_m not in (128, 256):
            return False, f"{cfg.kernel_schedule}: two consumer warp groups split tile_m; tile_m must be 128 or 256"
    if cfg.tile_n not in (32, 64, 128, 192, 256):
        return False, f"tile_n={cfg.tile_n}: int8 wgmma N must be a multiple of 32 up to 256 (32/64/128/192/256 here)"
    if cfg.tile_k not in (64, 128, 256):
        return False, f"tile_k={cfg.tile_k}: int8 wgmma K step is 32; use 64, 128 or 256 (128 = 128-byte swizzle rows)"
    if cfg.cluster_m not in (1, 2, 4) or cfg.cluster_n not in (1, 2, 4):
        return False, f"cluster {cfg.cluster_m}x{cfg.cluster_n}: each dim must be 1, 2 or 4"
    if cfg.cluster_m * cfg.cluster_n > 8:
        return False, "cluster larger than the portable limit of 8 CTAs"
    if cfg.stages not in (0,) and not (2 <= cfg.stages <= 8):
        return False, f"stages={cfg.stages}: 0 (auto carveout) or 2..8"
    # shared memory estimate: A and B stages + epilogue D staging + small barriers, 227 KB on H200
    stage_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k
    stages = cfg.stages or 2
    if stages * stage_bytes > 200 * 1024:
        return False, f"{stages} stages x {stage_bytes} B per stage exceeds the sm_90 shared memory budget"
    if cfg.tile_m * cfg.tile_n > 256 * 128 and cfg.out_dtype in ("f32", "s32") and cfg.kernel_schedule == "pingpong":
        return False, "pingpong with a 32-bit output tile this large spills accumulators"
    return True, ""


def validate_for_problem(cfg: GemmConfig, M: int, N: int, K: int, L: int) -> tuple[bool, str]:
    """Validity (and non-wastefulness) of ``cfg`` for problem (M, N, K, L).  ``(ok, reason)``."""
    ok, why = validate_config(cfg)
    if not ok:
        return ok, why
    for nm, v in (("M", M), ("N", N), ("K", K), ("L", L)):
        if not isinstance(v, int) or v <= 0:
            return False, f"{nm}={v!r} must be a positive int"
    if K % 16:
        return False, f"K={K} must be a multiple of 16 (16-byte TMA rows of int8)"
    if N % cfg.align_d:
        return False, f"N={N} must be a multiple of {cfg.align_d} for the {cfg.out_dtype} TMA epilogue"
    if K % cfg.tile_k:
        return False, f"K={K} is not a multiple of tile_k={cfg.tile_k} (head_dim sets K exactly)"
    if cfg.tile_n > N:
        return False, f"tile_n={cfg.tile_n} > N={N}: half the MMA work would be padding"
    n_tiles_n = -(-N // cfg.tile_n)
    if n_tiles_n % cfg.cluster_n:
        return False, f"cluster_n={cfg.cluster_n} does not divide the {n_tiles_n} N tiles (grid would be padded)"
    if cfg.kernel_schedule == "streamk" and K // cfg.tile_k < 2:
        return False, f"stream-K needs >= 2 K blocks to split; K={K}, tile_k={cfg.tile_k} gives {K // cfg.tile_k}"
    return True, ""
