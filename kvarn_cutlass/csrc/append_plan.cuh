// Where the tokens of one KVarNCache append go: the arithmetic shared by the append kernels
// (compress.cu) and, through a host C++ build in tests/test_append_emulation.py, checked against
// kvarn_cutlass.ops.append.plan_append, its Python mirror.
//
// One layer and sequence holds [sink | tiles | window]. An append of n tokens first fills the sink
// (up to sink_cap tokens), the rest joins the stream window[0, wl) ++ chunk[n_sink, n). Whenever the
// stream is longer than `window`, its oldest whole tiles are compressed: n_new tiles, so that
// keep = stream - n_new * T tokens (at most `window`) stay in the window, which is rewritten as
// stream[n_new * T, stream) starting at window position 0.
//
// Stream position p is window token p if p < wl, else chunk token p - wl + n_sink.
//
// Rewriting the window in place (n_new > 0): target j reads stream position s + j (s = n_new * T).
// Targets are done in rounds of s positions, round q = [q*s, (q+1)*s): a round reads window
// positions in [(q+1)*s, (q+2)*s) only and writes [q*s, (q+1)*s) only, so a round never writes what
// it reads, and a barrier between rounds orders round q's reads before round q+1's writes.
#pragma once

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define KVA_HD __host__ __device__ __forceinline__
#else
#define KVA_HD inline
#endif

struct KvaPlan {
  int n_sink;      // chunk tokens [0, n_sink) go to sink[sink_len, sink_len + n_sink)
  int n_new;       // tiles compressed by this append: records n_tiles .. n_tiles + n_new - 1
  int keep;        // window length afterwards
  int stream_len;  // wl + n - n_sink
};

KVA_HD KvaPlan kva_plan(int sink_len, int window_len, int n, int sink_cap, int window, int tile_tokens) {
  KvaPlan p;
  const int room = sink_cap > sink_len ? sink_cap - sink_len : 0;
  p.n_sink = n < room ? n : room;
  p.stream_len = window_len + n - p.n_sink;
  p.n_new = p.stream_len > window ? (p.stream_len - window + tile_tokens - 1) / tile_tokens : 0;
  p.keep = p.stream_len - p.n_new * tile_tokens;
  return p;
}

// Rounds of the in-place window rewrite (0 when no tile completes: the window then only grows).
KVA_HD int kva_rounds(const KvaPlan& p, int tile_tokens) {
  const int s = p.n_new * tile_tokens;
  return p.n_new > 0 ? (p.keep + s - 1) / s : 0;
}
