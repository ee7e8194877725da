"""Benchmark reports: markdown tables from a benchmark record, side by side with the baselines.

Input is a record in the layout of :mod:`kvarn_cutlass.bench.record` (``docs/benchmarks/<gpu>.json``,
or the ``results.json`` that ``kvarn-cutlass bench`` writes)::

    {"sections": {"<section>": {"provenance": {...}, "results": {...}}, ...}}

The renderer reads the sections' own result structures (``decode.rows``, ``prefill.points``,
``compress.compress``, ...) and shows stored numbers as stored; derived columns
(ratios, percentages, MiB) are computed from the stored values shown beside them. Missing fields
show as ``-``, so older or ``--quick`` records render too. Memory per token comes from
:class:`kvarn_cutlass.format.TileSpec` (no GPU needed).

Plots are drawn by :mod:`kvarn_cutlass.bench.plots`; :func:`render_markdown` links the ones
:func:`kvarn_cutlass.bench.plots.planned_plots` names for the record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "SECTION_ORDER", "load_record", "memory_rows", "prefill_rows", "decode_rows",
    "render_markdown", "write_report", "docs_page_markdown", "write_docs_page",
]

# Sections in report (and default run) order: the copy ceiling first, as the decode rows refer to it. A record's
# other sections (e.g. ``gemm`` of the CUTLASS K-score GEMM, which the fused prefill replaced) are named, not
# tabulated.
SECTION_ORDER: tuple[str, ...] = ("copy", "compress", "append", "prefill", "decode", "launch")

MISSING = "-"


def load_record(path: str | os.PathLike) -> dict[str, Any]:
    """Read a benchmark record (``results.json`` or ``docs/benchmarks/<gpu>.json``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not JSON, or not a record (no ``sections`` object of ``{"results": ...}`` entries).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON ({e})") from None
    sections = doc.get("sections") if isinstance(doc, dict) else None
    if not isinstance(sections, dict) or not all(isinstance(s, dict) and "results" in s for s in sections.values()):
        raise ValueError(f"{p} is not a benchmark record (expected {{\"sections\": {{name: {{\"results\": ...}}}}}})")
    return doc


def _results(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    entry = doc["sections"].get(name)
    return entry.get("results") if isinstance(entry, dict) else None


def _fmt(value: Any) -> str:
    """A stored value as shown in a table: ints in full, floats with their stored digits, None as '-'."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e6 else format(value, "g")
    return str(value)


def _ratio(num: Any, den: Any, digits: int = 2) -> str:
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or den == 0:
        return MISSING
    return f"{num / den:.{digits}f}"


def _percent(fraction: Any) -> str:
    """A fraction as a percentage with one decimal; MISSING when it is not a number."""
    return f"{100 * fraction:.1f}" if isinstance(fraction, (int, float)) else MISSING


def _mib(nbytes: Any) -> str:
    return f"{nbytes / 2**20:.1f}" if isinstance(nbytes, (int, float)) else MISSING


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns (labels) align left, the others (numbers) right."""
    align = [":---" if i < left else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# --- rows shared by the tables and the plots ---------------------------------------------------------------------


def decode_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The decode section's rows sorted by (batch, context); [] when the record has none."""
    res = _results(doc, "decode") or {}
    rows = [r for r in res.get("rows", []) if isinstance(r, dict) and "batch" in r and "context" in r]
    return sorted(rows, key=lambda r: (r["batch"], r["context"]))


def prefill_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Prefill points sorted by (head_dim, C, P)."""
    res = _results(doc, "prefill") or {}
    rows = [p for p in res.get("points", []) if isinstance(p, dict)]
    return sorted(rows, key=lambda p: (p.get("head_dim", 0), p.get("C", 0), p.get("P", 0)))


def memory_rows(head_dims: Sequence[int] = (64, 128, 256)) -> list[dict[str, Any]]:
    """Bytes per token (K and V of one KV head) of every preset at ``head_dims`` against fp16 K+V.

    From :class:`kvarn_cutlass.format.TileSpec` with float16 scales: ``record_bytes`` for one tile of
    ``tile_tokens`` tokens, ``bytes_per_token`` = record / tokens, ``fp16_bytes_per_token`` = 2 * 2 * D.
    """
    from ..format import PRESETS, TileSpec

    rows = []
    for preset in PRESETS:
        for d in head_dims:
            spec = TileSpec(preset=preset, head_dim=d)
            rows.append({"preset": preset, "head_dim": d, "tile_tokens": spec.tile_tokens,
                         "record_bytes": spec.tile_nbytes, "bytes_per_token": spec.bytes_per_token,
                         "fp16_bytes_per_token": 4 * d})
    return rows


# --- section renderers ---------------------------------------------------------------------------------------------


def _provenance_block(doc: dict[str, Any]) -> str:
    provs = {n: (doc["sections"][n].get("provenance") or {}) for n in _ordered(doc)}
    first = next((p for p in provs.values() if p.get("gpu")), {})
    lines = []
    if first:
        lines.append(
            f"GPU: {first.get('gpu', '?')} (compute capability {first.get('compute_capability', '?')}, "
            f"{first.get('sm_count', '?')} SMs, {first.get('memory_gib', '?')} GiB), driver {first.get('driver', '?')}, "
            f"CUDA {first.get('cuda', '?')}, torch {first.get('torch', '?')}, Python {first.get('python', '?')}, "
            f"kvarn-cutlass {first.get('kvarn_cutlass', '?')}.")
        lines.append("")
    lines.append(_table(["section", "measured (UTC)", "git commit", "GPU"],
                        [[n, _fmt(p.get("date")), _fmt(p.get("git_commit")), _fmt(p.get("gpu"))]
                         for n, p in provs.items()]))
    return "\n".join(lines)


def _decode_md(doc: dict[str, Any], images: list[str]) -> str | None:
    res = _results(doc, "decode")
    rows = decode_rows(doc)
    if res is None or not rows:
        return None
    shape = res.get("shape", {})
    out = ["## Decode", ""]
    if shape:
        out.append(f"One decode step, one layer: {shape.get('num_q_heads', '?')} query / {shape.get('num_kv_heads', '?')} "
                   f"KV heads, head_dim {shape.get('head_dim', '?')}, preset {shape.get('preset', '?')}, "
                   f"fp16 window {shape.get('window', '?')} tokens. Baselines: SDPA (cuDNN and flash backends) "
                   "on an fp16 cache of the same context.")
    if res.get("method"):
        out.append(f"Method: {res['method']}.")
    out.append("")
    out += [f"![{Path(i).stem}]({i})" for i in images]
    if images:
        out.append("")
    out.append(_table(
        ["batch", "context", "KVarN graph µs", "KVarN eager µs", "SDPA cuDNN µs", "SDPA flash µs",
         "cuDNN / KVarN", "flash / KVarN", "KVarN GB/s", "% of copy ceiling", "KVarN MiB", "fp16 MiB",
         "SDPA cuDNN graph µs", "cuDNN graph / KVarN"],
        [[_fmt(r["batch"]), _fmt(r["context"]), _fmt(r.get("graph_us")), _fmt(r.get("eager_us")),
          _fmt(r.get("sdpa_cudnn_us")), _fmt(r.get("sdpa_flash_us")),
          _ratio(r.get("sdpa_cudnn_us"), r.get("graph_us")), _ratio(r.get("sdpa_flash_us"), r.get("graph_us")),
          _fmt(r.get("gb_per_s_graph")),
          _percent(r.get("fraction_of_copy_ceiling")),
          _mib(r.get("kvarn_bytes")), _mib(r.get("fp16_bytes")),
          _fmt(r.get("sdpa_cudnn_graph_us")), _ratio(r.get("sdpa_cudnn_graph_us"), r.get("graph_us"))] for r in rows],
        left=0))
    out.append("")
    out.append("Ratios above 1: KVarN is faster. SDPA columns without \"graph\" are eager calls (at batch 1 bound "
               "by host launch time); \"graph\" columns replay SDPA from a CUDA graph, like KVarN graph. Copy ceiling: "
               f"{_fmt(res.get('copy_ceiling_gb_per_s'))} GB/s (device copy bandwidth); KVarN GB/s counts the "
               "compressed bytes it reads.")
    lloyd = [r for r in res.get("lloyd_max_rows", []) if isinstance(r, dict)]
    if lloyd:
        out += ["", "Lloyd-Max quantizer (`quantizer=\"lloyd_max\"`: codes looked up in the codebook), same shapes:", ""]
        out.append(_table(
            ["quantizer", "batch", "context", "Lloyd-Max graph µs", "uniform graph µs", "Lloyd-Max / uniform",
             "% of copy ceiling"],
            [["lloyd_max", _fmt(r.get("batch")), _fmt(r.get("context")), _fmt(r.get("graph_us")), _fmt(r.get("uniform_graph_us")),
              _fmt(r.get("time_vs_uniform")),
              _percent(r.get("fraction_of_copy_ceiling"))] for r in lloyd], left=1))
    bars = res.get("bars")
    if isinstance(bars, dict) and bars:
        out.append("")
        out.append("Targets: " + "; ".join(f"{k}: {'met' if v else 'not met'}" for k, v in sorted(bars.items())) + ".")
    return "\n".join(out)


def _prefill_md(doc: dict[str, Any], images: list[str]) -> str | None:
    res = _results(doc, "prefill")
    rows = prefill_rows(doc)
    if res is None or not rows:
        return None
    out = ["## Prefill", ""]
    if res.get("workload"):
        out.append(f"Workload: {res['workload']}. Baselines, timed the same way: SDPA over a static fp16 cache "
                   "(chunk copied in), and `kc.dequantize_layer` (one kernel for the layer's tiles) then flash SDPA."
                   + (f" Timing: {res['timing']}." if res.get("timing") else ""))
        out.append("")
    out += [f"![{Path(i).stem}]({i})" for i in images]
    if images:
        out.append("")
    out.append(_table(
        ["prompt P", "chunk C", "head_dim", "KVarN ms", "append ms", "SDPA flash ms", "SDPA cuDNN ms",
         "dequant+SDPA ms", "KVarN / SDPA flash", "KVarN / dequant+SDPA", "KVarN TFLOPS-eq", "% of matmul peak"],
        [[_fmt(p.get("P")), _fmt(p.get("C")), _fmt(p.get("head_dim")), _fmt(p.get("kvarn_e2e_ms")),
          _fmt(p.get("append_ms")), _fmt(p.get("sdpa_flash_e2e_ms")), _fmt(p.get("sdpa_cudnn_e2e_ms")),
          _fmt(p.get("dequant_sdpa_e2e_ms")), _ratio(p.get("kvarn_e2e_ms"), p.get("sdpa_flash_e2e_ms")),
          _ratio(p.get("kvarn_e2e_ms"), p.get("dequant_sdpa_e2e_ms")), _fmt(p.get("tflops_eq_kvarn")),
          _percent(p.get("kvarn_fraction_of_matmul_peak"))] for p in rows], left=0))
    out.append("")
    out.append("Ratios above 1: KVarN is slower than that baseline. TFLOPS-equivalent: 4 * Hq * D * P^2 / 2 over the "
               f"KVarN time; matmul peak: fp16 8192^3 in the same run ({_fmt(res.get('matmul_f16_8192_tflops'))} TFLOPS).")
    peak = res.get("peak_memory_32k")
    if isinstance(peak, dict):
        out += ["", f"Peak extra memory, prompt {_fmt(peak.get('P'))} in chunks of {_fmt(peak.get('C'))}: "
                    f"{_mib(peak.get('peak_extra_bytes'))} MiB."]
    return "\n".join(out)


def _compress_md(doc: dict[str, Any]) -> str | None:
    res = _results(doc, "compress")
    if res is None:
        return None
    out = ["## Compression", ""]
    if res.get("method"):
        out += [f"Method: {res['method']}.", ""]
    rows = [r for r in res.get("compress", []) if isinstance(r, dict)]
    out.append("Per layer (all KV heads of one layer, one tile each):")
    out.append("")
    out.append(_table(["preset", "quantizer", "head_dim", "batch", "KV heads", "tiles", "graph µs", "eager µs",
                       "checked µs", "GB/s", "tiles/s"],
                      [[_fmt(r.get("preset")), _fmt(r.get("quantizer", "uniform")), _fmt(r.get("head_dim")), _fmt(r.get("batch")), _fmt(r.get("kv_heads")),
                        _fmt(r.get("records")), _fmt(r.get("graph_us")), _fmt(r.get("eager_us")),
                        _fmt(r.get("checked_us")), _fmt(r.get("gb_per_s")), _fmt(r.get("tiles_per_s"))] for r in rows],
                      left=2))
    if res.get("target_us_per_layer") is not None:
        out += ["", f"Target: {_fmt(res['target_us_per_layer'])} µs per layer."]
    rot = [r for r in res.get("rotate", []) if isinstance(r, dict)]
    if rot:
        out += ["", "Row Walsh-Hadamard rotation kernel:", ""]
        out.append(_table(["rows", "head_dim", "output", "graph µs", "GB/s"],
                          [[_fmt(r.get("rows")), _fmt(r.get("head_dim")), _fmt(r.get("out")), _fmt(r.get("graph_us")),
                            _fmt(r.get("gb_per_s"))] for r in rot], left=0))
    return "\n".join(out)


def _append_md(doc: dict[str, Any]) -> str | None:
    res = _results(doc, "append")
    pre = (_results(doc, "compress") or {}).get("prefill_compress")
    if res is None and not isinstance(pre, dict):
        return None
    out = ["## Cache writes", ""]
    if res is not None:
        if res.get("method"):
            out += [f"Method: {res['method']}.", ""]
        rows = [r for r in res.get("rows", []) if isinstance(r, dict)]
        out.append("One-token `append` per layer (8 KV heads, head_dim 128, window 256):")
        out.append("")
        out.append(_table(["batch", "GPU µs", "host µs", "GPU µs (128, amortized)", "host µs (128, amortized)",
                           "checked µs", "static fp16 GPU µs", "static fp16 host µs"],
                          [[_fmt(r.get(k)) for k in ("batch", "gpu_us", "host_us", "amortized_gpu_us", "amortized_host_us",
                                                      "checked_us", "static_fp16_gpu_us", "static_fp16_host_us")]
                           for r in rows], left=1))
        targets = res.get("targets") or {}
        if targets:
            out += ["", "Targets at batch 1: " + ", ".join(f"{k} <= {_fmt(v)}" for k, v in sorted(targets.items())) + "."]
    if isinstance(pre, dict):
        out += ["", f"Appends of a {_fmt(pre.get('prompt_tokens'))}-token prompt in {_fmt(pre.get('chunk_tokens'))}-token "
                    f"chunks: {_fmt(pre.get('prefill_compress_ms'))} ms on the stream (GPU alone {_fmt(pre.get('gpu_ms'))} "
                    f"ms, host {_fmt(pre.get('host_ms'))} ms; target {_fmt(pre.get('target_ms'))} ms)."]
    return "\n".join(out)


def _memory_md(images: list[str]) -> str:
    out = ["## Memory per token", "",
           "K and V of one token of one KV head, from the tile record layout (`kvarn_cutlass.format.TileSpec`, "
           "float16 scales); a layer holds this times its KV heads.", ""]
    out += [f"![{Path(i).stem}]({i})" for i in images]
    if images:
        out.append("")
    out.append(_table(["preset", "head_dim", "tokens per tile", "record bytes", "bytes / token", "fp16 bytes / token",
                       "fp16 / KVarN"],
                      [[r["preset"], str(r["head_dim"]), str(r["tile_tokens"]), str(r["record_bytes"]),
                        format(r["bytes_per_token"], "g"), str(r["fp16_bytes_per_token"]),
                        _ratio(r["fp16_bytes_per_token"], r["bytes_per_token"])] for r in memory_rows()]))
    return "\n".join(out)


def _copy_launch_md(doc: dict[str, Any]) -> str | None:
    copy, launch = _results(doc, "copy"), _results(doc, "launch")
    if copy is None and launch is None:
        return None
    out = ["## Copy ceiling and launch overhead", ""]
    if copy is not None:
        out.append(f"Device copy: peak {_fmt(copy.get('peak_gb_per_s'))} GB/s ({copy.get('method', '')}).")
        sizes = [s for s in copy.get("sizes", []) if isinstance(s, dict)]
        if sizes:
            out += ["", _table(["MiB", "median µs", "GB/s"],
                               [[_mib(s.get("bytes")), _fmt((s.get("timing") or {}).get("median_us")),
                                 _fmt(s.get("gb_per_s"))] for s in sizes], left=0)]
        out.append("")
    if launch is not None:
        out.append(f"Host time per launch: prepared {_fmt(launch.get('prepared_launch_us'))} µs, kernel object "
                   f"{_fmt(launch.get('kernel_launch_us'))} µs, torch add {_fmt(launch.get('torch_add_us'))} µs; "
                   f"GPU time per launch in a CUDA graph {_fmt((launch.get('graph_gpu_us') or {}).get('median_us'))} µs.")
    return "\n".join(out).rstrip()


def ordered_sections(names: Iterable[str]) -> list[str]:
    """Section names in report order: those of SECTION_ORDER in its order, then the others sorted."""
    names = list(names)
    return [n for n in SECTION_ORDER if n in names] + sorted(n for n in names if n not in SECTION_ORDER)


def _ordered(doc: dict[str, Any]) -> list[str]:
    return ordered_sections(doc["sections"])


def render_markdown(doc: dict[str, Any], images: dict[str, list[str]] | None = None,
                    title: str = "KVarN benchmark results", intro: str = "") -> str:
    """The report of a record as markdown.

    Args:
        doc: a record (see :func:`load_record`).
        images: plot group (``decode``, ``prefill``, ``memory``) -> image paths to link, as the
            markdown file sees them; ``None`` or a missing group links none.
        title: the page's first heading.
        intro: markdown placed under the title (e.g. how to reproduce).
    """
    images = images or {}
    parts = [f"# {title}"]
    if intro:
        parts.append(intro.strip())
    parts.append(_provenance_block(doc))
    for md in (_decode_md(doc, images.get("decode", [])), _prefill_md(doc, images.get("prefill", [])),
               _compress_md(doc), _append_md(doc),
               _memory_md(images.get("memory", [])),
               _copy_launch_md(doc)):
        if md:
            parts.append(md)
    others = [n for n in _ordered(doc) if n not in SECTION_ORDER]
    if others:
        parts.append("Other sections in the record (not tabulated): " + ", ".join(others) + ".")
    return "\n\n".join(parts) + "\n"


def write_report(doc: dict[str, Any], out_dir: str | os.PathLike, plots: bool = True, prefix: str = "",
                 md_name: str = "results.md", title: str = "KVarN benchmark results", intro: str = "",
                 image_dir: str = "") -> tuple[list[Path], str | None]:
    """Write ``<out_dir>/<md_name>`` and, when ``plots`` and matplotlib allow, the PNG plots.

    Args:
        doc: a record (see :func:`load_record`).
        out_dir: folder of the markdown file and the plots (created).
        plots: draw the plots; without matplotlib they are skipped with a notice.
        prefix: file-name prefix of the plots (e.g. ``"h200-"``).
        md_name: name of the markdown file in ``out_dir``; a path relative to ``out_dir`` is allowed.
        title, intro: see :func:`render_markdown`.
        image_dir: folder of the plots relative to ``out_dir`` (the markdown links through it).

    Returns:
        (paths written, a one-line notice when plots were skipped else None).
    """
    from .plots import PlotsUnavailable, write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notice = None
    images: dict[str, list[str]] = {}
    if plots:
        try:
            drawn = write_plots(doc, out / image_dir, prefix=prefix)
        except PlotsUnavailable as e:
            notice = str(e)
        else:
            for group, paths in drawn.items():
                images[group] = [(Path(image_dir) / p.name).as_posix() for p in paths]
                written += paths
    md_path = out / md_name
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(render_markdown(doc, images, title=title, intro=intro))
    written.insert(0, md_path)
    return written, notice


# --- the docs page (docs/benchmarks.md) ----------------------------------------------------------------------------

DOCS_PLOT_DIR = "benchmarks"


def _measured_dates(doc: dict[str, Any]) -> str:
    dates = sorted({str(s.get("provenance", {}).get("date", ""))[:10] for s in doc["sections"].values()} - {""})
    if not dates:
        return "unknown date"
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def docs_page_markdown(doc: dict[str, Any], slug: str) -> str:
    """``docs/benchmarks.md`` for the record ``docs/benchmarks/<slug>.json``, linking the plots
    ``docs/benchmarks/<slug>-<name>.png`` that :func:`write_docs_page` draws."""
    from .plots import planned_plots

    gpu = next((s.get("provenance", {}).get("gpu") for s in doc["sections"].values()
                if s.get("provenance", {}).get("gpu")), slug)
    intro = f"""Latest results of `kvarn-cutlass bench` on an {gpu}, measured {_measured_dates(doc)} (UTC; the date and
commit of each section are in the table below). Generated from
[`{DOCS_PLOT_DIR}/{slug}.json`]({DOCS_PLOT_DIR}/{slug}.json) by `python3 tools/benchmarks_doc.py`; do not edit by hand.

How to reproduce, on a machine with an H200 (or another sm_90 GPU):

```bash
pip install -e ".[plots]"
kvarn-cutlass bench --out DIR        # every section; DIR/results.json, results.md and the plots;
                                     # also merges into docs/benchmarks/<gpu>.json
kvarn-cutlass bench --section decode --out DIR   # one section
```

On the project's GPU machine (no network) `tools/gpu_check.sh all` runs the GPU tests and then every
section (`GPU_BENCH_OUT=DIR` keeps the tables and plots, packed into `bench-results.tgz`). Without a GPU,
`kvarn-cutlass bench --from-json docs/benchmarks/{slug}.json --out DIR` re-renders the tables and plots,
and `python3 tools/benchmarks_doc.py` this page."""
    images = {group: [f"{DOCS_PLOT_DIR}/{slug}-{name}" for name in names] for group, names in planned_plots(doc).items()}
    return render_markdown(doc, images, title=f"Benchmarks: {gpu}", intro=intro)


def write_docs_page(record: str | os.PathLike, docs_dir: str | os.PathLike) -> list[Path]:
    """Write ``<docs_dir>/benchmarks.md`` and its plots ``<docs_dir>/benchmarks/<slug>-*.png`` for ``record``
    (``<slug>`` = the record's file stem, e.g. ``h200``).

    Raises:
        PlotsUnavailable: matplotlib is not importable (the page links the plots, so it is not written).
    """
    from .plots import write_plots

    doc = load_record(record)
    slug = Path(record).stem
    drawn = write_plots(doc, Path(docs_dir) / DOCS_PLOT_DIR, prefix=f"{slug}-")
    page = Path(docs_dir) / "benchmarks.md"
    page.write_text(docs_page_markdown(doc, slug))
    return [page] + [p for paths in drawn.values() for p in paths]
