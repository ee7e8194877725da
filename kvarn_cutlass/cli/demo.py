"""``kvarn-cutlass demo``: the main job on a fresh machine, with no arguments.

Builds a KVarN cache from realistic K/V, prefills it in chunks and decodes a few tokens, then
reports:

* accuracy: the attention outputs against float64 attention over the unquantized fp16 K/V (the
  quantization error), and the kernels against ``kvarn_cutlass.reference`` (float64) over the same
  quantized cache (the kernels' own error), with the share of attention that falls on quantized
  tokens (the rest reads the exact fp16 window);
* memory: the cache's bytes against an fp16 cache of the same tokens;
* speed (CUDA): decode step (CUDA-graph replay, the product path, and eager) and the whole chunked
  prefill against torch SDPA over an fp16 cache; CUDA events, warm-up, median.

K/V/Q come from a built-in generator (post-RoPE keys with outlier channels, a positional component
that RoPE turns into recency bias, queries that retrieve recent and distant keys by content; its
attention statistics are close to those of a trained model's: ~80% of the mass on the newest 256
tokens, top key ~0.3) or, with ``--model DIR``, from every attention layer of a transformers model
run over a text (default: this package's own Python sources).

On CUDA the cache compresses on the GPU, prefill runs ``kvarn_cutlass.prefill_attention`` (the fused
kernel) and decode ``kvarn_cutlass.DecodeGraph`` (split-tile kernels in a CUDA graph).
On a CPU-only machine the same pipeline runs through the CPU paths (prefill's torch path,
float64 reference decode), and the CUTLASS K-score GEMM is emitted and compiled for sm_90 with nvcc
(when present) in a background process meanwhile, or read from the kernel cache when an earlier
run built it. A cold compile took 31 s on a free core of a 2-core machine, and longer on busy cores,
so the demo waits for it only until it has run ``--budget`` seconds: then it reports and exits, and
the build goes on in the background (its own session: a closed terminal does not stop it) into the
kernel cache, where the next run finds it. ``--budget 0`` waits for it; ^C or SIGTERM before the
report stops it with the compilers it started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..presets import PRESETS
from .argtypes import (existing_dir, existing_file, int_at_least, non_negative_float, positive_int, read_text_file,
                       resolve_device)

NAME = "demo"
DEFAULT_BUDGET_S = 50.0
CPU_TOKENS, GPU_TOKENS = 2048, 32768
CPU_HEADS, GPU_HEADS = (8, 2), (32, 8)  # (q, KV): kvarn-ref-lm's on CPU (fast), Qwen3-8B's on CUDA
HEAD_DIM = 128
ROPE_THETA = 1e6


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="end-to-end demo: quantized cache, prefill, decode, accuracy, memory, speed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda if torch sees a CUDA device, else cpu")
    p.add_argument("--model", type=existing_dir, default=None, metavar="DIR",
                   help="take Q/K/V from every attention layer of this transformers model instead of the generator")
    p.add_argument("--text", type=existing_file, default=None, metavar="FILE",
                   help="with --model: UTF-8 text to run through it (default: this package's Python sources)")
    p.add_argument("--tokens", type=int_at_least(2), default=None,
                   help=f"context length (default {CPU_TOKENS} on CPU, {GPU_TOKENS} on CUDA; with --model at most "
                        "its max_position_embeddings)")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size (default 512)")
    p.add_argument("--decode-steps", type=positive_int, default=4, help="tokens decoded after the prefill (default 4)")
    p.add_argument("--preset", choices=tuple(PRESETS), default="k4v2_g128", help="tile preset (default k4v2_g128)")
    p.add_argument("--window", type=positive_int, default=256,
                   help="fp16 window in tokens, a multiple of the tile size (default 256)")
    p.add_argument("--no-compile", action="store_true", help="CPU: skip compiling the CUTLASS GEMM for sm_90")
    p.add_argument("--budget", type=non_negative_float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help=f"CPU: stop waiting for the CUTLASS compile when the demo has run this long and leave it "
                        f"compiling in the background (default {DEFAULT_BUDGET_S:g}; 0 = wait until it finishes)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON document")
    return p


# --- inputs ---------------------------------------------------------------------------------------
def rope(x, positions, theta: float = ROPE_THETA):
    """Rotary embedding of x [..., n, D] (float32) at integer ``positions`` [n], pairs (2i, 2i+1)."""
    import torch

    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.to(torch.float64)[:, None] * inv_freq
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


def realistic_qkv(num_q_heads: int, num_kv_heads: int, n: int, head_dim: int, generator):
    """Post-RoPE q [1, Hq, n, D], k, v [1, Hkv, n, D] float32 with a trained model's attention structure.

    Pre-RoPE keys are a per-head positional vector (in the high- and mid-frequency rotary pairs) plus
    per-token content (with 1/16 of the channels 4x larger: outlier channels). Queries carry the same
    positional vector, which RoPE turns into a score that is largest at distance 0 and decays with
    distance (recency bias), plus the content of a target key in the low-frequency pairs, which RoPE
    hardly rotates over the context (content retrieval): 70% of the targets are among the 63 previous
    tokens, 30% anywhere before. Values: Gaussian with a small per-head offset. Constants chosen so
    that, at n = 2048, the newest 256 tokens get ~0.8 of the attention and the top key ~0.3, |q| and
    |k| ~ 12-15, as in kvarn-ref-lm's layers 1-5 over code (layer 0 is flatter).
    """
    import torch

    g, D, P = generator, head_dim, head_dim // 2
    group = num_q_heads // num_kv_heads
    content_pairs = torch.arange(P) >= int(0.6 * P)  # the 40% lowest-frequency pairs
    content_chan = content_pairs.repeat_interleave(2)
    chan_scale = torch.ones(D)
    chan_scale[torch.randperm(D, generator=g)[: max(1, D // 16)]] = 4.0
    content = 0.5 * torch.randn(1, num_kv_heads, n, D, generator=g) * chan_scale
    positional = 1.2 * torch.randn(1, num_kv_heads, 1, D, generator=g) * ~content_chan
    pos = torch.arange(n)
    recent = (pos - torch.randint(1, 64, (n,), generator=g)).clamp_min(0)
    anywhere = (torch.rand(n, generator=g) * (pos + 1)).long()
    target = torch.where(torch.rand(n, generator=g) < 0.3, anywhere, recent)
    q_pre = (positional + 2.0 * content[:, :, target] * content_chan).repeat_interleave(group, 1)
    q_pre = q_pre + 0.5 * torch.randn(1, num_q_heads, n, D, generator=g)
    k = rope(positional + content, pos)
    q = rope(q_pre, pos)
    v = torch.randn(1, num_kv_heads, n, D, generator=g) + 0.3 * torch.randn(1, num_kv_heads, 1, D, generator=g)
    return q, k, v


def _package_text() -> str:
    """This package's Python sources, concatenated in a fixed order (real code, always installed)."""
    root = Path(__file__).resolve().parents[1]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))


def model_qkv(model_dir: str, n: int | None, text: str | None, device: str):
    """Q/K/V of every attention layer of a transformers model over ``text``'s first n tokens.

    Returns (layers, n, info): layers is a list of (q [1, Hq, n, D], k, v [1, Hkv, n, D] float32 on
    the CPU, post-RoPE, softmax scale), captured through a registered attention function.
    """
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    body = _package_text() if text is None else read_text_file(text, "--text")  # a bad file fails before loading
    config = AutoConfig.from_pretrained(model_dir)
    max_pos = getattr(config, "max_position_embeddings", None)
    if n is None:
        n = min(CPU_TOKENS if device == "cpu" else GPU_TOKENS, max_pos or GPU_TOKENS)
    elif max_pos and n > max_pos:
        raise ValueError(f"--tokens {n} exceeds the model's max_position_embeddings {max_pos}")
    captured: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        captured[module.layer_idx] = (query.detach().float().cpu(), key.detach().float().cpu(),
                                      value.detach().float().cpu(), float(scale))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvarn_demo_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kvarn_demo_capture")
    model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):  # no tokenizer files: random ids still give the model's K/V statistics
        tokenizer = None
    if tokenizer is not None:
        source = "the kvarn_cutlass package's Python sources" if text is None else text
        ids = tokenizer(body, add_special_tokens=False, return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] < n:
            raise ValueError(f"the text gives {ids.shape[1]} tokens, fewer than --tokens {n}")
    else:
        source = "random token ids (the model directory has no tokenizer)"
        ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids.to(device), use_cache=False, logits_to_keep=1)
    layers = [captured[i] for i in sorted(captured)]
    return layers, n, {"model": model_dir, "text": source, "layers": len(layers)}


# --- accuracy ---------------------------------------------------------------------------------------
def exact_attention(q, k, v, scale: float):
    """Float64 causal attention of the newest n_q queries q [B, Hq, n_q, D] over k, v [B, Hkv, L, D]
    (GQA), on q's device. Returns (out [B, Hq, n_q, D], probabilities [B, Hq, n_q, L]) in float64."""
    import torch

    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    n_q, L = q.shape[2], k.shape[2]
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    future = torch.arange(L, device=k.device)[None, :] > torch.arange(L - n_q, L, device=k.device)[:, None]
    p = torch.softmax(s.masked_fill(future, -math.inf), -1)
    return p @ v, p


def rel_error(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.to(a.device).double()
    return float((a - b).norm() / b.norm())


def _quantized_mass(p, cache, layer: int) -> float:
    """Mean share of attention probability p [..., L] on the tokens ``cache`` holds as tiles."""
    lo, hi = cache.positions(layer)["tiles"]
    return float(p[..., lo:hi].sum(-1).mean())


# --- the CUTLASS compile in a child process (CPU machines) ---------------------------------------------
_CHILD = "import sys; from kvarn_cutlass.cli.demo import _child_main; _child_main(sys.argv[1], sys.argv[2])"


def demo_gemm_config(chunk: int, group: int):
    """The K-score GEMM config prefill would use on sm_90 for a ``chunk``-token chunk and GQA ``group``
    (rows M = chunk x group per KV head, tiles of 128 tokens, head_dim 128, f16 scores)."""
    import warnings

    from ..gemm.configs import select_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untuned bucket falls back to the default config
        return select_config(90, M=chunk * group, N=128, head_dim=HEAD_DIM, L=1, out_dtype="f16")


def _child_main(config_json: str, log_path: str) -> None:
    """Entry of the child process (its stderr is ``log_path``). SIGTERM (the demo was stopped)
    unwinds through the compile's cleanup (nvcc killed, its temporary directory removed, the cache
    entry's lock released) instead of killing the interpreter on the spot. A successful build removes the
    log; a failed one leaves it for whoever reads it: the demo, or the user when the demo had left
    the build running in the background and exited."""

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    _compile_child(config_json)
    Path(log_path).unlink(missing_ok=True)


def _event(name: str) -> None:
    """One progress line on stdout for the parent: ``started`` (imports done, about to look the kernel
    up; a child that stays here is waiting for the cache entry's lock, held by another build of the
    same kernel) or ``compiling`` (a cache miss: nvcc runs now)."""
    print(json.dumps({"event": name}), flush=True)


def _compile_child(config_json: str) -> None:
    """Build (or fetch from the kernel cache) one GEMM config for sm_90; print ``_event`` lines, then
    a JSON summary, on stdout."""
    from ..gemm.compile import build_gemm
    from ..gemm.config import GemmConfig

    t0 = time.perf_counter()
    config = GemmConfig.from_dict(json.loads(config_json))
    _event("started")
    binary = build_gemm(config, 90, on_compile=lambda: _event("compiling"))
    out = {"status": "cached" if binary.cached else "compiled", "seconds": round(time.perf_counter() - t0, 1),
           "nvcc_seconds": binary.meta.get("seconds"), "cubin_bytes": len(binary.cubin)}
    try:
        from ..gemm.sass import disassemble, summarize

        out["sass"] = summarize(disassemble(binary.cubin), binary.ptxas_log).to_dict()
    except Exception as e:  # no cuobjdump/nvdisasm here: the compile itself is the check
        out["sass"] = f"not summarized ({type(e).__name__}: {e})"
    print(json.dumps(out), flush=True)


class GemmCompile:
    """The sm_90 K-score GEMM build running in a child process.

    The child leads its own session, so that stopping it also stops nvcc and the compilers nvcc
    started, and so that it can outlive the demo: :meth:`finish` waits until a deadline and then
    leaves the child building into the kernel cache (the cache entry's file lock keeps concurrent
    builds of the same kernel to one), so that the next demo finds it there. Its stdout (events and
    the result) goes to an anonymous temporary file, its stderr to :attr:`log_path`.
    """

    def __init__(self, config):
        self.config = config
        self.t0 = time.perf_counter()
        env = dict(os.environ)
        # the child must import this same package even when it is not installed (a source checkout)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # files, not pipes: nobody reads while the pipeline runs, and a full pipe would block the child
        self.out = tempfile.TemporaryFile("w+")
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvarn-demo-{config.name}-", suffix=".log")
        with os.fdopen(fd, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(config.to_dict()), self.log_path],
                                         env=env, stdin=subprocess.DEVNULL, stdout=self.out, stderr=err,
                                         start_new_session=True)

    def events(self) -> list[str]:
        """The child's ``_event`` names so far."""
        self.out.seek(0)
        names = []
        for line in self.out.read().splitlines():
            try:
                names.append(json.loads(line)["event"])
            except (ValueError, KeyError, TypeError):  # the result line, or a partly written one
                continue
        return names

    def state(self) -> str:
        """``compiling`` (nvcc runs), ``waiting`` (for the cache entry's lock: another build of this kernel
        runs) or ``starting`` (the child is importing)."""
        events = self.events()
        return "compiling" if "compiling" in events else "waiting" if "started" in events else "starting"

    def close(self) -> None:
        """Close the parent's copy of the child's stdout file; safe to call again."""
        self.out.close()

    def finish(self, deadline: float | None, progress) -> dict:
        """Wait for the child until ``deadline`` (a ``time.perf_counter()`` value, None = forever), calling
        ``progress(elapsed_s, state)`` about once a second. Returns the child's summary, or, at the
        deadline, :meth:`detach`'s."""
        while self.proc.poll() is None:
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                return self.detach()
            progress(now - self.t0, self.state())
            try:
                self.proc.wait(timeout=1.0 if deadline is None else max(0.05, min(1.0, deadline - now)))
            except subprocess.TimeoutExpired:
                pass
        elapsed = round(time.perf_counter() - self.t0, 1)
        self.out.seek(0)
        lines = [ln for ln in self.out.read().splitlines() if ln.strip()]
        self.close()
        if self.proc.returncode != 0:
            log = Path(self.log_path)
            err = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
            log.unlink(missing_ok=True)
            return {"status": "failed", "config": self.config.name, "seconds": elapsed,
                    "error": err[-1] if err else f"exit status {self.proc.returncode}"}
        Path(self.log_path).unlink(missing_ok=True)
        out = json.loads(lines[-1])
        out.update(config=self.config.name, seconds=elapsed)
        return out

    def detach(self) -> dict:
        """Leave the child running after the demo: it finishes the build into the kernel cache (or finds
        it there once the other build holding the entry's lock is done) and removes its log unless it
        fails. Returns what it was doing."""
        state = self.state()
        self.close()
        return {"status": "background", "state": state, "config": self.config.name, "pid": self.proc.pid,
                "log": self.log_path, "seconds": round(time.perf_counter() - self.t0, 1)}

    def stop(self) -> None:
        """Stop the child's process group (SIGTERM, then SIGKILL after 5 s), reap the child and remove
        its log."""
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)  # the child leads its own session: pgid == pid
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self.proc.wait()
        Path(self.log_path).unlink(missing_ok=True)
        self.close()


_STATE_WORDS = {"compiling": "compiling", "waiting": "waiting for another build of it (the kernel cache's lock)",
                "starting": "starting"}


def _progress_printer(config_name: str):
    """Progress of the compile on stderr: a refreshing line on a terminal, else nothing (the start line
    was printed already)."""
    tty = sys.stderr.isatty()

    def show(elapsed: float, state: str) -> None:
        if tty:
            print(f"\r\033[K  CUTLASS K-score GEMM for sm_90 ({config_name}): {_STATE_WORDS[state]}, {elapsed:4.0f} s",
                  end="", file=sys.stderr, flush=True)

    def done() -> None:
        if tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    return show, done


# --- the pipeline ---------------------------------------------------------------------------------------
def _run_pipeline(layers, n: int, args, device: str) -> tuple[dict, object, list]:
    """Chunked prefill then ``args.decode_steps`` decode steps of every layer through one KVarNCache.

    layers: [(q [1, Hq, n, D], k [1, Hkv, n, D], v, scale)] float32 on the CPU. Returns (accuracy
    record, the cache, fp16 copies on ``device`` [(q16, k16, v16, scale)]).
    """
    import torch

    import kvarn_cutlass as kc

    on_gpu = device == "cuda"
    n_decode = args.decode_steps
    n_prefill = n - n_decode
    _, Hkv, _, D = layers[0][1].shape
    Hq = layers[0][0].shape[1]
    dev16 = [(q.to(device, torch.float16), k.to(device, torch.float16), v.to(device, torch.float16), s)
             for q, k, v, s in layers]
    cache = kc.KVarNCache(len(layers), 1, Hkv, D, preset=args.preset, window=args.window, device=device,
                          max_seq_len=n)
    acc: dict = {"prefill": [], "decode": []}
    for start in range(0, n_prefill, args.chunk):
        stop = min(start + args.chunk, n_prefill)
        for i, (q16, k16, v16, scale) in enumerate(dev16):
            chunk = (q16[:, :, start:stop], k16[:, :, start:stop], v16[:, :, start:stop])
            if stop < n_prefill:
                if on_gpu:  # attention + append; on the CPU only the checked last chunk runs the torch path
                    kc.prefill_attention(*chunk, cache, i, scale)
                else:
                    cache.append(i, chunk[1], chunk[2])
                continue
            exact, p = exact_attention(chunk[0], k16[:, :, :n_prefill], v16[:, :, :n_prefill], scale)
            ref = kc.reference.attention(chunk[0], cache, i, scale, k=chunk[1], v=chunk[2])
            share = _quantized_mass(p, cache, i)  # before the append: the tiles this chunk reads
            out = kc.prefill_attention(*chunk, cache, i, scale)
            acc["prefill"].append({"vs_exact": rel_error(out, exact), "vs_reference": rel_error(out, ref),
                                   "reference_vs_exact": rel_error(ref, exact), "quantized_attention_share": share})
            del exact, p, ref
    graphs = ([kc.DecodeGraph(cache, i, Hq, torch.float16, scale) for i, (_, _, _, scale) in enumerate(dev16)]
              if on_gpu else None)
    steps = [[] for _ in dev16]
    for t in range(n_prefill, n):
        for i, (q16, k16, v16, scale) in enumerate(dev16):
            cache.append(i, k16[:, :, t : t + 1], v16[:, :, t : t + 1])
            q_tok = q16[:, :, t : t + 1]
            ref = kc.reference.attention(q_tok, cache, i, scale)
            out = graphs[i].replay(q_tok).clone() if on_gpu else ref
            exact, p = exact_attention(q_tok, k16[:, :, : t + 1], v16[:, :, : t + 1], scale)
            steps[i].append({"vs_exact": rel_error(out, exact), "vs_reference": rel_error(out, ref) if on_gpu else None,
                             "quantized_attention_share": _quantized_mass(p, cache, i)})
    for layer_steps in steps:
        acc["decode"].append({
            "vs_exact": max(s["vs_exact"] for s in layer_steps),
            "vs_reference": max(s["vs_reference"] for s in layer_steps) if on_gpu else None,
            "quantized_attention_share": sum(s["quantized_attention_share"] for s in layer_steps) / len(layer_steps),
        })
    return acc, cache, dev16


def _summarize(per_layer: list[dict]) -> dict:
    """Worst layer of each error, mean quantized share; per-layer values kept when several layers."""
    out = {}
    for key in ("vs_exact", "vs_reference", "reference_vs_exact"):
        if key in per_layer[0]:  # None where there is nothing to compare (the CPU decode is the reference)
            vals = [r[key] for r in per_layer if r[key] is not None]
            out[f"{key}_max"] = max(vals) if vals else None
    out["quantized_attention_share"] = sum(r["quantized_attention_share"] for r in per_layer) / len(per_layer)
    if len(per_layer) > 1:
        out["per_layer"] = per_layer
    return out


# --- speed (CUDA) -----------------------------------------------------------------------------------------
def _gpu_speed(args, q16, k16, v16, scale: float) -> dict:
    """Layer-0 timings on CUDA: CUDA events, warm-up, median (see :func:`_time_decode`, :func:`_time_prefill`)."""
    return {"decode": _time_decode(args, q16, k16, v16, scale), "prefill": _time_prefill(args, q16, k16, v16, scale),
            "method": "CUDA events, warm-up, median (decode 200 runs, prefill 3 prompts)"}


def _time_decode(args, q16, k16, v16, scale: float) -> dict:
    """One decode step at the full context: CUDA-graph replay (the product path) and eager, against
    ``F.scaled_dot_product_attention(..., enable_gqa=True)`` over the fp16 K/V. Inputs rotate (KVarN:
    layers holding the same K/V; SDPA: copies of the K/V) so that L2 does not serve repeated reads."""
    import torch
    import torch.nn.functional as F

    import kvarn_cutlass as kc

    from ..bench.timing import rotation_count, time_cuda
    from ..decode import get_plan

    n, Hkv, D = k16.shape[2], k16.shape[1], k16.shape[3]
    q1 = q16[:, :, n - 1 : n].contiguous()
    spec = kc.TileSpec(args.preset, D)
    tile_bytes = Hkv * max(1, math.ceil((n - args.window) / spec.tile_tokens)) * spec.tile_nbytes
    rot = min(8, rotation_count(tile_bytes))
    cache = kc.KVarNCache(rot, 1, Hkv, D, preset=args.preset, window=args.window, device="cuda", max_seq_len=n)
    for layer in range(rot):
        for s in range(0, n, 8192):
            cache.append(layer, k16[:, :, s : s + 8192], v16[:, :, s : s + 8192])
    plan = get_plan(cache)
    plan.refresh()
    outs = [torch.empty_like(q1) for _ in range(rot)]
    graph = time_cuda(lambda i: plan.launch(q1, i, outs[i], scale), inputs=range(rot), graph=True, warmup=20, runs=200)
    turn = [0]

    def eager():
        turn[0] = (turn[0] + 1) % rot
        kc.decode_attention(q1, cache, turn[0], scale, out=outs[turn[0]])

    eager_t = time_cuda(eager, warmup=20, runs=200)
    kv_bytes = 2 * k16.numel() * k16.element_size()
    sets = [(k16, v16)] + [(k16.clone(), v16.clone()) for _ in range(min(8, rotation_count(kv_bytes)) - 1)]
    def sdpa_call(kv):
        return F.scaled_dot_product_attention(q1, kv[0], kv[1], scale=scale, enable_gqa=True)

    sdpa = time_cuda(sdpa_call, inputs=sets, warmup=20, runs=200)
    res = {"kvarn_graph_us": round(graph.median_us, 2), "kvarn_eager_us": round(eager_t.median_us, 2),
           "sdpa_fp16_us": round(sdpa.median_us, 2), "sdpa_over_kvarn_graph": round(sdpa.median_us / graph.median_us, 2),
           "rotated_sets": rot}
    # Eager SDPA at batch 1 is bound by host launch time; replayed from a CUDA graph, as KVarN is above,
    # it shows its GPU time (the like-for-like comparison, docs/perf-notes.md).
    try:
        sdpa_graph = time_cuda(sdpa_call, inputs=sets, warmup=20, runs=200, graph=True)
    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured: report why, keep the rest
        res["sdpa_fp16_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    else:
        res["sdpa_fp16_graph_us"] = round(sdpa_graph.median_us, 2)
        res["sdpa_graph_over_kvarn_graph"] = round(sdpa_graph.median_us / graph.median_us, 2)
    return res


def _time_prefill(args, q16, k16, v16, scale: float) -> dict:
    """The whole prompt's attention (``prefill_attention`` per chunk; the compression, which runs in
    ``cache.append``, timed apart) against flash SDPA over the fp16 K/V with a causal lower-right mask
    per chunk; one warm-up prompt, median of 3."""
    import statistics

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import kvarn_cutlass as kc

    n, Hkv, D = k16.shape[2], k16.shape[1], k16.shape[3]
    group = q16.shape[1] // Hkv
    chunks = [(s, min(args.chunk, n - s)) for s in range(0, n, args.chunk)]

    def event():
        return torch.cuda.Event(enable_timing=True)

    def kvarn_prompt() -> float:
        """The whole prompt, attention and append (compression) of every chunk, one sync at the end."""
        cache = kc.KVarNCache(1, 1, Hkv, D, preset=args.preset, window=args.window, device="cuda", max_seq_len=n)
        a, b = event(), event()
        with cache.deferred_checks():  # the appends' checks read back once, after the timed region
            a.record()
            for s, m in chunks:
                kc.prefill_attention(q16[:, :, s : s + m], k16[:, :, s : s + m], v16[:, :, s : s + m], cache, 0, scale)
            b.record()
            b.synchronize()
        return a.elapsed_time(b)

    kk = k16.repeat_interleave(group, 1)  # flash SDPA needs equal head counts; the fp16 cache holds all tokens
    vv = v16.repeat_interleave(group, 1)

    def sdpa_prompt() -> float:
        """Flash SDPA over an fp16 cache, each chunk against every earlier token (causal lower right)."""
        a, b = event(), event()
        a.record()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for s, m in chunks:
                F.scaled_dot_product_attention(q16[:, :, s : s + m], kk[:, :, : s + m], vv[:, :, : s + m],
                                               attn_mask=causal_lower_right(m, s + m), scale=scale)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    kvarn_prompt(), sdpa_prompt()  # warm-up: kernel builds, GEMM params, workspaces
    kvarn_ms = statistics.median(kvarn_prompt() for _ in range(3))
    sdpa_ms = statistics.median(sdpa_prompt() for _ in range(3))
    return {"kvarn_prompt_ms": round(kvarn_ms, 3), "sdpa_flash_fp16_ms": round(sdpa_ms, 3),
            "kvarn_over_sdpa": round(kvarn_ms / sdpa_ms, 2), "chunks": len(chunks)}


# --- the command ------------------------------------------------------------------------------------------
def _validate(args, n: int | None) -> None:
    T = PRESETS[args.preset][2]
    if args.window % T:
        raise ValueError(f"--window must be a multiple of the tile size {T} of {args.preset}, got {args.window}")
    if n is not None and n <= args.decode_steps:
        raise ValueError(f"--tokens ({n}) must exceed --decode-steps ({args.decode_steps})")
    if args.text and not args.model:
        raise ValueError("--text needs --model")


def _start_compile(config, nvcc: str, budget: float) -> GemmCompile:
    """Start the GEMM build child and say on stderr what it will do: read the kernel cache's entry, or
    compile with nvcc (and, past ``budget`` seconds of demo, go on compiling in the background)."""
    from ..gemm.compile import gemm_cache_path

    cached = gemm_cache_path(config, 90).is_file()
    job = GemmCompile(config)
    if cached:
        print(f"  CUTLASS K-score GEMM for sm_90 ({config.name}): in the kernel cache; reading and checking it in "
              "a background process", file=sys.stderr, flush=True)
    else:
        after = ("the demo waits for it" if budget == 0 else
                 f"if it is not done when the demo has run {budget:g} s, it goes on in the background and the "
                 "next demo finds it in the kernel cache")
        print(f"  compiling the CUTLASS K-score GEMM for sm_90 ({config.name}) with {nvcc} in a background "
              f"process (a cold compile took 31 s on a free core of a 2-core machine); {after}",
              file=sys.stderr, flush=True)
    return job


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    import torch

    device = resolve_device(args.device)
    on_gpu = device == "cuda"
    _validate(args, args.tokens)
    Hq, Hkv = GPU_HEADS if on_gpu else CPU_HEADS

    compile_job = None
    if not on_gpu and not args.no_compile:
        from ..gemm.compile import nvcc_path

        try:
            nvcc = nvcc_path()
        except FileNotFoundError:
            nvcc = None
        if nvcc is not None:  # started first: it runs on the other core while the pipeline runs
            compile_job = _start_compile(demo_gemm_config(args.chunk, GPU_HEADS[0] // GPU_HEADS[1]), nvcc, args.budget)
    try:
        if args.model:
            layers, n, source = model_qkv(args.model, args.tokens, args.text, device)
            _validate(args, n)
        else:
            n = args.tokens or (GPU_TOKENS if on_gpu else CPU_TOKENS)
            q, k, v = realistic_qkv(Hq, Hkv, n, HEAD_DIM, torch.Generator().manual_seed(1234))
            layers = [(q, k, v, HEAD_DIM**-0.5)]
            source = {"generator": "built-in (RoPE recency + content retrieval, outlier channels)", "layers": 1}
        q0, k0 = layers[0][0], layers[0][1]
        result: dict = {"device": device, "tokens": n, "preset": args.preset, "window": args.window, "chunk": args.chunk,
                        "decode_steps": args.decode_steps, "source": source,
                        "shape": {"layers": len(layers), "batch": 1, "q_heads": q0.shape[1], "kv_heads": k0.shape[1],
                                  "head_dim": k0.shape[3]}}
        if on_gpu:
            result["gpu"] = torch.cuda.get_device_name()
        acc, cache, dev16 = _run_pipeline(layers, n, args, device)
        result["accuracy"] = {"prefill_last_chunk": _summarize(acc["prefill"]), "decode": _summarize(acc["decode"])}
        fp16_bytes = 2 * len(layers) * k0.shape[1] * n * k0.shape[3] * 2
        result["memory"] = {"kvarn_bytes": cache.nbytes(), "fp16_bytes": fp16_bytes,
                            "fp16_over_kvarn": round(fp16_bytes / cache.nbytes(), 2),
                            "tiles_fp16_over_kvarn": round(cache.spec.compression_vs_fp16, 2)}
        if on_gpu:
            q16, k16, v16, scale = dev16[0]
            del cache
            result["speed"] = _gpu_speed(args, q16, k16, v16, scale)
            result["gpu_kernels"] = ("prefill: fused attention kernel (mma.sync); decode: one split-tile int8 "
                                     "tensor-core kernel (partials merged by the last block) in a CUDA graph; "
                                     "compression: GPU kernel in cache.append")
        else:
            result["gpu_kernels"] = ("not run: no CUDA device. The GPU compression, the decode kernels and the "
                                     "prefill kernels need an NVIDIA GPU (sm_80+; the CUTLASS K-score GEMM sm_90)")
            if args.no_compile:
                result["cutlass_gemm_sm90"] = {"status": "skipped (--no-compile)"}
            elif compile_job is None:
                result["cutlass_gemm_sm90"] = {"status": "skipped: nvcc not found (a GPU machine with the CUDA "
                                                         "toolkit compiles it on first use)"}
            else:
                show, done = _progress_printer(compile_job.config.name)
                deadline = None if args.budget == 0 else t_start + args.budget
                try:
                    result["cutlass_gemm_sm90"] = compile_job.finish(deadline, show)
                finally:
                    done()
                compile_job = None
    finally:
        if compile_job is not None:  # an error, ^C or SIGTERM before the report: do not leave nvcc running
            compile_job.stop()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _report(result, args)
    return 0


def _fmt_err(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _report(r: dict, args) -> None:
    s, on_gpu = r["shape"], r["device"] == "cuda"
    src = r["source"]
    what = (f"{src['model']} ({src['layers']} layers) over {src['text']}" if "model" in src
            else "built-in generator K/V/Q (RoPE recency + content retrieval, outlier channels)")
    print(f"kvarn-cutlass demo on {r.get('gpu', r['device'])}: {r['tokens']} tokens, {s['q_heads']} q / {s['kv_heads']} "
          f"KV heads, head_dim {s['head_dim']}, preset {r['preset']}, window {r['window']}, chunk {r['chunk']}")
    print(f"  inputs: {what}")
    a = r["accuracy"]
    pf, dc = a["prefill_last_chunk"], a["decode"]
    worst = " (worst layer)" if s["layers"] > 1 else ""
    print(f"  accuracy, relative error of the attention output{worst}:")
    print("    vs exact float64 attention over the unquantized fp16 K/V (quantization error):")
    print(f"      decode, max of {r['decode_steps']} steps: {_fmt_err(dc['vs_exact_max'])}   "
          f"({100 * dc['quantized_attention_share']:.0f}% of the attention on quantized tokens)")
    own = (f"; the chunk's first {r['chunk'] - r['window']} queries see their own recent tokens quantized, "
           f"--chunk {r['window']} keeps them exact" if r["chunk"] > r["window"] else "")
    print(f"      prefill, last chunk:    {_fmt_err(pf['vs_exact_max'])}   "
          f"({100 * pf['quantized_attention_share']:.0f}% on quantized tokens{own})")
    kernels = "GPU kernels" if on_gpu else "CPU prefill pipeline"
    decode_vs_ref = _fmt_err(dc.get("vs_reference_max")) if on_gpu else "- (the CPU decode is the reference)"
    print(f"    {kernels} vs the float64 reference over the same quantized cache: "
          f"prefill {_fmt_err(pf.get('vs_reference_max'))}, decode {decode_vs_ref}")
    m = r["memory"]
    print(f"  memory: {m['kvarn_bytes'] / 2**20:.2f} MiB vs {m['fp16_bytes'] / 2**20:.2f} MiB fp16 "
          f"({m['fp16_over_kvarn']}x smaller; tiles alone {m['tiles_fp16_over_kvarn']}x, the rest is the fp16 window)")
    if on_gpu:
        d, p = r["speed"]["decode"], r["speed"]["prefill"]
        graphed = (f"; CUDA graph {d['sdpa_fp16_graph_us']} us ({d['sdpa_graph_over_kvarn_graph']}x)"
                   if "sdpa_fp16_graph_us" in d else "")
        print(f"  decode step at {r['tokens']} tokens: {d['kvarn_graph_us']} us (CUDA graph; eager "
              f"{d['kvarn_eager_us']} us) vs SDPA fp16 eager {d['sdpa_fp16_us']} us ({d['sdpa_over_kvarn_graph']}x)"
              f"{graphed}")
        print(f"  prefill of the whole prompt, {p['chunks']} chunks (attention and append): {p['kvarn_prompt_ms']} ms "
              f"vs SDPA flash fp16 {p['sdpa_flash_fp16_ms']} ms ({p['kvarn_over_sdpa']}x the SDPA time)")
    else:
        print(f"  GPU: {r['gpu_kernels']}")
        c = r["cutlass_gemm_sm90"]
        line = f"  CUTLASS K-score GEMM for sm_90: {c['status']}"
        if c["status"] in ("compiled", "cached"):
            sass = c.get("sass")
            igmma = f", {sass['igmma']} IGMMA" if isinstance(sass, dict) and "igmma" in sass else ""
            how = (f"nvcc took {c['nvcc_seconds']} s" if c["status"] == "compiled"
                   else f"from the kernel cache, compiled earlier in {c['nvcc_seconds']} s")
            line += f" ({c['config']}, {c['seconds']} s; {how}{igmma})"
        elif c["status"] == "background":
            doing = {"compiling": "still compiling", "waiting": "waiting for another build of the same kernel "
                     "(the kernel cache's lock)", "starting": "still starting"}[c["state"]]
            line = (f"  CUTLASS K-score GEMM for sm_90: {doing} after {c['seconds']} s (--budget {args.budget:g}); "
                    f"left running in the background (pid {c['pid']}), so the next `kvarn-cutlass demo` finds it in "
                    f"the kernel cache; a failure is logged in {c['log']}")
        elif c["status"] == "failed":
            line += f" ({c['config']}: {c['error']})"
        print(line)
    print(f"  done in {r['seconds']} s")
