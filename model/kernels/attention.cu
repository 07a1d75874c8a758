// Causal attention of a few query rows over one sequence's KV cache, one launch per layer: the
// GPU path's decode and question-prefill attention (model/src/attention/cuda.rs launches it).
//
// Block (h, i): query head h, query row i, which sits at cache index t - s + i and sees keys
// lo..=that index (lo > 0 inside a sliding window). Pass 1: each thread scores keys strided by
// the block size into shared memory (f32), tracking the maximum; pass 2: exponentials and their
// sum; pass 3: thread (e, part) sums part's share of the keys for output element e; the parts
// are added at the end. Grouped-query attention: head h reads KV head h / (heads / kv_heads).
// Scores live in shared memory, so the launcher only takes caches whose visible span fits.
// A CUDA graph replays a decode step with the cache's length in device memory: `past`, when
// not null, holds the rows before this step's (then t = *past + s, whatever `t` says).

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
// out: (s, heads, d) contiguous f32.
// Shared memory: d (the scaled query) + span (scores) + blockDim.x (partial sums) + 32 floats.
template <typename T>
__device__ void attend(const float* __restrict__ q, long long q_head, long long q_row,
                       const T* __restrict__ k, const T* __restrict__ v, long long kv_head,
                       long long kv_row, float* __restrict__ out, int s, int t, int heads,
                       int kv_heads, int d, int window, float scale, const int* past) {
  extern __shared__ float smem[];
  if (past) t = *past + s;
  const int h = blockIdx.x, i = blockIdx.y;
  const int g = h / (heads / kv_heads);
  const int pos = t - s + i;
  const int lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int n = pos - lo + 1;
  float* qs = smem;
  float* sc = qs + d;
  float* part = sc + n;
  float* red = part + blockDim.x;
  const int tid = threadIdx.x, nt = blockDim.x;

  for (int e = tid; e < d; e += nt) qs[e] = q[h * q_head + i * q_row + e] * scale;
  __syncthreads();

  const T* kb = k + g * kv_head + (long long)lo * kv_row;
  float mx = -INFINITY;
  for (int j = tid; j < n; j += nt) {
    const T* kr = kb + (long long)j * kv_row;
    float acc = 0.0f;
    for (int e = 0; e < d; ++e) acc += qs[e] * to_f32(kr[e]);
    sc[j] = acc;
    mx = fmaxf(mx, acc);
  }
  mx = block_reduce<true>(mx, red);

  float sum = 0.0f;
  for (int j = tid; j < n; j += nt) {
    float p = __expf(sc[j] - mx);
    sc[j] = p;
    sum += p;
  }
  sum = block_reduce<false>(sum, red);  // its barriers also publish sc[]

  // Thread (e, p): output element e over the keys j = p, p + parts, ...
  const int parts = max(1, nt / d);
  const T* vb = v + g * kv_head + (long long)lo * kv_row;
  for (int e0 = 0; e0 < d; e0 += nt) {  // more than one round only when d > blockDim.x
    const int e = e0 + tid % min(d, nt), p = tid / min(d, nt);
    float acc = 0.0f;
    if (e < d && p < parts) {
      for (int j = p; j < n; j += parts) acc += sc[j] * to_f32(vb[(long long)j * kv_row + e]);
    }
    part[tid] = acc;
    __syncthreads();
    if (tid < min(d, nt) && e0 + tid < d) {
      float y = 0.0f;
      for (int q2 = 0; q2 < parts; ++q2) y += part[q2 * min(d, nt) + tid];
      out[((long long)i * heads + h) * d + e0 + tid] = y / sum;
    }
    __syncthreads();
  }
}

// The kernel for each cache type, by its C name.
#define RAGKV_ATTEND(NAME, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(1024)                                          \
      NAME(const float* q, long long q_head, long long q_row, const T* k, const T* v,         \
           long long kv_head, long long kv_row, float* out, int s, int t, int heads,          \
           int kv_heads, int d, int window, float scale, const int* past) {                   \
    attend<T>(q, q_head, q_row, k, v, kv_head, kv_row, out, s, t, heads, kv_heads, d, window, \
              scale, past);                                                                   \
  }

RAGKV_ATTEND(ragkv_attend_f16, __half)
RAGKV_ATTEND(ragkv_attend_f32, float)
