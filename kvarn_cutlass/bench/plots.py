"""PNG plots of a benchmark record (see :mod:`kvarn_cutlass.bench.report` for the record layout).

* ``decode_b<batch>.png``: decode time per step vs context, KVarN (CUDA graph) against SDPA cuDNN on
  fp16 (eager, and replayed from a CUDA graph) and SDPA flash on fp16 (eager), one file per batch size
  in the record (log-log axes);
* ``prefill.png``: prefill time (attention and append) vs prompt length at head_dim 128, KVarN against SDPA fp16 and
  dequant+SDPA, one line style per chunk size;
* ``memory_per_token.png``: bytes per token (K+V, one KV head) of each preset against fp16, per head_dim.

matplotlib is optional (``pip install 'kvarn-cutlass[plots]'``) and imported only when drawing, through
its object API with the Agg canvas, so no global pyplot backend is set in the caller's process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import decode_rows, memory_rows, prefill_rows

__all__ = ["PLOTS_HINT", "PlotsUnavailable", "planned_plots", "write_plots"]

PLOTS_HINT = "pip install 'kvarn-cutlass[plots]'"
_DPI = 100
_SIZE = (6.4, 4.0)


class PlotsUnavailable(RuntimeError):
    """matplotlib is not importable; the message is the one-line notice for the user."""


def planned_plots(doc: dict[str, Any]) -> dict[str, list[str]]:
    """Plot group -> file names (without prefix) that :func:`write_plots` draws for ``doc``."""
    plans: dict[str, list[str]] = {}
    batches = sorted({r["batch"] for r in decode_rows(doc)})
    if batches:
        plans["decode"] = [f"decode_b{b}.png" for b in batches]
    if any(p.get("kvarn_e2e_ms") is not None for p in _prefill_plot_rows(doc)):
        plans["prefill"] = ["prefill.png"]
    plans["memory"] = ["memory_per_token.png"]
    return plans


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(f"plots skipped: matplotlib is not installed ({PLOTS_HINT})") from None
    fig = Figure(figsize=_SIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    # No "Software" tag: the files then change only when the data or the drawing does.
    fig.savefig(path, format="png", dpi=_DPI, metadata={"Software": None})
    return path


def _context_label(tokens: float, _pos: Any = None) -> str:
    return f"{tokens / 1024:g}k" if tokens >= 1024 else f"{tokens:g}"


def _plain_log_y(ax) -> None:
    """Log y axis labelled 20, 50, 100 rather than 2x10^1 (major and minor ticks)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if f"{v:g}"[0] in "25" else ""))


def _decode_plot(doc: dict[str, Any], batch: int, path: Path) -> Path:
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in decode_rows(doc) if r["batch"] == batch]
    fig = _figure()
    ax = fig.add_subplot()
    for key, label, style in (("graph_us", "KVarN (CUDA graph)", "o-"), ("sdpa_cudnn_us", "SDPA cuDNN, fp16 (eager)", "s--"),
                              ("sdpa_cudnn_graph_us", "SDPA cuDNN, fp16 (CUDA graph)", "s:"),
                              ("sdpa_flash_us", "SDPA flash, fp16 (eager)", "^--")):
        pts = [(r["context"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    shape = ((doc["sections"].get("decode") or {}).get("results") or {}).get("shape", {})
    ax.set_xscale("log", base=2)
    _plain_log_y(ax)
    ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time per decode step, one layer (µs)")
    ax.set_title(f"Decode, batch {batch}" + (f", {shape.get('num_q_heads')}q/{shape.get('num_kv_heads')}kv heads, "
                                              f"D={shape.get('head_dim')}, {shape.get('preset')}" if shape else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _prefill_plot_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefill points the plot draws: head_dim 128."""
    return [p for p in prefill_rows(doc) if p.get("head_dim") == 128]


def _prefill_plot(doc: dict[str, Any], path: Path) -> Path:
    from matplotlib.ticker import FuncFormatter

    rows = _prefill_plot_rows(doc)
    fig = _figure()
    ax = fig.add_subplot()
    styles = ("-", "--", ":", "-.")
    for i, chunk in enumerate(sorted({p.get("C") for p in rows})):
        pts = sorted((p for p in rows if p.get("C") == chunk), key=lambda p: p.get("P", 0))
        for key, label, color, marker in (("kvarn_e2e_ms", "KVarN", "C0", "o"), ("sdpa_flash_e2e_ms", "SDPA flash fp16", "C1", "s"),
                                          ("dequant_sdpa_e2e_ms", "dequant + SDPA", "C2", "^")):
            xy = [(p["P"], p[key]) for p in pts if isinstance(p.get(key), (int, float))]
            if xy:
                ax.plot(*zip(*xy), color=color, marker=marker, linestyle=styles[i % len(styles)],
                        label=f"{label}, chunk {chunk}")
    ax.set_xscale("log", base=2)
    _plain_log_y(ax)
    ax.xaxis.set_major_formatter(FuncFormatter(_context_label))
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill time of the prompt, one layer (ms)")
    ax.set_title("Chunked prefill, head_dim 128")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _memory_plot(path: Path) -> Path:
    rows = memory_rows()
    dims = sorted({r["head_dim"] for r in rows})
    names = ["fp16"] + list(dict.fromkeys(r["preset"] for r in rows))
    fig = _figure()
    ax = fig.add_subplot()
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [4 * d if name == "fp16" else next(r["bytes_per_token"] for r in rows
                                                  if r["preset"] == name and r["head_dim"] == d) for d in dims]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(dims))]
        bars = ax.bar(xs, vals, width, label=name, color="0.6" if name == "fp16" else f"C{i - 1}")
        if name != "fp16":
            ax.bar_label(bars, labels=[f"{4 * d / v:.1f}x" for d, v in zip(dims, vals)], fontsize=7)
    ax.set_xticks(range(len(dims)), [f"head_dim {d}" for d in dims])
    ax.set_ylabel("bytes per token, K+V of one KV head")
    ax.set_title("Memory per token against fp16 (labels: fp16 / KVarN)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def write_plots(doc: dict[str, Any], out_dir: str | os.PathLike, prefix: str = "") -> dict[str, list[Path]]:
    """Draw the plots :func:`planned_plots` names into ``out_dir`` (created) as ``<prefix><name>``.

    Returns:
        plot group -> paths written.

    Raises:
        PlotsUnavailable: matplotlib is not importable (nothing written).
    """
    _figure()  # fail before creating anything when matplotlib is absent
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    for group, names in planned_plots(doc).items():
        for name in names:
            path = out / f"{prefix}{name}"
            if group == "decode":
                _decode_plot(doc, int(name[len("decode_b"):-len(".png")]), path)
            elif group == "prefill":
                _prefill_plot(doc, path)
            else:
                _memory_plot(path)
            written.setdefault(group, []).append(path)
    return written
