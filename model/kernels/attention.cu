// Causal attention of a few query rows over one sequence's KV cache, two launches per layer:
// the GPU path's decode and question-prefill attention (model/src/attention/cuda.rs launches
// them), split over the keys as flash-decoding does: a block per head and row has too little
// work to hide the memory latency of a long cache, and a decode step has only `heads` of them.
//
// ragkv_attend_split_*, block (h, i, c): query head h, query row i, which sits at cache index
// t - s + i and sees keys lo..=that index (lo > 0 inside a sliding window), over the keys of
// chunk c (c * chunk ..< (c + 1) * chunk) it sees. Each warp scores its keys of the chunk (its
// lanes across the head's elements) into shared memory, tracking the maximum; then the
// exponentials and their sum; then each warp sums its keys' values weighted by them, and the
// warps' sums are added. The block writes its partial output (unnormalized), its maximum and
// its sum; a chunk it does not see writes a maximum of -inf.
// ragkv_attend_combine, block (h, i): the chunks' partials rescaled to the largest maximum and
// added, divided by the rescaled sums. Only the chunks up to the row's own index are read (a
// graph's replay covers the cache's whole capacity, most of it past the row); the block's
// threads split them: the maximum and the sum by block reductions, the output in groups of
// threads across the head's elements, each group over every `groups`-th chunk.
// ragkv_attend_combine_serial: the first form (each thread over all the chunks, one after the
// other: 9.9 µs per layer on an H200 at ~1,800 keys), kept for comparison
// (`RAGKV_CUDA_COMBINE=serial`).
// Grouped-query attention: head h reads KV head h / (heads / kv_heads).
//
// A CUDA graph replays a decode step with the cache's length in device memory: `past`, when
// not null, holds the rows before this step's (then t = *past + s, whatever `t` says; the
// chunks then cover the cache's capacity). `rows_at`, when not null, holds each query row's
// cache index instead of t - s + i (rows recomputed in place, below the appended ones: a
// chunk's first rows repaired beside the question).

#include <cuda_fp16.h>

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

// Block-wide reduction over blockDim.x threads (a multiple of 32, at most 1024); `red` holds
// 32 floats. Every thread gets the result.
template <bool MAX>
__device__ float block_reduce(float x, float* red) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = MAX ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // `red` may still be read by a previous reduction
  if (lane == 0) red[warp] = x;
  __syncthreads();
  x = lane < warps ? red[lane] : (MAX ? -INFINITY : 0.0f);
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = MAX ? fmaxf(x, y) : x + y;
  }
  return x;
}

// q: element (h, i, e) at q[h * q_head + i * q_row + e] (f32).
// k, v: element (g, j, e) at k[g * kv_head + j * kv_row + e].
// part: (s, heads, chunks, d + 2) f32: the partial output, then the maximum and the sum.
// Blocks of blockDim.x = 32 * warps threads over chunks of warps * KEYS_PER_WARP keys (the
// launcher's THREADS and CHUNK). Shared memory: d (the scaled query) + chunk (scores) + 32 +
// warps * d floats.
//
// Each warp takes KEYS_PER_WARP consecutive keys of the chunk at once, its lanes across the
// head's elements: for each element a lane reads the keys' values one after the other without
// waiting for any (the loads are independent), so a block waits for memory about d / 32 times
// per pass instead of once per key (the kernel's first form, a warp looping over its keys, was
// bound by that latency: ~33 µs per layer whatever the cache's length, on an H200).
constexpr int KEYS_PER_WARP = 8;

template <typename T>
__device__ void attend_split(const float* __restrict__ q, long long q_head, long long q_row,
                             const T* __restrict__ k, const T* __restrict__ v,
                             long long kv_head, long long kv_row, float* __restrict__ part,
                             int s, int t, int heads, int kv_heads, int d, int window,
                             float scale, const int* past, const int* rows_at, int chunk) {
  extern __shared__ float smem[];
  if (past) t = *past + s;
  const int h = blockIdx.x, i = blockIdx.y, c = blockIdx.z, chunks = gridDim.z;
  const int g = h / (heads / kv_heads);
  const int pos = rows_at ? rows_at[i] : t - s + i;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int j0 = max(lo, c * chunk), j1 = min(pos + 1, (c + 1) * chunk);
  float* o = part + (((long long)i * heads + h) * chunks + c) * (d + 2);
  const int tid = threadIdx.x, nt = blockDim.x;
  if (j0 >= j1) {  // the same for the whole block: no barrier is skipped by some threads only
    for (int e = tid; e < d; e += nt) o[e] = 0.0f;
    if (tid == 0) {
      o[d] = -INFINITY;
      o[d + 1] = 0.0f;
    }
    return;
  }
  const int n = j1 - j0;
  const int lane = tid & 31, warp = tid >> 5, warps = nt >> 5;
  float* qs = smem;
  float* sc = qs + d;
  float* red = sc + chunk;
  float* acc = red + 32;

  for (int e = tid; e < d; e += nt) qs[e] = q[h * q_head + i * q_row + e] * scale;
  __syncthreads();

  // Scores: warp w takes keys w * KEYS_PER_WARP + r of the chunk.
  const int first = warp * KEYS_PER_WARP;
  const T* kb = k + g * kv_head + (long long)(j0 + first) * kv_row;
  float dot[KEYS_PER_WARP];
#pragma unroll
  for (int r = 0; r < KEYS_PER_WARP; ++r) dot[r] = 0.0f;
  for (int e = lane; e < d; e += 32) {
    const float qe = qs[e];
#pragma unroll
    for (int r = 0; r < KEYS_PER_WARP; ++r) {
      if (first + r < n) dot[r] += qe * to_f32(kb[(long long)r * kv_row + e]);
    }
  }
  float mx = -INFINITY;
#pragma unroll
  for (int r = 0; r < KEYS_PER_WARP; ++r) {
    float a = dot[r];
    for (int o2 = 16; o2 > 0; o2 >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o2);
    if (first + r < n) {
      if (lane == 0) sc[first + r] = a;
      mx = fmaxf(mx, a);
    }
  }
  mx = block_reduce<true>(mx, red);  // its barriers also publish sc[]

  float sum = 0.0f;
  for (int j = tid; j < n; j += nt) {
    const float p = __expf(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
  sum = block_reduce<false>(sum, red);  // and publish the exponentials

  // Values: the same keys per warp, each lane over its elements; the warps' sums added after.
  const T* vb = v + g * kv_head + (long long)(j0 + first) * kv_row;
  for (int e = lane; e < d; e += 32) {
    float a = 0.0f;
#pragma unroll
    for (int r = 0; r < KEYS_PER_WARP; ++r) {
      if (first + r < n) a += sc[first + r] * to_f32(vb[(long long)r * kv_row + e]);
    }
    acc[warp * d + e] = a;
  }
  __syncthreads();
  for (int e = tid; e < d; e += nt) {
    float y = 0.0f;
    for (int w2 = 0; w2 < warps; ++w2) y += acc[w2 * d + e];
    o[e] = y;
  }
  if (tid == 0) {
    o[d] = mx;
    o[d + 1] = sum;
  }
}

// The kernel for each cache type, by its C name.
#define RAGKV_ATTEND_SPLIT(NAME, T)                                                             \
  extern "C" __global__ void NAME(const float* q, long long q_head, long long q_row, const T* k, \
                                  const T* v, long long kv_head, long long kv_row, float* part,  \
                                  int s, int t, int heads, int kv_heads, int d, int window,      \
                                  float scale, const int* past, const int* rows_at, int chunk) { \
    attend_split<T>(q, q_head, q_row, k, v, kv_head, kv_row, part, s, t, heads, kv_heads, d,    \
                    window, scale, past, rows_at, chunk);                                        \
  }

RAGKV_ATTEND_SPLIT(ragkv_attend_split_f16, __half)
RAGKV_ATTEND_SPLIT(ragkv_attend_split_f32, float)

// out: (s, heads, d) contiguous f32. Block (h, i), blockDim.x a multiple of 32 (at most
// 1024) and at least d rounded up to 32; `past`, `rows_at`, `t` and `s` as the split kernel's.
extern "C" __global__ void ragkv_attend_combine(const float* __restrict__ part,
                                                float* __restrict__ out, int heads, int d,
                                                int chunks, int s, int t, const int* past,
                                                const int* rows_at, int chunk) {
  __shared__ float red[32];
  __shared__ float acc[1024];
  if (past) t = *past + s;
  const int h = blockIdx.x, i = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
  const int pos = rows_at ? rows_at[i] : t - s + i;
  const int live = min(chunks, pos / chunk + 1);
  const float* p = part + ((long long)i * heads + h) * chunks * (d + 2);

  float top = -INFINITY;
  for (int c = tid; c < live; c += nt) top = fmaxf(top, p[c * (d + 2) + d]);
  top = block_reduce<true>(top, red);
  float total = 0.0f;
  for (int c = tid; c < live; c += nt) {
    const float m = p[c * (d + 2) + d];
    if (m > -INFINITY) total += p[c * (d + 2) + d + 1] * __expf(m - top);
  }
  total = block_reduce<false>(total, red);

  const int lanes = (d + 31) & ~31, groups = nt / lanes;
  const int g = tid / lanes, e = tid % lanes;
  if (g < groups && e < d) {
    float y = 0.0f;
    for (int c = g; c < live; c += groups) {
      const float m = p[c * (d + 2) + d];
      if (m > -INFINITY) y += p[c * (d + 2) + e] * __expf(m - top);
    }
    acc[g * lanes + e] = y;
  }
  __syncthreads();
  for (int e2 = tid; e2 < d; e2 += nt) {
    float y = 0.0f;
    for (int g2 = 0; g2 < groups; ++g2) y += acc[g2 * lanes + e2];
    out[((long long)i * heads + h) * d + e2] = y / total;
  }
}

// out: (s, heads, d) contiguous f32. Block (h, i), threads over the head's elements.
extern "C" __global__ void ragkv_attend_combine_serial(const float* __restrict__ part,
                                                float* __restrict__ out, int heads, int d,
                                                int chunks) {
  const int h = blockIdx.x, i = blockIdx.y;
  const float* p = part + ((long long)i * heads + h) * chunks * (d + 2);
  float top = -INFINITY;
  for (int c = 0; c < chunks; ++c) top = fmaxf(top, p[c * (d + 2) + d]);
  float total = 0.0f;
  for (int c = 0; c < chunks; ++c) {
    const float m = p[c * (d + 2) + d];
    if (m > -INFINITY) total += p[c * (d + 2) + d + 1] * __expf(m - top);
  }
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float y = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      const float m = p[c * (d + 2) + d];
      if (m > -INFINITY) y += p[c * (d + 2) + e] * __expf(m - top);
    }
    out[((long long)i * heads + h) * d + e] = y / total;
  }
}
