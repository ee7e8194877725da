"""C++ emission of the sm_90 K-score GEMM for a :class:`GemmConfig` (no GPU, no compiler).

One translation unit per config holds
  * the CUTLASS 3.x kernel type (CollectiveBuilder mainloop + epilogue with an EVT, GemmUniversal),
  * an ``extern "C" __global__`` entry ``<entry>`` (procedural name, no mangling) doing what
    ``cutlass::device_kernel`` does, and
  * ``extern "C"`` host functions ``<entry>_query`` / ``<entry>_params`` that report
    sizes and fill the kernel's ``Params`` bytes (incl. TMA descriptors) from a plain C struct
    ``KvarnKScoreArgs`` (see :data:`ARGS_FIELDS`); they are compiled into a host shared library
    and called once per (config, shape, pointer set), never per launch.

The epilogue visitor tree (EVT), per batch ``l`` (row m, column n):

    D[l,m,n] = (scale * rowScale[l,n]) * (a[l,m] * acc[l,m,n] + bias[l,m])

    Sm90EVT<Compute<multiplies, ElementD>,                 -- outer product, converts to D
      Sm90EVT<Compute<multiplies>, ScalarBroadcast(scale), RowBroadcast(rowScale f32, stride (0,1,N))>,
      Sm90EVT<Compute<homogeneous_multiply_add>, ColBroadcast(a f32, stride (1,0,M)), AccFetch,
               ColBroadcast(bias f32, stride (1,0,M))>>

It is the same tree that ``cutlass_cppgen.epilogue.trace`` builds for
``D = scale * rs * (a * accum + bias)`` (see :func:`cppgen_reference_source`), with the
``a*acc+bias`` pair fused into one FMA node.  ``out_dtype="s32"`` replaces the tree with the raw
accumulator (bit-exact test path).

Emission is a pure function of the config: same config -> byte-identical source.
"""
from __future__ import annotations

import hashlib
from string import Template

from .config import EPILOGUE_SCHEDULES, KERNEL_SCHEDULES, OUT_DTYPES, GemmConfig, validate_config

__all__ = ["emit_source", "entry_name", "source_digest", "ARGS_FIELDS", "cppgen_reference_source"]

# Layout of the C struct KvarnKScoreArgs (host side).  Order matters; mirrored by ctypes in compile.py.
ARGS_FIELDS: tuple[tuple[str, str], ...] = (
    ("ptr_a", "void const*"),      # int8 A  [L, M, K] (qi8)
    ("ptr_b", "void const*"),      # int8 B  [L, N, K] (token-major codes)
    ("ptr_d", "void*"),            # D       [L, M, N]
    ("ptr_row_a", "float const*"),  # a       [L, M] f32
    ("ptr_row_bias", "float const*"),  # bias [L, M] f32
    ("ptr_col_scale", "float const*"),  # rowScale [L, N] f32
    ("workspace", "void*"),        # stream-K workspace (or null)
    ("lda", "int64_t"), ("batch_a", "int64_t"),
    ("ldb", "int64_t"), ("batch_b", "int64_t"),
    ("ldd", "int64_t"), ("batch_d", "int64_t"),
    ("batch_row", "int64_t"),      # batch stride of a/bias (elements)
    ("batch_col", "int64_t"),      # batch stride of rowScale (elements)
    ("M", "int32_t"), ("N", "int32_t"), ("K", "int32_t"), ("L", "int32_t"),
    ("scale", "float"),
    ("sm_count", "int32_t"),
)

# _query(what) selectors
QUERY = {"params_size": 0, "smem_size": 1, "threads": 2, "cluster_m": 3, "cluster_n": 4, "cluster_k": 5,
         "min_blocks": 6, "args_size": 7}

_INCLUDES = (
    "cutlass/cutlass.h",
    "cutlass/numeric_types.h",
    "cutlass/functional.h",
    "cute/tensor.hpp",
    "cutlass/gemm/gemm.h",
    "cutlass/gemm/dispatch_policy.hpp",
    "cutlass/gemm/collective/collective_builder.hpp",
    "cutlass/epilogue/collective/collective_builder.hpp",
    "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp",
    "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp",
    "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp",
    "cutlass/gemm/kernel/gemm_universal.hpp",
    "cutlass/gemm/kernel/tile_scheduler.hpp",
    "cutlass/kernel_hardware_info.h",
    "cutlass/device_kernel.h",
)

_EVT_KSCORE = r"""
using EpiTile = Shape<_${epi_tile_m}, _${tile_n}, _${tile_k}>;  // CTA tile seen by the epilogue
using Acc    = cutlass::epilogue::fusion::Sm90AccFetch;
using RowA   = cutlass::epilogue::fusion::Sm90ColBroadcast<0, EpiTile, float, float, Stride<_1, _0, int64_t>>;
using RowBias= cutlass::epilogue::fusion::Sm90ColBroadcast<0, EpiTile, float, float, Stride<_1, _0, int64_t>>;
using ColRs  = cutlass::epilogue::fusion::Sm90RowBroadcast<0, EpiTile, float, float, Stride<_0, _1, int64_t>>;
using Scale  = cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, int64_t>>;
using FmaNode = cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
using EVTFma  = cutlass::epilogue::fusion::Sm90EVT<FmaNode, RowA, Acc, RowBias>;  // a*acc + bias
using MulNode = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
using EVTColScale = cutlass::epilogue::fusion::Sm90EVT<MulNode, Scale, ColRs>;     // scale*rowScale
using OutNode = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
using FusionCallbacks = cutlass::epilogue::fusion::Sm90EVT<OutNode, EVTColScale, EVTFma>;

inline typename FusionCallbacks::Arguments make_fusion_args(KvarnKScoreArgs const& a) {
  using namespace cute;
  typename FusionCallbacks::Arguments f{
    {                                                   // EVTColScale
      {{a.scale}, {nullptr}, {}},                       //   Scale
      {a.ptr_col_scale, 0.f, {_0{}, _1{}, a.batch_col}},//   ColRs
      {}                                                //   MulNode
    },
    {                                                   // EVTFma
      {a.ptr_row_a, 0.f, {_1{}, _0{}, a.batch_row}},    //   RowA
      {},                                               //   Acc
      {a.ptr_row_bias, 0.f, {_1{}, _0{}, a.batch_row}}, //   RowBias
      {}                                                //   FmaNode
    },
    {}                                                  // OutNode
  };
  return f;
}
"""

_EVT_IDENTITY = r"""
using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
using OutNode = cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, ElementD,
                                                       cutlass::FloatRoundStyle::round_to_nearest>;
using FusionCallbacks = cutlass::epilogue::fusion::Sm90EVT<OutNode, Acc>;

inline typename FusionCallbacks::Arguments make_fusion_args(KvarnKScoreArgs const&) {
  typename FusionCallbacks::Arguments f{{}, {}};
  return f;
}
"""

_TEMPLATE = Template(r"""// kvarn_cutlass K-score GEMM, generated by kvarn_cutlass.gemm.emit -- do not edit.
// config: ${config_repr}
${includes}
#include "cutlass/epilogue/thread/activation.h"
#include <cstdint>
#include <cstring>

using namespace cute;

struct KvarnKScoreArgs {
${args_fields}
};

namespace kvarn_${entry} {

using ElementA = int8_t;
using ElementB = int8_t;
using ElementAcc = int32_t;
using ElementD = ${element_d};
using LayoutA = cutlass::layout::RowMajor;     // M x K, K-major
using LayoutB = cutlass::layout::ColumnMajor;  // K x N, K-major (token-major rows)
using LayoutD = cutlass::layout::RowMajor;
using TileShape = Shape<_${tile_m}, _${tile_n}, _${tile_k}>;
using ClusterShape = Shape<_${cluster_m}, _${cluster_n}, _1>;
using KernelSchedule = ${kernel_schedule};
using EpilogueSchedule = ${epilogue_schedule};
using TileScheduler = ${tile_scheduler};
${evt}
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
    ElementAcc, float,
    void, LayoutD, ${align_d},
    ElementD, LayoutD, ${align_d},
    EpilogueSchedule,
    FusionCallbacks
  >::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, LayoutA, ${align_a},
    ElementB, LayoutB, ${align_b},
    ElementAcc,
    TileShape, ClusterShape,
    ${stage_count},
    KernelSchedule
  >::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, TileScheduler>;

}  // namespace kvarn_${entry}

// ---- device entry (what cutlass::device_kernel<GemmKernel> does, with a C name) --------------
extern "C" __global__ void
__launch_bounds__(kvarn_${entry}::GemmKernel::MaxThreadsPerBlock, kvarn_${entry}::GemmKernel::MinBlocksPerMultiprocessor)
${entry}(CUTLASS_GRID_CONSTANT typename kvarn_${entry}::GemmKernel::Params const params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem[];
  kvarn_${entry}::GemmKernel op;
  op(params, smem);
#endif
}

// ---- host side: sizes and Params construction ------------------------------------------------
#if !defined(__CUDA_ARCH__)
namespace kvarn_${entry} {
static bool make_arguments(KvarnKScoreArgs const& a, typename GemmKernel::Arguments& out) {
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  StrideA sA{a.lda, _1{}, a.batch_a};
  StrideB sB{a.ldb, _1{}, a.batch_b};
  StrideD sD{a.ldd, _1{}, a.batch_d};
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = a.sm_count;
  typename GemmKernel::Arguments args{
    cutlass::gemm::GemmUniversalMode::kGemm,
    {a.M, a.N, a.K, a.L},
    {static_cast<ElementA const*>(a.ptr_a), sA, static_cast<ElementB const*>(a.ptr_b), sB},
    {make_fusion_args(a), nullptr, sD, static_cast<ElementD*>(a.ptr_d), sD},
    hw
  };
  out = args;
  return true;
}
}  // namespace kvarn_${entry}

extern "C" int64_t ${entry}_query(int what) {
  using K = kvarn_${entry}::GemmKernel;
  switch (what) {
    case 0: return (int64_t)sizeof(typename K::Params);
    case 1: return (int64_t)K::SharedStorageSize;
    case 2: return (int64_t)K::MaxThreadsPerBlock;
    case 3: return (int64_t)cute::size<0>(typename K::ClusterShape{});
    case 4: return (int64_t)cute::size<1>(typename K::ClusterShape{});
    case 5: return (int64_t)cute::size<2>(typename K::ClusterShape{});
    case 6: return (int64_t)K::MinBlocksPerMultiprocessor;
    case 7: return (int64_t)sizeof(KvarnKScoreArgs);
    default: return -1;
  }
}

extern "C" int64_t ${entry}_workspace_size(KvarnKScoreArgs const* a) {
  typename kvarn_${entry}::GemmKernel::Arguments args;
  kvarn_${entry}::make_arguments(*a, args);
  return (int64_t)kvarn_${entry}::GemmKernel::get_workspace_size(args);
}

// Returns 0 on success; 1: can_implement rejected the problem; 2: params_cap too small;
// 3: workspace needed but null.  grid_out receives the 3 grid dims.
extern "C" int ${entry}_params(KvarnKScoreArgs const* a, void* params_out, int64_t params_cap,
                               int32_t* grid_out) {
  using K = kvarn_${entry}::GemmKernel;
  typename K::Arguments args;
  kvarn_${entry}::make_arguments(*a, args);
  if (!K::can_implement(args)) return 1;
  if (params_cap < (int64_t)sizeof(typename K::Params)) return 2;
  if (K::get_workspace_size(args) > 0 && a->workspace == nullptr) return 3;
  typename K::Params p = K::to_underlying_arguments(args, a->workspace);
  std::memcpy(params_out, &p, sizeof(p));
  dim3 g = K::get_grid_shape(p);
  grid_out[0] = (int32_t)g.x; grid_out[1] = (int32_t)g.y; grid_out[2] = (int32_t)g.z;
  return 0;
}
#endif  // !__CUDA_ARCH__
""")


def entry_name(cfg: GemmConfig) -> str:
    """Procedural ``extern "C"`` kernel symbol for ``cfg`` (host helpers append suffixes)."""
    return f"kvarn_{cfg.name}"


def emit_source(cfg: GemmConfig) -> str:
    """Return the full .cu source for ``cfg``.  Raises ``ValueError`` (with the reason) if invalid."""
    ok, why = validate_config(cfg)
    if not ok:
        raise ValueError(f"invalid GemmConfig {cfg}: {why}")
    mainloop, tile_sched, _ = KERNEL_SCHEDULES[cfg.kernel_schedule]
    element_d = OUT_DTYPES[cfg.out_dtype][0]
    evt = _EVT_IDENTITY if cfg.out_dtype == "s32" else Template(_EVT_KSCORE).substitute(
        epi_tile_m=cfg.tile_m, tile_n=cfg.tile_n, tile_k=cfg.tile_k
    )
    if cfg.stages:
        stage_count = f"cutlass::gemm::collective::StageCount<{cfg.stages}>"
    else:
        stage_count = ("cutlass::gemm::collective::StageCountAutoCarveout<"
                       "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>")
    entry = entry_name(cfg)
    return _TEMPLATE.substitute(
        config_repr=repr(cfg),
        includes="\n".join(f'#include "{h}"' for h in _INCLUDES),
        args_fields="\n".join(f"  {t} {n};" for n, t in ARGS_FIELDS),
        entry=entry,
        element_d=element_d,
        tile_m=cfg.tile_m, tile_n=cfg.tile_n, tile_k=cfg.tile_k,
        cluster_m=cfg.cluster_m, cluster_n=cfg.cluster_n,
        kernel_schedule=mainloop,
        epilogue_schedule=EPILOGUE_SCHEDULES[cfg.epilogue],
        tile_scheduler=tile_sched,
        evt=evt,
        align_a=cfg.align_a, align_b=cfg.align_b, align_d=cfg.align_d,
        stage_count=stage_count,
    )


def source_digest(cfg: GemmConfig) -> str:
    return hashlib.sha256(emit_source(cfg).encode()).hexdigest()


def _kscore_fn(accum, a, bias, rs, scale):
    D = scale * rs * (a * accum + bias)
    return D


def cppgen_reference_source(cfg: GemmConfig, cc: int = 90, L: int = 2, M: int = 256, N: int = 128) -> str:
    """The equivalent kernel as emitted by ``cutlass_cppgen`` (plan + EVT tracing), with no GPU.

    For inspection and cross-checking of the hand-assembled template above (types, schedules,
    EVT node set); it is not what gets compiled, because cutlass_cppgen's emission carries its own
    argument marshalling and names.  Takes a few seconds (builds cutlass_cppgen's option registry).
    """
    from .compat import cutlass_cppgen_offline

    ok, why = validate_config(cfg)
    if not ok:
        raise ValueError(why)
    if cfg.out_dtype == "s32":
        raise ValueError("cppgen reference is only for the EVT (f16/f32) outputs")
    with cutlass_cppgen_offline(cc) as cutlass:
        import cutlass_library as cl

        dd = {"f16": cl.DataType.f16, "f32": cl.DataType.f32}[cfg.out_dtype]
        rm = cl.LayoutType.RowMajor
        ex = {
            "accum": cutlass.Tensor(shape=(L, M, N), element=cl.DataType.s32, layout_tag=rm),
            "a": cutlass.Tensor(shape=(L, M, 1), element=cl.DataType.f32, layout_tag=rm),
            "bias": cutlass.Tensor(shape=(L, M, 1), element=cl.DataType.f32, layout_tag=rm),
            "rs": cutlass.Tensor(shape=(L, 1, N), element=cl.DataType.f32, layout_tag=rm),
            "scale": 1.0,
            "D": cutlass.Tensor(shape=(L, M, N), element=dd, layout_tag=rm),
        }
        ev = cutlass.epilogue.trace(_kscore_fn, ex, cc=cc)
        plan = cutlass.op.Gemm(
            element_A=cl.DataType.s8, element_B=cl.DataType.s8, element_C=dd, element_D=dd,
            layout_A=rm, layout_B=cl.LayoutType.ColumnMajor, layout_C=rm,
            element_accumulator=cl.DataType.s32, cc=cc,
        )
        plan.epilogue_visitor = ev
        ks = {
            "pingpong": cl.KernelScheduleType.TmaWarpSpecializedPingpong,
            "cooperative": cl.KernelScheduleType.TmaWarpSpecializedCooperative,
            "streamk": cl.KernelScheduleType.TmaWarpSpecializedCooperative,
        }[cfg.kernel_schedule]
        es = {
            "tma": cl.EpilogueScheduleType.TmaWarpSpecialized,
            "tma_cooperative": cl.EpilogueScheduleType.TmaWarpSpecializedCooperative,
        }[cfg.epilogue]
        ts = cl.TileSchedulerType.StreamK if cfg.kernel_schedule == "streamk" else cl.TileSchedulerType.Default
        # cutlass_cppgen's TileDescription counts both pingpong consumers in M (it halves it)
        tm = cfg.tile_m * (2 if cfg.kernel_schedule == "pingpong" else 1)
        import copy

        # start from one of cutlass_cppgen's own sm90 s8 descriptions (it carries the math instruction)
        td = copy.copy(plan.tile_descriptions()[0])
        td.threadblock_shape = [tm, cfg.tile_n, cfg.tile_k]
        td.stages = cfg.stages or None
        td.cluster_shape = [cfg.cluster_m, cfg.cluster_n, 1]
        td.kernel_schedule, td.epilogue_schedule, td.tile_scheduler = ks, es, ts
        op = plan.construct(td, alignment_A=cfg.align_a, alignment_B=cfg.align_b, alignment_C=cfg.align_d)
        return op.rt_module.emit()
