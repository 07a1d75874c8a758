// A decode step's small fused operations on the GPU (model/src/gpu_ops.rs launches them).
//
// ragkv_rope_store_*: the joined Q/K/V projection's output rows (n, (heads + 2 kv_heads) d)
// in one launch: queries rotated into q_out (heads, n_total, d) at rows row0.., keys rotated
// and values copied into the cache (kv_heads, capacity, d) at rows at.., converted to the
// cache's type. Block (r, c): row r, head slot c (queries, then keys, then values); thread i
// turns pair i (the halves i and i + d/2, or the neighbours 2i and 2i + 1).
//
// `past`, when not null, holds `at` in device memory (a CUDA graph's replay). `rows_at`, when
// not null, holds each row's cache index instead of at + r (rows recomputed in place).
//
// ragkv_rmsnorm: rows (n, dim) normed by their root mean square and scaled by w, one block
// per row (candle's spends 32 threads on a row: 12 µs per call at SmolLM2's width on an H100).
//
// ragkv_swiglu: silu(gate) * up over the joined gate/up projection's rows (n, 2 w).
//
// ragkv_rmsnorm_q8: ragkv_rmsnorm's rows, the residual `delta` added first where given (the
// sum written to x_out), quantized as candle's quantized products take their input: blocks of
// 32 elements, each an f16 pair (scale amax / 127, sum of the block's values) and 32 int8
// (`block_q8_1`, 36 bytes), a row padded with zero blocks to kpad elements. The product then
// reads it directly: the norm, the add before it and the quantization are one launch.
// ragkv_swiglu_q8 (below) does the same for the MLP's gate before the down projection.

#include <cuda_fp16.h>

__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }

template <typename T>
__device__ void rope_store(const float* __restrict__ y, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, float* __restrict__ q_out,
                           T* __restrict__ kc, T* __restrict__ vc, long long kv_head,
                           long long kv_row, int n_total, int row0, int at, int heads,
                           int kv_heads, int d, int interleaved, const int* past,
                           const int* rows_at) {
  if (past) at = *past;
  const int r = blockIdx.x, c = blockIdx.y, half_d = d / 2;
  const float* src = y + (long long)r * (heads + 2 * kv_heads) * d + (long long)c * d;
  for (int i = threadIdx.x; i < half_d; i += blockDim.x) {
    const int i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half_d;
    float a = src[i0], b = src[i1];
    if (c < heads + kv_heads) {
      const float co = cos_t[r * half_d + i], si = sin_t[r * half_d + i];
      const float o0 = a * co - b * si, o1 = b * co + a * si;
      a = o0;
      b = o1;
    }
    if (c < heads) {
      float* dst = q_out + ((long long)c * n_total + row0 + r) * d;
      dst[i0] = a;
      dst[i1] = b;
    } else {
      const bool key = c < heads + kv_heads;
      const int g = key ? c - heads : c - heads - kv_heads;
      const long long row = rows_at ? rows_at[r] : at + r;
      T* dst = (key ? kc : vc) + g * kv_head + row * kv_row;
      store(dst + i0, a);
      store(dst + i1, b);
    }
  }
}

// The kernel for each cache type, by its C name.
#define RAGKV_ROPE_STORE(NAME, T)                                                               \
  extern "C" __global__ void NAME(const float* y, const float* cos_t, const float* sin_t,      \
                                  float* q_out, T* kc, T* vc, long long kv_head,               \
                                  long long kv_row, int n_total, int row0, int at, int heads,  \
                                  int kv_heads, int d, int interleaved, const int* past,       \
                                  const int* rows_at) {                                        \
    rope_store<T>(y, cos_t, sin_t, q_out, kc, vc, kv_head, kv_row, n_total, row0, at, heads,  \
                  kv_heads, d, interleaved, past, rows_at);                                    \
  }

RAGKV_ROPE_STORE(ragkv_rope_store_f16, __half)
RAGKV_ROPE_STORE(ragkv_rope_store_f32, float)

extern "C" __global__ void ragkv_swiglu(const float* __restrict__ gu, float* __restrict__ out,
                                        int n, int w) {
  const long long total = (long long)n * w;
  for (long long x = blockIdx.x * (long long)blockDim.x + threadIdx.x; x < total;
       x += (long long)gridDim.x * blockDim.x) {
    const long long r = x / w, j = x % w;
    const float g = gu[r * 2 * w + j], u = gu[r * 2 * w + w + j];
    out[x] = g / (1.0f + __expf(-g)) * u;
  }
}

// The sum of `x` over the block's threads (a multiple of 32, at most 1024), for every thread;
// once per kernel (its shared memory is not reused).
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float red[32];
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) red[warp] = x;
  __syncthreads();
  x = lane < warps ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// One block_q8_1 of a warp's 32 values (lane l holds element l), as candle's quantize_q8_1
// writes it: scale amax / 127, the values rounded to int8, the scale and the values' sum as an
// f16 pair first.
__device__ __forceinline__ void store_q8_block(float v, unsigned char* blk, unsigned lane) {
  float amax = fabsf(v), sum = v;
  for (int o = 16; o > 0; o >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  const float d = amax / 127.0f;
  const signed char q = amax == 0.0f ? 0 : (signed char)roundf(v / d);
  blk[4 + lane] = (unsigned char)q;
  if (lane == 0)
    *reinterpret_cast<__half2*>(blk) = __halves2half2(__float2half(d), __float2half(sum));
}

extern "C" __global__ void ragkv_rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ out, int dim, float eps) {
  const float* xr = x + (long long)blockIdx.x * dim;
  float* yr = out + (long long)blockIdx.x * dim;
  float ss = 0.0f;
  for (int e = threadIdx.x; e < dim; e += blockDim.x) ss += xr[e] * xr[e];
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  for (int e = threadIdx.x; e < dim; e += blockDim.x) yr[e] = xr[e] * inv * w[e];
}

// One block per row, a multiple of 32 threads. Thread tid holds elements tid + k blockDim.x
// in registers (k < 8) between the sum of squares and the quantization: warp w's lanes are
// then exactly block w + k warps's 32 elements.
extern "C" __global__ void ragkv_rmsnorm_q8(const float* __restrict__ x,
                                            const float* __restrict__ delta,
                                            float* __restrict__ x_out,
                                            const float* __restrict__ w,
                                            unsigned char* __restrict__ yq, int dim, int kpad,
                                            float eps) {
  constexpr int HELD = 8;
  const long long row = blockIdx.x;
  const float* xr = x + row * dim;
  const float* dr = delta ? delta + row * dim : nullptr;
  float held[HELD];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < HELD; ++k) {
    const int e = threadIdx.x + k * blockDim.x;
    held[k] = 0.0f;
    if (e < dim) {
      const float v = dr ? xr[e] + dr[e] : xr[e];
      if (x_out) x_out[row * dim + e] = v;
      held[k] = v;
      ss += v * v;
    }
  }
  for (int e = threadIdx.x + HELD * blockDim.x; e < dim; e += blockDim.x) {
    const float v = dr ? xr[e] + dr[e] : xr[e];
    if (x_out) x_out[row * dim + e] = v;
    ss += v * v;
  }
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const float inv = rsqrtf(block_sum(ss) / dim + eps);
  // A warp per 32-element block: lane l quantizes element 32 ib + l.
  unsigned char* qrow = yq + row * (long long)(kpad / 32) * 36;
  const int blocks = kpad / 32;
#pragma unroll
  for (int k = 0; k <= HELD; ++k) {
    // k < HELD: the block whose elements this warp holds; k == HELD: every later block, its
    // elements read again.
    for (int ib = warp + k * warps; ib < blocks; ib += warps) {
      const int e = ib * 32 + lane;
      float v = 0.0f;
      if (e < dim) v = (k < HELD ? held[k] : (dr ? xr[e] + dr[e] : xr[e])) * inv * w[e];
      store_q8_block(v, qrow + (long long)ib * 36, lane);
      if (k < HELD) break;  // one block per held register
    }
  }
}

// ragkv_swiglu_q8: ragkv_swiglu's output quantized as ragkv_rmsnorm_q8's (rows of kpad
// elements in block_q8_1, zero past w), for the down projection's product. A warp per block
// of 32 outputs; grid (rows, blocks / warps per block).
extern "C" __global__ void ragkv_swiglu_q8(const float* __restrict__ gu,
                                           unsigned char* __restrict__ yq, int w, int kpad) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int ib = blockIdx.y * warps + (threadIdx.x >> 5);
  if (ib >= kpad / 32) return;  // a whole warp leaves together
  const long long r = blockIdx.x;
  const int j = ib * 32 + lane;
  float v = 0.0f;
  if (j < w) {
    const float g = gu[r * 2 * w + j], u = gu[r * 2 * w + w + j];
    v = g / (1.0f + __expf(-g)) * u;
  }
  store_q8_block(v, yq + (r * (kpad / 32) + ib) * 36, lane);
}
