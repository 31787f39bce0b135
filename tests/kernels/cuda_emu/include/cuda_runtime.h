// Host emulation of the few CUDA built-ins lcx's .cu kernels use, so a kernel file compiles with
// g++ and runs on CPU threads in tests (tests/kernels/test_cuda_kernels.py, no GPU needed). Not a CUDA
// implementation: one block at a time, one std::thread per CUDA thread, __syncthreads and warp
// shuffles by barriers (valid for kernels whose shuffles run in warp-uniform control flow, which
// the kernels assert by construction). Shared memory is NaN-filled before each block so reads of
// unwritten shared memory poison the output.
#pragma once
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <math.h>
#include <stdexcept>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(x)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3 { unsigned x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };

typedef void* cudaStream_t;
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

namespace lcx_emu {
constexpr size_t kSmemFloats = 1 << 16;  // 256 KiB, more than any real block may use
inline float g_smem[kSmemFloats];
inline thread_local uint3 t_thread{0, 0, 0};
inline uint3 g_block{0, 0, 0};
inline dim3 g_block_dim;
inline std::barrier<>* g_block_barrier = nullptr;
inline std::vector<std::barrier<>*> g_warp_barriers;
inline float g_xchg[1024];
}  // namespace lcx_emu

#define threadIdx (lcx_emu::t_thread)
#define blockIdx (lcx_emu::g_block)
#define blockDim (lcx_emu::g_block_dim)
// the kernel's dynamic shared memory is this buffer
#define LCX_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(lcx_emu::g_smem)

inline void __syncthreads() { lcx_emu::g_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  if (mask != 0xffffffffu) throw std::logic_error("emulated shuffle: full-warp masks only");
  const unsigned t = threadIdx.x, warp = t / 32, lane = t % 32;
  auto* bar = lcx_emu::g_warp_barriers[warp];
  lcx_emu::g_xchg[t] = v;
  bar->arrive_and_wait();
  const float r = lcx_emu::g_xchg[warp * 32 + (lane ^ lane_mask)];
  bar->arrive_and_wait();
  return r;
}

template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

// Run every block of `grid` in turn, each as block.x std::threads calling kernel(args...).
template <typename... P, typename... A>
void lcx_emulate_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes, A... args) {
  using namespace lcx_emu;
  if (block.y != 1 || block.z != 1 || block.x > 1024 || block.x % 32)
    throw std::logic_error("emulated launch: 1-D blocks of whole warps only");
  if (smem_bytes > 48 * 1024) throw std::logic_error("emulated launch: > 48 KiB dynamic shared memory");
  g_block_dim = block;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        g_block = {x, y, z};
        for (size_t i = 0; i < kSmemFloats; ++i) g_smem[i] = std::numeric_limits<float>::quiet_NaN();
        std::barrier<> block_bar(block.x);
        std::vector<std::barrier<>*> warps;
        for (unsigned w = 0; w < block.x / 32; ++w) warps.push_back(new std::barrier<>(32));
        g_block_barrier = &block_bar;
        g_warp_barriers = warps;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block.x; ++t)
          threads.emplace_back([=] {
            lcx_emu::t_thread = {t, 0, 0};
            kernel(args...);
          });
        for (auto& th : threads) th.join();
        for (auto* w : warps) delete w;
      }
}

#define LCX_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  lcx_emulate_launch(kernel, dim3(grid), dim3(block), smem_bytes, __VA_ARGS__)
