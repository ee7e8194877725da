"""Config selection from ``gemm_configs/sm<arch>.json`` (package data, see :func:`config_dir`).

Schema (``schema: 1``)::

    {
      "schema": 1,
      "arch": "sm90",
      "default": {<GemmConfig fields>},        # documentation of the fallback rule's base
      "buckets": {
        "M4096_T128_D128_f16": {
          "config": {<GemmConfig fields>},
          "status": "tuned" | "untuned",
          "tops": 123.4 | null,                 # measured 2*M*N*K*L / time, 1e12/s (incl. epilogue)
          "time_us": 45.6 | null,
          "provenance": {"gpu": ..., "driver": ..., "cuda": ..., "nvidia_cutlass": ..., "torch": ...,
                         "date": "YYYY-MM-DD", "tool": "tools/tune_gemm.py"} | null
        }, ...
      }
    }

Bucket key: ``M<m>_T<t>_D<d>_<out>`` with ``m`` = M rounded up to a power of two and clamped to
[128, 16384] (query rows = chunk tokens x q heads per KV head), ``t`` = tile tokens = GEMM N (64 or
128), ``d`` = head_dim = GEMM K (64/128/256), ``out`` = score dtype (f16/f32).  The number of
batches L (KV heads x tiles) does not change the best tile much and is not part of the key.

Fallback (:func:`default_config`): cooperative 128 x T x min(D, 128), cluster 1x1 -- documented,
safe, never measured here.  A bucket that is missing, ``untuned``, or a file that is absent gives
the fallback/untuned config with a :class:`UntunedConfigWarning`.
"""
from __future__ import annotations

import functools
import json
import os
import re
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

from .config import GemmConfig, validate_for_problem

__all__ = ["UntunedConfigWarning", "bucket_key", "parse_bucket", "default_config", "gemm_depth", "select_config",
           "load_table", "config_dir", "M_BUCKETS", "T_BUCKETS", "D_BUCKETS", "OUT_BUCKETS", "untuned_table"]

CONFIG_ENV = "KVARN_CUTLASS_GEMM_CONFIGS"
M_BUCKETS = tuple(2 ** i for i in range(7, 15))  # 128 .. 16384
T_BUCKETS = (64, 128)
D_BUCKETS = (64, 128, 256)
OUT_BUCKETS = ("f16", "f32")


class UntunedConfigWarning(UserWarning):
    """The selected GEMM config was not measured on this architecture/bucket."""


def config_dir() -> Path:
    """``$KVARN_CUTLASS_GEMM_CONFIGS``, else the tables shipped in the package (``kvarn_cutlass/gemm_configs/``,
    package data: an installed wheel has them too; in a checkout ``gemm_configs/`` at the repository root
    links to the same directory, which ``kvarn-cutlass tune`` updates)."""
    env = os.environ.get(CONFIG_ENV, "").strip()
    if env:
        return Path(env)
    return Path(os.fspath(resources.files("kvarn_cutlass") / "gemm_configs"))


def m_bucket(M: int) -> int:
    b = 1 << max(0, int(M - 1).bit_length())
    return min(max(b, M_BUCKETS[0]), M_BUCKETS[-1])


def bucket_key(M: int, N: int, K: int, out_dtype: str) -> str:
    return f"M{m_bucket(M)}_T{N}_D{K}_{out_dtype}"


BUCKET_FORMAT = "M<rows>_T<tile tokens>_D<head_dim>_<f16|f32>"
_BUCKET_RE = re.compile(r"M(\d+)_T(\d+)_D(\d+)(?:_(\w+))?")


def parse_bucket(key: str, table_key: bool = True) -> tuple[int, int, int, str]:
    """``(M, T, D, out)`` of a bucket key such as ``M4096_T128_D128_f16``.

    ``table_key``: the key must name a bucket of the table (M one of :data:`M_BUCKETS`, the ``_<out>``
    suffix present); otherwise any M >= 1 is taken (a problem size, rounded to its bucket by
    :func:`select_config`) and a missing suffix means ``f16``.

    Raises:
        ValueError: the key is malformed, or names a head_dim, tile size, output dtype or M that the
            K-score GEMM does not support (the message says which and what is supported).
    """
    m = _BUCKET_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(f"expected a bucket {BUCKET_FORMAT}, e.g. M4096_T128_D128_f16, got {key!r}")
    M, T, D = (int(g) for g in m.groups()[:3])
    out = m.group(4)
    if out is None and table_key:
        raise ValueError(f"{key!r} lacks the output dtype: expected {BUCKET_FORMAT}, e.g. {key}_f16")
    out = out or "f16"
    if D not in D_BUCKETS:
        raise ValueError(f"{key!r}: head_dim {D} is not supported (the K-score GEMM takes head_dim {list(D_BUCKETS)})")
    if T not in T_BUCKETS:
        raise ValueError(f"{key!r}: tiles of {T} tokens are not supported "
                         f"(the presets' tile sizes are {list(T_BUCKETS)})")
    if out not in OUT_BUCKETS:
        raise ValueError(f"{key!r}: output dtype {out!r} is not supported (one of {list(OUT_BUCKETS)})")
    if M < 1:
        raise ValueError(f"{key!r}: M (query rows) must be >= 1")
    if table_key and M not in M_BUCKETS:
        raise ValueError(f"{key!r}: M{M} is not a bucket (M is a power of two from {M_BUCKETS[0]} to {M_BUCKETS[-1]}; "
                         f"M{M} falls into M{m_bucket(M)})")
    return M, T, D, out


def default_config(N: int, K: int, out_dtype: str) -> GemmConfig:
    """The documented fallback: cooperative, tile 128 x N x min(K, 128), cluster 1x1."""
    return GemmConfig(tile_m=128, tile_n=min(N, 128), tile_k=min(K, 128), cluster_m=1, cluster_n=1,
                      kernel_schedule="cooperative", out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _load(path: str, mtime: float) -> dict:
    with open(path) as f:
        table = json.load(f)
    if table.get("schema") != 1:
        raise ValueError(f"{path}: unsupported schema {table.get('schema')!r} (expected 1)")
    return table


def load_table(arch: int = 90) -> dict | None:
    path = config_dir() / f"sm{arch}.json"
    if not path.is_file():
        return None
    return _load(str(path), path.stat().st_mtime)


def gemm_depth(head_dim: int) -> int:
    """The K-score GEMM's depth K for a head_dim: 2 * D, the two-level fold's rows [hi ++ lo] against
    the codes [16(c-8) ++ (c-8)] (see gemm.prep). Buckets are keyed by head_dim; configs are
    validated (and tuned) against this K."""
    return 2 * head_dim


def select_config(arch: "int | str", M: int, N: int, head_dim: int, L: int = 1, out_dtype: str = "f16") -> GemmConfig:
    """Config for the K-score problem (M rows, N = T tokens per tile, head_dim D, L tiles) on ``arch``:
    the bucket's entry when it is valid for the GEMM (depth :func:`gemm_depth`), else the default;
    warns (``UntunedConfigWarning``) when untuned or falling back."""
    from ..runtime import normalize_arch

    cc = normalize_arch(arch)
    K = gemm_depth(head_dim)
    key = bucket_key(M, N, head_dim, out_dtype)
    table = load_table(cc)
    entry = (table or {}).get("buckets", {}).get(key)
    if entry is not None:
        cfg = GemmConfig.from_dict(entry["config"])
        ok, why = validate_for_problem(cfg, M, N, K, L)
        if ok:
            if entry.get("status") != "tuned":
                warnings.warn(f"GEMM config for sm{cc} bucket {key} is untuned ({cfg.name}); "
                              f"run `kvarn-cutlass tune` on the GPU", UntunedConfigWarning, stacklevel=2)
            return cfg
        reason = f"table entry {cfg.name} invalid for this problem: {why}"
    else:
        reason = "no gemm_configs table" if table is None else "bucket missing from the table"
    cfg = default_config(N, head_dim, out_dtype)
    warnings.warn(f"GEMM config for sm{cc} bucket {key}: {reason}; using the untuned default {cfg.name}",
                  UntunedConfigWarning, stacklevel=2)
    return cfg


def untuned_table(arch: int = 90) -> dict[str, Any]:
    """The committed table before tuning: every bucket holds the default config, marked untuned."""
    buckets = {}
    for m in M_BUCKETS:
        for t in T_BUCKETS:
            for d in D_BUCKETS:
                for o in OUT_BUCKETS:
                    buckets[f"M{m}_T{t}_D{d}_{o}"] = {
                        "config": default_config(t, d, o).to_dict(), "status": "untuned",
                        "tops": None, "time_us": None, "provenance": None,
                    }
    return {"schema": 1, "arch": f"sm{arch}", "default": default_config(128, 128, "f16").to_dict(),
            "note": "untuned defaults; no measurements. Regenerate with `kvarn-cutlass tune` on an sm_90 GPU.",
            "buckets": buckets}
