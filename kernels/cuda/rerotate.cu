// Re-rotation of cached keys by a per-token position delta, k <- R(delta) k (PIE), in CUDA C++.
//
// Self-contained: CUDA toolkit headers and dtype_cast.h beside it, no torch, so it compiles with a bare
// `nvcc -arch=sm_80 -c rerotate.cu` (and sm_90). The torch binding lives in
// rerotate_binding.cpp and is built only on CUDA machines (lcx.kernels.cuda.load_extension).
//
// Semantics are those of lcx.cache.rerotate.rerotate_ref:
//   k:     [B, T, H, D] with arbitrary element strides (the HF cache's [B, H, T, D] keys are
//          passed as their transposed view), float32 / float16 / bfloat16.
//   delta: [B, T] int64 element strides (batch stride 0 broadcasts one delta row).
//   inv_turns: [half] float64 contiguous, inv_freq / (2 pi); rotary dim r = 2 * half <= D.
//   out:   [B, T, H, D], may alias k exactly (in place); channels r..D-1 are copied when
//          n_pass > 0 (out-of-place) and left alone otherwise.
// Rotary pairs are (i, i + half): (x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin).
//
// Precision: turns = delta * inv_turns in double (exact integer delta below 2^53), reduced to
// the fractional turn and scaled to radians in double, then sincosf (the accurate one: do not
// build with --use_fast_math, which swaps in __sincosf) on [-pi, pi]: ~1e-7 rad at any delta.
//
// Launch: one block per (slot t, batch b); the block computes the half cos/sin values of its
// slot once into shared memory and reuses them for all heads.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace {

#include "dtype_cast.h"  // to_float / from_float

struct Strides4 {
  int64_t b, t, h, d;
};

// No __restrict__ on k/out: they alias when rotating in place (each element is read and
// written by the same thread, so aliasing is safe).
template <typename scalar_t>
__global__ void rerotate_kernel(const scalar_t* k, scalar_t* out, const int64_t* delta,
                                const double* inv_turns, int64_t T, int64_t H, int half,
                                int n_pass, Strides4 ks, Strides4 os, int64_t sdb, int64_t sdt) {
  extern __shared__ float cs[];  // [2 * half]: cos then sin
  const int64_t t = blockIdx.x;
  const int64_t b = blockIdx.y;
  if (t >= T) return;
  const int64_t dpos = delta[b * sdb + t * sdt];
  for (int f = threadIdx.x; f < half; f += blockDim.x) {
    const double turns = static_cast<double>(dpos) * inv_turns[f];
    const double frac = turns - floor(turns + 0.5);  // in [-1/2, 1/2]
    const float ang = static_cast<float>(frac * 6.283185307179586);  // one rounding to float
    float s, c;
    sincosf(ang, &s, &c);
    cs[f] = c;
    cs[half + f] = s;
  }
  __syncthreads();
  const scalar_t* krow = k + b * ks.b + t * ks.t;
  scalar_t* orow = out + b * os.b + t * os.t;
  const int64_t n_pairs = H * half;
  for (int64_t i = threadIdx.x; i < n_pairs; i += blockDim.x) {
    const int64_t h = i / half;
    const int f = static_cast<int>(i - h * half);
    const float x1 = to_float(krow[h * ks.h + f * ks.d]);
    const float x2 = to_float(krow[h * ks.h + (f + half) * ks.d]);
    const float c = cs[f], s = cs[half + f];
    orow[h * os.h + f * os.d] = from_float<scalar_t>(x1 * c - x2 * s);
    orow[h * os.h + (f + half) * os.d] = from_float<scalar_t>(x2 * c + x1 * s);
  }
  if (n_pass > 0) {
    const int64_t n_copy = H * n_pass;
    for (int64_t i = threadIdx.x; i < n_copy; i += blockDim.x) {
      const int64_t h = i / n_pass;
      const int64_t d = 2 * half + (i - h * n_pass);
      orow[h * os.h + d * os.d] = krow[h * ks.h + d * ks.d];
    }
  }
}

template <typename scalar_t>
int launch_typed(const void* k, void* out, const int64_t* delta, const double* inv_turns, int64_t B,
                 int64_t T, int64_t H, int half, int n_pass, Strides4 ks, Strides4 os, int64_t sdb,
                 int64_t sdt, cudaStream_t stream) {
  const int threads = 128;
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(B));
  const size_t smem = 2 * static_cast<size_t>(half) * sizeof(float);
  rerotate_kernel<scalar_t><<<grid, threads, smem, stream>>>(
      static_cast<const scalar_t*>(k), static_cast<scalar_t*>(out), delta, inv_turns, T, H, half,
      n_pass, ks, os, sdb, sdt);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16. Strides are in elements: k_strides/out_strides =
// {b, t, h, d}. Returns a cudaError_t value (0 = success), or -1 for a bad argument.
extern "C" int lcx_rerotate_launch(int dtype, const void* k, void* out, const int64_t* delta,
                                   const double* inv_turns, int64_t B, int64_t T, int64_t H,
                                   int64_t D, int64_t half, const int64_t* k_strides,
                                   const int64_t* out_strides, int64_t delta_stride_b,
                                   int64_t delta_stride_t, void* stream) {
  if (B <= 0 || T <= 0) return 0;
  if (H <= 0 || half <= 0 || 2 * half > D || B > 65535 || T > 2147483647LL) return -1;
  const Strides4 ks{k_strides[0], k_strides[1], k_strides[2], k_strides[3]};
  const Strides4 os{out_strides[0], out_strides[1], out_strides[2], out_strides[3]};
  const int n_pass = (out == k && ks.b == os.b && ks.t == os.t && ks.h == os.h && ks.d == os.d)
                         ? 0
                         : static_cast<int>(D - 2 * half);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int h = static_cast<int>(half);
  switch (dtype) {
    case 0:
      return launch_typed<float>(k, out, delta, inv_turns, B, T, H, h, n_pass, ks, os,
                                 delta_stride_b, delta_stride_t, s);
    case 1:
      return launch_typed<__half>(k, out, delta, inv_turns, B, T, H, h, n_pass, ks, os,
                                  delta_stride_b, delta_stride_t, s);
    case 2:
      return launch_typed<__nv_bfloat16>(k, out, delta, inv_turns, B, T, H, h, n_pass, ks, os,
                                         delta_stride_b, delta_stride_t, s);
    default:
      return -1;
  }
}
