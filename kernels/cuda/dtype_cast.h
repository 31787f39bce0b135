// float <-> storage-type conversions shared by the lcx CUDA kernels (float32, float16, bfloat16).
//
// Included inside each kernel file's anonymous namespace, after <cuda_fp16.h> and <cuda_bf16.h>;
// it includes nothing itself, so the kernels stay buildable with a bare `nvcc -c file.cu` and
// with the host emulation of the CUDA built-ins in tests/kernels/cuda_emu.
#pragma once

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
