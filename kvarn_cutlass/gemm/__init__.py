"""CUTLASS int8 K-score GEMM for sm_90 (Hopper): emission, compilation, launch, config selection.

Concerns are kept apart the way cutlass_cppgen does it:

* :mod:`.compat`   -- make ``cutlass_cppgen`` (nvidia-cutlass 4.2) importable with cuda-bindings 13,
                      offline (no device queries, no files in the cwd).
* :mod:`.config`   -- ``GemmConfig`` and its validators (``(ok, reason)``).
* :mod:`.emit`     -- deterministic C++ source for a config (CUTLASS 3.x collective builders + EVT).
* :mod:`.compile`  -- nvcc -> cubin + host Params helper, cached on disk.
* :mod:`.launcher` -- ``KScoreGemm`` (prepared once, cheap ``run``) and the unpack/fold prep kernels.
* :mod:`.configs`  -- ``gemm_configs/sm90.json``: the tuned (or default) config per shape bucket.

Importing this package imports neither torch's CUDA state nor cutlass_cppgen.
"""
from .config import GemmConfig, validate_config, validate_for_problem
from .emit import emit_source, entry_name

__all__ = ["GemmConfig", "validate_config", "validate_for_problem", "emit_source", "entry_name"]
