// Host emulation (see cuda_runtime.h): bfloat16 as the top 16 bits of a float32 (round to
// nearest even on conversion, as __float2bfloat16_rn).
#pragma once
#include "cuda_runtime.h"
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { uint16_t bits; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return {__bfloat162float(b.x), __bfloat162float(b.y)}; }
