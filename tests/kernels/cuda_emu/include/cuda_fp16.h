// Host emulation (see cuda_runtime.h): IEEE half through the compiler's _Float16.
#pragma once
#include "cuda_runtime.h"
struct __half { _Float16 v; };
struct __half2 { __half x, y; };
inline float __half2float(__half h) { return static_cast<float>(h.v); }
inline __half __float2half_rn(float f) { return __half{static_cast<_Float16>(f)}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
