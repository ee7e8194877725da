"""Fast greedy generation: chunked prefill, then one static decode step replayed from a CUDA graph.

::

    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf.generate import static_greedy
    cache = kh.KVarNCache(model.config, preset="k4v2_g128", window=256, max_seq_len=n + max_new_tokens)
    tokens = static_greedy(model, input_ids, max_new_tokens, cache)   # int64 [batch, max_new_tokens]

What runs (:class:`StaticGreedy`):

1. The prompt goes through :func:`kvarn_cutlass.hf.prefill` in chunks (with a KVarN cache on CUDA: the
   fused prefill kernel per chunk and layer, every append checked with one device read at the end). The
   first token is the argmax of the last position's logits, taken on the device.
2. Decode steps on static buffers: a step feeds ``input_ids`` [batch, 1] at ``position_ids`` [1, 1]
   through the whole model (embedding; per layer the projections, the KV append, attention and the MLP;
   the final norm and the LM head), takes the argmax on the device, writes it into ``tokens`` [batch,
   max_new_tokens] and into ``input_ids``, and advances the position, all as device operations.
   With ``graph=True`` (the default on CUDA) the first decode step runs eagerly (a real step, which
   also initializes what a capture cannot: cuBLAS handles and workspaces, kernel modules), then the step
   is captured once in a CUDA graph and every later token is one replay, with no host synchronization:
   the tokens are read back at the end (or every ``sync_every`` tokens). With ``graph=False`` (the only
   choice on the CPU) every step runs the same code eagerly.

In a captured step with a KVarN cache, the attention implementation ``kvarn_step`` (registered here)
appends each layer's new K/V through :class:`kvarn_cutlass.step_graph.StepAppends` (the append kernels
read and update the cache's device lengths, ``cache.device_lengths()``, and compress a tile on the
device when one completes, so one graph serves the sequence while it crosses tile boundaries) and
attends with :func:`kvarn_cutlass.decode_attention_ragged` on the same device lengths, with the decode
plan's workspace: the kernels, grid and inputs of the eager path (:func:`kvarn_cutlass.decode_attention`
after ``cache.append``), so the logits are the same bits. Outside a capture ``kvarn_step`` is the
ordinary ``kvarn`` attention (:func:`kvarn_cutlass.hf.attention.kvarn_attention_forward`). It has no
mask function: transformers then passes no mask, right for one query per sequence, which is all it
accepts. The cache's device error flag (NaN/Inf or out-of-range K/V in an append) is read with the
tokens: a failed step raises ValueError with the cache restored to its state before that step.

Caches: a :class:`kvarn_cutlass.hf.KVarNCache` (the model loaded with ``attn_implementation="kvarn"``)
or transformers' ``StaticCache`` (static K/V buffers and a device-side length; with ``sdpa`` attention
its mask is built on the device from that length, so the step captures too). With a StaticCache,
``decode_attn`` names another attention implementation for the decode steps alone (eager and
captured; the prefill keeps the model's): one that reads the filled prefix's length on the device
serves every replay while the context grows, as ``kvarn_cutlass.bench.e2e.fp16_decode_attention``
(FlashAttention-2 over the filled prefix: the fp16 decode baseline of ``kvarn-cutlass bench --section
e2e``). The cache must hold the prompt plus ``max_new_tokens - 1`` tokens (``max_seq_len`` /
``max_cache_len``): checked before anything runs, since a captured graph's buffers cannot grow.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from transformers import AttentionInterface

from ._compat import cache_kwarg
from .attention import kvarn_attention_forward
from .cache import ATTN_IMPLEMENTATION, KVarNCache, handle_of
from .prefill import prefill

__all__ = ["STEP_ATTN_IMPLEMENTATION", "StaticGreedy", "static_greedy", "step_attention_forward"]

STEP_ATTN_IMPLEMENTATION = "kvarn_step"

# library cache -> its _DeviceStep while a decode step of it is being captured
_capturing: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _DeviceStep:
    """What a captured decode step of a KVarN library cache reads and writes: static K/V inputs of the
    append kernels (one token per layer), their prepared launches, and the decode workspace."""

    def __init__(self, lib, num_q_heads: int) -> None:
        from ..decode import get_plan
        from ..step_graph import StepAppends

        if lib.tile_pool(0).shape[1] == 0:  # the append kernels of a step need a tile slot (StepGraph's rule)
            raise ValueError(f"max_seq_len={lib.max_seq_len} leaves no room for a tile (sink {lib.sink_tokens}); "
                             "a captured decode step needs one: a larger max_seq_len, or graph=False")
        L, B, H, D = lib.num_layers, lib.batch_size, lib.num_kv_heads, lib.head_dim
        self.lib = lib
        # the append launches are prepared on these addresses; each layer's new K/V is copied in
        self.k = torch.zeros(L, B, H, 1, D, dtype=lib.dtype, device=lib.device)
        self.v = torch.zeros_like(self.k)
        self.appends = StepAppends(lib, self.k, self.v)
        # the eager decode's own workspace (decode_attention uses it too): the same split grid, the same bits
        self.workspace = get_plan(lib).workspace(num_q_heads // H)
        self.prepared: dict = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float | None) -> torch.Tensor:
        """Enqueue the append of k, v [batch, num_kv_heads, 1, head_dim] to ``layer``, then decode attention of
        q [batch, num_q_heads, 1, head_dim] over the layer (which holds the new token by then)."""
        from ..decode import decode_attention_ragged

        lib = self.lib
        self.k[layer].copy_(k)
        self.v[layer].copy_(v)
        self.appends.enqueue(layer)
        buf, lens = lib.buffers(layer), lib.device_lengths()
        qk = q if q.dtype in (torch.float16, torch.bfloat16) else q.to(lib.dtype)
        out = decode_attention_ragged(
            qk, lib.tile_pool(layer), buf["window_k"], buf["window_v"], buf["sink_k"], buf["sink_v"],
            lens[layer, 0], lens[layer, 1], lens[layer, 2], lib.spec, scale=scale, workspace=self.workspace,
            tile_table=lib.tile_table(layer), _prepared=self.prepared,
        )
        return out.to(q.dtype)


def step_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs):
    """The ``kvarn_step`` attention (transformers attention function) of a decode step.

    query [B, Hq, 1, D], key/value [B, Hkv, 1, D] (post-RoPE). While :class:`StaticGreedy` captures a
    step of the KVarN cache that tagged ``key``: the device append and ragged decode of
    :class:`_DeviceStep`; otherwise :func:`kvarn_cutlass.hf.attention.kvarn_attention_forward`.
    Returns (attn_output [B, 1, Hq, D], None). Raises ValueError for more than one query per sequence.
    """
    if query.shape[2] != 1:
        raise ValueError(f"the '{STEP_ATTN_IMPLEMENTATION}' attention serves decode steps (one query per sequence), "
                         f"got {query.shape[2]} queries; run prefill chunks with '{ATTN_IMPLEMENTATION}'")
    handle = handle_of(key)
    step = None if handle is None else _capturing.get(handle.cache.library)
    if step is None:
        return kvarn_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    handle.consumed = True
    out = step.attend(query, handle.key, handle.value, handle.layer, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(STEP_ATTN_IMPLEMENTATION, step_attention_forward)


@contextlib.contextmanager
def _attention(model, name: str | None):
    """``model`` with attention implementation ``name`` inside the block (None: unchanged)."""
    before = model.config._attn_implementation
    if name is None or name == before:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _capacity(cache) -> int | None:
    """Tokens the cache can hold (None: it grows), or TypeError for a cache without static buffers."""
    if isinstance(cache, KVarNCache):
        return cache.max_seq_len
    from transformers import StaticCache

    if isinstance(cache, StaticCache):
        get = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape  # the name before 5.16
        return int(get())
    raise TypeError(f"cache must be a kvarn_cutlass.hf.KVarNCache or a transformers StaticCache (static buffers), "
                    f"got {type(cache).__name__}")


class StaticGreedy:
    """Greedy generation of ``max_new_tokens`` tokens after ``input_ids`` with a static decode step
    (see the module docstring). Use :meth:`prefill`, then :meth:`step` ``max_new_tokens - 1`` times, then
    :meth:`finish`; :func:`static_greedy` does all of it.

    Args:
        model: a transformers causal LM in eval mode; everything runs on ``model.device``.
        input_ids: int64 [batch, n >= 1], the prompts (one length: the KVarN cache takes no padding).
        max_new_tokens: tokens to generate, >= 1 (no early stop at EOS). The last one is chosen but
            never fed back, so the cache ends holding ``n + max_new_tokens - 1`` more tokens.
        cache: a :class:`kvarn_cutlass.hf.KVarNCache` (with ``max_seq_len`` for ``graph=True``) or a
            transformers ``StaticCache``, with room for what it holds plus ``n + max_new_tokens - 1``.
        chunk_size: prefill chunk in tokens.
        graph: replay the decode step from a CUDA graph (default: True on CUDA, False elsewhere).
        decode_attn: with a StaticCache, the attention implementation of the decode steps (a name
            registered in transformers' ``AttentionInterface``, or ``"eager"``); the prefill and the
            model's own setting are left as they are. None (default): the model's own. A KVarNCache
            always decodes through ``kvarn_step``, so it takes None only.

    Attributes: ``tokens`` int64 [batch, max_new_tokens] on the model's device (column i is written by
    the step that chooses token i; column 0 by :meth:`prefill`), ``input_ids`` int64 [batch, 1] and
    ``position_ids`` int64 [1, 1] (the token the next step feeds and its position), ``graph`` (bool),
    ``steps`` (decode steps run).

    Raises (at construction, before the cache or the model is touched): TypeError for a cache without
    static buffers; ValueError for bad arguments, a capacity that cannot hold the generation, a KVarN
    cache without ``max_seq_len`` under ``graph=True``, ``graph=True`` off CUDA, a KVarN cache with a
    model whose attention implementation is not ``kvarn``, or a ``decode_attn`` that is not a registered
    name or comes with a KVarN cache.
    """

    def __init__(self, model, input_ids: torch.Tensor, max_new_tokens: int, cache, chunk_size: int = 512,
                 graph: bool | None = None, decode_attn: str | None = None) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if (not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1
                or input_ids.dtype != torch.int64):
            raise ValueError(f"input_ids must be an int64 [batch, n>=1] tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {list(getattr(input_ids, 'shape', []))}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.device = model.device
        if graph is None:
            graph = self.device.type == "cuda"
        capacity = _capacity(cache)
        self.kvarn = isinstance(cache, KVarNCache)
        if self.kvarn and model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"a KVarNCache needs the model's attention implementation '{ATTN_IMPLEMENTATION}', the model "
                             f"has {model.config._attn_implementation!r} (model.set_attn_implementation('{ATTN_IMPLEMENTATION}'))")
        if decode_attn is not None:
            if self.kvarn:
                raise ValueError(f"decode_attn={decode_attn!r} is for a StaticCache; a KVarNCache decodes through "
                                 f"'{STEP_ATTN_IMPLEMENTATION}' (pass decode_attn=None)")
            if not isinstance(decode_attn, str) or (decode_attn != "eager" and decode_attn not in AttentionInterface()):
                raise ValueError(f"decode_attn must be None, 'eager' or a name registered in transformers' "
                                 f"AttentionInterface, got {decode_attn!r}")
        held = int(cache.get_seq_length())
        B, n = input_ids.shape
        need = held + n + max_new_tokens - 1
        if capacity is None and graph:
            raise ValueError(f"graph=True needs a KVarNCache created with max_seq_len (preallocated pools, whose addresses "
                             f"the graph captures): pass max_seq_len >= {need}")
        if capacity is not None and need > capacity:
            name = "max_seq_len" if self.kvarn else "max_cache_len"
            raise ValueError(f"the cache holds {held} tokens and the generation adds the prompt ({n}) and max_new_tokens - 1 "
                             f"= {max_new_tokens - 1} more, {need} in all, over the cache's {name}={capacity}")
        if graph and self.device.type != "cuda":
            raise ValueError(f"graph=True needs the model on a CUDA device, it is on {self.device}")
        self.model, self.cache, self.max_new_tokens, self.chunk_size, self.graph = model, cache, max_new_tokens, chunk_size, graph
        self._prompt = input_ids.to(self.device)
        self._kw = cache_kwarg(model)
        # the KVarN decode step goes through 'kvarn_step' (its captured form); StaticCache through decode_attn (None:
        # the model's own)
        self._attn = STEP_ATTN_IMPLEMENTATION if self.kvarn else decode_attn
        self.tokens = torch.zeros(B, max_new_tokens, dtype=torch.int64, device=self.device)
        self.input_ids = torch.zeros(B, 1, dtype=torch.int64, device=self.device)
        self.position_ids = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        self._index = torch.zeros(1, dtype=torch.int64, device=self.device)  # the column the next token goes to
        self.steps = 0
        self._prefilled = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._device_step: _DeviceStep | None = None

    @torch.no_grad()
    def prefill(self) -> None:
        """The prompt into the cache in chunks; the first token into ``tokens[:, 0]`` and ``input_ids`` (on the device)."""
        if self._prefilled:
            raise RuntimeError("prefill() already ran")
        logits = prefill(self.model, self._prompt, self.cache, self.chunk_size).logits[:, -1]
        self._emit(logits.argmax(-1, keepdim=True))
        # the next position is the sequence length: a host int for KVarN, StaticCache's device-side length
        self.position_ids.fill_(self.cache.get_seq_length())
        self._prefilled = True

    def _emit(self, tok: torch.Tensor) -> None:
        """Token ids [batch, 1] into the next column of ``tokens`` and into ``input_ids`` (device ops)."""
        self.tokens.index_copy_(1, self._index, tok)
        self.input_ids.copy_(tok)
        self._index += 1

    def _step_body(self) -> None:
        out = self.model(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=True, logits_to_keep=1,
                         **{self._kw: self.cache})
        self._emit(out.logits[:, -1].argmax(-1, keepdim=True))
        self.position_ids += 1

    def _eager_step(self) -> None:
        with _attention(self.model, self._attn):
            self._step_body()

    def _capture(self) -> None:
        lib = self.cache.library if self.kvarn else None
        dev = None if lib is None else _DeviceStep(lib, self.cache.shape.num_q_heads)
        g = torch.cuda.CUDAGraph()
        if dev is not None:
            _capturing[lib] = dev
        try:
            with _attention(self.model, self._attn), torch.cuda.graph(g):
                if dev is not None:  # the lengths before the step, for check()'s restore
                    dev.appends.enqueue_snapshot()
                self._step_body()
        finally:
            if lib is not None:
                _capturing.pop(lib, None)
        self._graph, self._device_step = g, dev

    @torch.no_grad()
    def step(self) -> None:
        """One decode step: the next token into ``tokens`` and ``input_ids``. With ``graph``, the first call runs
        the step eagerly and captures it (setup: it synchronizes), later calls replay it (no synchronization)."""
        if not self._prefilled:
            raise RuntimeError("call prefill() before step()")
        if self.steps >= self.max_new_tokens - 1:
            raise RuntimeError(f"all {self.max_new_tokens} tokens are chosen; call finish()")
        if self._graph is not None:
            dev = self._device_step
            if dev is not None:
                dev.appends.check_capacity()
            self._graph.replay()
            if dev is not None:
                dev.appends.advance()  # the host-side lengths, as the device computed them
        elif self.graph:
            # torch's rule for capture: warm up on a side stream
            cur = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                self._eager_step()
            cur.wait_stream(side)
            if self.steps + 1 < self.max_new_tokens - 1:  # a later step will replay it
                self._capture()
        else:
            self._eager_step()
        self.steps += 1

    def check(self) -> None:
        """Raise ValueError if an append of a replayed step failed (one device read; the cache is then restored to
        its state before the failed step, and the tokens from that step on are meaningless); else a no-op."""
        if self._device_step is not None:
            self._device_step.appends.check()

    def finish(self) -> torch.Tensor:
        """:meth:`check`, release the graph, and return the tokens chosen so far, int64 [batch, steps + 1]."""
        self.check()
        self._graph, self._device_step = None, None
        return self.tokens[:, : self.steps + 1]


def static_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, cache, chunk_size: int = 512,
                  graph: bool | None = None, sync_every: int = 0,
                  on_tokens: Callable[[torch.Tensor], None] | None = None,
                  decode_attn: str | None = None) -> torch.Tensor:
    """Greedy continuation int64 [batch, max_new_tokens] of ``input_ids`` int64 [batch, n] through
    :class:`StaticGreedy` (chunked prefill, then decode steps replayed from one CUDA graph on CUDA).

    Equal token for token to :func:`kvarn_cutlass.hf.generate.greedy` with the same kind of cache (and
    ``decode_attn`` None).
    ``sync_every`` > 0: every ``sync_every`` tokens, read the error flag and the new tokens back (a
    synchronization) and pass them, int64 [batch, k] on the CPU, to ``on_tokens`` (streaming, progress);
    0 (default): one read at the end (``on_tokens`` then gets every token at once). Arguments and errors:
    :class:`StaticGreedy`.
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 0:
        raise ValueError(f"sync_every must be a non-negative int, got {sync_every!r}")
    run = StaticGreedy(model, input_ids, max_new_tokens, cache, chunk_size, graph, decode_attn)
    run.prefill()
    sent = 0

    def deliver(upto: int) -> None:
        nonlocal sent
        run.check()
        if on_tokens is not None and upto > sent:
            on_tokens(run.tokens[:, sent:upto].cpu())
        sent = upto

    for _ in range(max_new_tokens - 1):
        if sync_every and (run.steps + 1) % sync_every == 0:
            deliver(run.steps + 1)
        run.step()
    tokens = run.finish()
    deliver(max_new_tokens)
    return tokens
