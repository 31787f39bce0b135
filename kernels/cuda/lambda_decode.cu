// Λ-attention decode (LM-Infinite, arXiv 2308.16137) for one query token per row, over a
// cache of UNROTATED keys, in CUDA C++ (split-K "flash-decoding" + log-sum-exp combine).
//
// Self-contained (CUDA toolkit headers + lambda_decode.h, dtype_cast.h; no torch): compiles with a bare
// `nvcc -arch=sm_80 -c lambda_decode.cu` (and sm_90). The torch binding is
// lambda_decode_binding.cpp, built on CUDA machines by lcx.kernels.cuda.lambda_decode.
//
// Semantics: those of lcx.attention.reference.lambda_attention_ref (and attention_ref for
// causal / sliding-window / sink masks) with Tq = 1, softmax:
//   local key j (in the window):   s_j = scale * (a R(p_i) q) . (a R(p_j) k_j)
//   global key j (capped Λ only):  s_j = scale * (a R(d) q) . (a R(0) k_j),  d = min(cap, Tk-1)
//   out = sum_j softmax(s)_j v_j,  lse = log sum_j exp(s_j)
// a = attention_factor (rotary channels only; channels 2*half..D-1 pass through).
//
// Keys are rotated on the fly without pairing channels across threads: for a rotary pair
// (x1, x2) of key j, (R(p_j) k) . y = k . R(-p_j) y, so the score is
//   s_j = sum_d k_jd * (c_jf * y_d + s_jf * yJ_d),   f = d mod half,
//   yJ_d = y_{d+half} (d < half), -y_{d-half} (half <= d < 2 half), 0 on pass channels,
// where y = scale * a R(p_i) q is formed once per block and (c, s) = a (cos, sin)(p_j theta_f)
// come from host tables (float64 angles rounded once to float32: exact at any position).
// Each thread reads only its own 16-byte slice of k_j: 2 FMAs per channel per query head.
//
// Work split: grid (S splits, H / HPB head tiles, B). A block owns HPB query heads of ONE kv
// head (GQA: each key/value is read once per head tile, i.e. once when HPB = H / Hkv <= 8)
// and a contiguous run of `chunk` visible keys. Inside a block, 4 warps are cut into groups
// of TPK threads, KT keys per group per step (TPK * 16 bytes = one key row), each group with
// its own online-softmax state (log2 domain); the groups merge in shared memory at the end.
// With S > 1 each block writes a normalised partial (o, lse) and lambda_decode_combine merges
// the S partials (merge_attention's rule: weights exp(lse_s - lse)).
//
// Only visible keys are read: [0, g_hi) (global) and [w_lo, w_hi) (window), so a full cache
// costs what the bounded one does.

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "lambda_decode.h"

// Launch and dynamic shared memory go through these two macros so that tests can run this very
// file on CPU threads (tests/kernels/cuda_emu/include: a host emulation of the CUDA built-ins used here).
#ifndef LCX_LAUNCH
#define LCX_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<grid, block, smem_bytes, stream>>>(__VA_ARGS__)
#endif
#ifndef LCX_DYNAMIC_SMEM
#define LCX_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------- loads / stores
template <typename T> struct VecOf;  // 16 bytes of T
template <> struct VecOf<float> { static constexpr int n = 4; };
template <> struct VecOf<__half> { static constexpr int n = 8; };
template <> struct VecOf<__nv_bfloat16> { static constexpr int n = 8; };

// One 16-byte load per thread per row (kept raw until used, so several are in flight at once).
template <typename T> __device__ __forceinline__ uint4 load_raw(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}
template <typename T> __device__ __forceinline__ void unpack16(const uint4& raw, float* out);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& raw, float* out) {
  out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& raw, float* out) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x; out[2 * i + 1] = f.y;
  }
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& raw, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x; out[2 * i + 1] = f.y;
  }
}

#include "dtype_cast.h"  // to_float / from_float

// ---------------------------------------------------------------------------- geometry
template <typename T, int D, int HPB> struct Geometry {
  static constexpr int VEC = VecOf<T>::n;            // channels per 16-byte load
  static constexpr int TPK_FULL = D / VEC;           // threads to cover one row with one load each
  static constexpr int TPK = TPK_FULL < 32 ? TPK_FULL : 32;  // threads per key (group size)
  static constexpr int NV = D / (VEC * TPK);         // loads per thread per row
  static constexpr int EPT = NV * VEC;               // channels per thread
  static constexpr int KPW = 32 / TPK;               // groups (keys in flight) per warp
  static constexpr int NGROUPS = kWarps * KPW;
  static_assert(D % VEC == 0 && (TPK & (TPK - 1)) == 0 && D == NV * VEC * TPK, "head dim");
  // shared memory (floats): prologue q coefficients, then reused by the group merge
  static constexpr int SMEM_Q = 3 * HPB * D;
  static constexpr int SMEM_MERGE = NGROUPS * HPB * (D + 2);
  static constexpr int SMEM = SMEM_Q > SMEM_MERGE ? SMEM_Q : SMEM_MERGE;
  // channel of a thread's e-th element (t: thread index inside its group)
  __device__ static __forceinline__ int channel(int t, int e) {
    return ((e / VEC) * TPK + t) * VEC + (e % VEC);
  }
};

template <typename T, int D, int HPB>
__global__ void __launch_bounds__(kThreads)
lambda_decode_kernel(const LcxLambdaDecodeArgs a) {
  using G = Geometry<T, D, HPB>;
  LCX_DYNAMIC_SMEM(float, smem);
  const int64_t s = blockIdx.x;
  const int64_t h0 = static_cast<int64_t>(blockIdx.y) * HPB;
  const int64_t b = blockIdx.z;
  const int64_t kvh = h0 / (a.H / a.Hkv);
  const int half = static_cast<int>(a.half), rot = 2 * half;
  const float* qtab = a.qtab == nullptr ? nullptr : a.qtab + b * a.qtab_sb;

  // ---- prologue: per-head query coefficients (float32, scale * log2 e folded in)
  float* qa = smem;                // [HPB][D]  y = a R(p_i) q            (local keys)
  float* qb = smem + HPB * D;      // [HPB][D]  yJ (0 on pass channels)    (local keys)
  float* qg = smem + 2 * HPB * D;  // [HPB][D]  a^2 R(d) q                (capped global keys)
  const T* qbase = static_cast<const T*>(a.q) + b * a.q_sb;
  for (int idx = threadIdx.x; idx < HPB * D; idx += kThreads) {
    const int hh = idx / D, d = idx - hh * D;
    const T* qrow = qbase + (h0 + hh) * a.q_sh;
    const float x = to_float(qrow[d]);
    if (d < rot) {
      const bool lo = d < half;
      const int f = lo ? d : d - half;
      const float xp = to_float(qrow[lo ? d + half : d - half]);
      const float c = qtab[f], sn = qtab[half + f];
      const float cc = qtab[2 * half + f], sc = qtab[3 * half + f];
      // rotate_half convention: y1 = x1 c - x2 s, y2 = x2 c + x1 s
      const float y = lo ? x * c - xp * sn : x * c + xp * sn;
      const float yp = lo ? xp * c + x * sn : xp * c - x * sn;  // the partner channel of y
      qa[idx] = y * a.scale_log2;
      qb[idx] = (lo ? yp : -yp) * a.scale_log2;
      qg[idx] = (lo ? x * cc - xp * sc : x * cc + xp * sc) * a.scale_log2;
    } else {
      qa[idx] = x * a.scale_log2;
      qb[idx] = 0.f;
      qg[idx] = x * a.scale_log2;
    }
  }
  __syncthreads();

  // ---- main loop over this split's visible keys
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int grp = warp * G::KPW + lane / G::TPK;  // group index in the block
  const int t = lane % G::TPK;                    // thread index in the group
  const int64_t n_vis = a.g_hi + (a.w_hi - a.w_lo);
  const int64_t v_begin = s * a.chunk;
  const int64_t v_end = min(n_vis, v_begin + a.chunk);
  const T* kbase = static_cast<const T*>(a.k) + b * a.k_sb + kvh * a.k_sh;
  const T* vbase = static_cast<const T*>(a.v) + b * a.v_sb + kvh * a.v_sh;
  const float* kcos = a.kcos == nullptr ? nullptr : a.kcos + b * a.tab_sb;
  const float* ksin = a.ksin == nullptr ? nullptr : a.ksin + b * a.tab_sb;

  float m[HPB], l[HPB], acc[HPB][G::EPT];
#pragma unroll
  for (int hh = 0; hh < HPB; ++hh) {
    m[hh] = -INFINITY;
    l[hh] = 0.f;
#pragma unroll
    for (int e = 0; e < G::EPT; ++e) acc[hh][e] = 0.f;
  }

  // Each step a group takes KT keys (v, v + NGROUPS, ...): all their loads are issued before
  // any arithmetic (memory-level parallelism), and the running max/sum is rescaled once per
  // step instead of once per key. The trip count is uniform across the warp (the shuffles
  // need every lane); a key past the end loads nothing and scores -inf (weight 0).
  constexpr int KT = 2;
  for (int64_t vw = v_begin + warp * G::KPW; vw < v_end; vw += KT * G::NGROUPS) {
    int64_t jj[KT];
    bool valid[KT], glob[KT];
    uint4 kraw[KT][G::NV], vraw[KT][G::NV];
#pragma unroll
    for (int u = 0; u < KT; ++u) {
      const int64_t vi = vw + u * G::NGROUPS + lane / G::TPK;
      valid[u] = vi < v_end;
      jj[u] = vi < a.g_hi ? vi : a.w_lo + (vi - a.g_hi);
      glob[u] = a.capped && vi < a.g_hi;
#pragma unroll
      for (int n = 0; n < G::NV; ++n) {
        const int d0 = (n * G::TPK + t) * G::VEC;
        kraw[u][n] = valid[u] ? load_raw<T>(kbase + jj[u] * a.k_st + d0) : uint4{0u, 0u, 0u, 0u};
        vraw[u][n] = valid[u] ? load_raw<T>(vbase + jj[u] * a.v_st + d0) : uint4{0u, 0u, 0u, 0u};
      }
    }
    float sc[KT][HPB];  // log2-domain scores
#pragma unroll
    for (int u = 0; u < KT; ++u) {
      float kc[G::EPT], ks[G::EPT];
#pragma unroll
      for (int n = 0; n < G::NV; ++n) unpack16<T>(kraw[u][n], kc + n * G::VEC);
#pragma unroll
      for (int e = 0; e < G::EPT; ++e) ks[e] = 0.f;
      if (valid[u] && !glob[u] && rot > 0) {
        const float* cr = kcos + jj[u] * a.half;
        const float* sr = ksin + jj[u] * a.half;
#pragma unroll
        for (int e = 0; e < G::EPT; ++e) {
          const int d = G::channel(t, e);
          if (d < rot) {
            const int f = d < half ? d : d - half;
            const float c = __ldg(cr + f), sn = __ldg(sr + f);
            ks[e] = kc[e] * sn;
            kc[e] = kc[e] * c;
          }
        }
      }
      const float* qsel = glob[u] ? qg : qa;
#pragma unroll
      for (int hh = 0; hh < HPB; ++hh) {
        float part = 0.f;
#pragma unroll
        for (int e = 0; e < G::EPT; ++e) {
          const int d = G::channel(t, e);
          part = fmaf(kc[e], qsel[hh * D + d], part);
          if (!glob[u]) part = fmaf(ks[e], qb[hh * D + d], part);
        }
#pragma unroll
        for (int off = G::TPK / 2; off > 0; off /= 2) part += __shfl_xor_sync(0xffffffffu, part, off);
        sc[u][hh] = valid[u] ? part : -INFINITY;
      }
    }
    float vv[KT][G::EPT];
#pragma unroll
    for (int u = 0; u < KT; ++u)
#pragma unroll
      for (int n = 0; n < G::NV; ++n) unpack16<T>(vraw[u][n], vv[u] + n * G::VEC);
#pragma unroll
    for (int hh = 0; hh < HPB; ++hh) {
      float m_new = m[hh];
#pragma unroll
      for (int u = 0; u < KT; ++u) m_new = fmaxf(m_new, sc[u][hh]);
      if (m_new == -INFINITY) continue;  // no key of this group yet
      const float corr = exp2f(m[hh] - m_new);  // 0 while m = -inf
      float p[KT], psum = 0.f;
#pragma unroll
      for (int u = 0; u < KT; ++u) {
        p[u] = exp2f(sc[u][hh] - m_new);  // 0 for a key past the end
        psum += p[u];
      }
      l[hh] = fmaf(l[hh], corr, psum);
#pragma unroll
      for (int e = 0; e < G::EPT; ++e) {
        float x = acc[hh][e] * corr;
#pragma unroll
        for (int u = 0; u < KT; ++u) x = fmaf(p[u], vv[u][e], x);
        acc[hh][e] = x;
      }
      m[hh] = m_new;
    }
  }

  // ---- merge the groups of the block (shared memory reused: the q coefficients are dead)
  __syncthreads();
  float* sm_acc = smem;                                // [NGROUPS][HPB][D]
  float* sm_m = smem + G::NGROUPS * HPB * D;           // [NGROUPS][HPB]
  float* sm_l = sm_m + G::NGROUPS * HPB;               // [NGROUPS][HPB]
#pragma unroll
  for (int hh = 0; hh < HPB; ++hh) {
#pragma unroll
    for (int e = 0; e < G::EPT; ++e) sm_acc[(grp * HPB + hh) * D + G::channel(t, e)] = acc[hh][e];
    if (t == 0) {
      sm_m[grp * HPB + hh] = m[hh];
      sm_l[grp * HPB + hh] = l[hh];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < HPB * D; idx += kThreads) {
    const int hh = idx / D, d = idx - hh * D;
    float M = -INFINITY;
    for (int g = 0; g < G::NGROUPS; ++g) M = fmaxf(M, sm_m[g * HPB + hh]);
    float L = 0.f, O = 0.f;
    if (M > -INFINITY) {
      for (int g = 0; g < G::NGROUPS; ++g) {
        const float mg = sm_m[g * HPB + hh];
        const float w = mg > -INFINITY ? exp2f(mg - M) : 0.f;
        L = fmaf(sm_l[g * HPB + hh], w, L);
        O = fmaf(sm_acc[(g * HPB + hh) * D + d], w, O);
      }
    }
    const float o = L > 0.f ? O / L : 0.f;
    const float lse = L > 0.f ? (M + log2f(L)) * kLn2 : -INFINITY;
    const int64_t h = h0 + hh;
    if (a.n_splits == 1) {
      static_cast<T*>(a.out)[b * a.o_sb + h * a.o_sh + d] = from_float<T>(o);
      if (d == 0) a.lse[b * a.lse_sb + h * a.lse_sh] = lse;
    } else {
      const int64_t row = (b * a.H + h) * a.n_splits + s;
      a.ws_o[row * D + d] = o;
      if (d == 0) a.ws_lse[row] = lse;
    }
  }
}

// Merge S normalised partials of one (b, h): lse = log sum exp(lse_s), o = sum exp(lse_s - lse) o_s.
template <typename T>
__global__ void __launch_bounds__(kThreads)
lambda_decode_combine(const LcxLambdaDecodeArgs a, int D) {
  const int64_t h = blockIdx.x, b = blockIdx.y, S = a.n_splits;
  const float* ls = a.ws_lse + (b * a.H + h) * S;
  const float* os = a.ws_o + (b * a.H + h) * S * D;
  float M = -INFINITY;
  for (int64_t i = 0; i < S; ++i) M = fmaxf(M, ls[i]);
  float Z = 0.f;
  if (M > -INFINITY)
    for (int64_t i = 0; i < S; ++i) Z += ls[i] > -INFINITY ? expf(ls[i] - M) : 0.f;
  const float lse = Z > 0.f ? M + logf(Z) : -INFINITY;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float o = 0.f;
    if (Z > 0.f)
      for (int64_t i = 0; i < S; ++i)
        if (ls[i] > -INFINITY) o = fmaf(expf(ls[i] - lse), os[i * D + d], o);
    static_cast<T*>(a.out)[b * a.o_sb + h * a.o_sh + d] = from_float<T>(o);
  }
  if (threadIdx.x == 0) a.lse[b * a.lse_sb + h * a.lse_sh] = lse;
}

template <typename T, int D, int HPB>
int launch(const LcxLambdaDecodeArgs& a, cudaStream_t stream) {
  using G = Geometry<T, D, HPB>;
  const dim3 grid(static_cast<unsigned>(a.n_splits), static_cast<unsigned>(a.H / HPB),
                  static_cast<unsigned>(a.B));
  const size_t smem_bytes = static_cast<size_t>(G::SMEM) * sizeof(float);  // <= 48 KiB for all instances
  static_assert(G::SMEM * sizeof(float) <= 48 * 1024, "dynamic shared memory above the default limit");
  const auto kernel = lambda_decode_kernel<T, D, HPB>;
  LCX_LAUNCH(kernel, grid, kThreads, smem_bytes, stream, a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || a.n_splits == 1) return static_cast<int>(err);
  const auto combine = lambda_decode_combine<T>;
  const dim3 grid2(static_cast<unsigned>(a.H), static_cast<unsigned>(a.B));
  LCX_LAUNCH(combine, grid2, kThreads, 0, stream, a, D);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_hpb(int hpb, const LcxLambdaDecodeArgs& a, cudaStream_t stream) {
  switch (hpb) {
    case 1: return launch<T, D, 1>(a, stream);
    case 2: return launch<T, D, 2>(a, stream);
    case 4: return launch<T, D, 4>(a, stream);
    case 8: return launch<T, D, 8>(a, stream);
    default: return -1;
  }
}

template <typename T>
int launch_dim(int head_dim, int hpb, const LcxLambdaDecodeArgs& a, cudaStream_t stream) {
  switch (head_dim) {
    case 32: return launch_hpb<T, 32>(hpb, a, stream);
    case 64: return launch_hpb<T, 64>(hpb, a, stream);
    case 128: return launch_hpb<T, 128>(hpb, a, stream);
    case 256: return launch_hpb<T, 256>(hpb, a, stream);
    default: return -1;
  }
}

}  // namespace

extern "C" int lcx_lambda_decode_launch(int dtype, int head_dim, int heads_per_block,
                                        const LcxLambdaDecodeArgs* args, void* stream) {
  const LcxLambdaDecodeArgs& a = *args;
  if (a.B <= 0 || a.H <= 0) return 0;
  if (a.Hkv <= 0 || a.H % a.Hkv || (a.H / a.Hkv) % heads_per_block || a.n_splits < 1 ||
      a.n_splits > 65535 || a.B > 65535 || a.H / heads_per_block > 65535 || a.chunk < 1 ||
      a.g_hi < 0 || a.g_hi > a.w_lo || a.w_lo > a.w_hi || a.w_hi > a.Tk || 2 * a.half > head_dim ||
      (a.half > 0 && (a.kcos == nullptr || a.ksin == nullptr || a.qtab == nullptr)) ||
      (a.n_splits > 1 && (a.ws_o == nullptr || a.ws_lse == nullptr)) ||
      a.n_splits * a.chunk < a.g_hi + a.w_hi - a.w_lo)
    return -1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_dim<float>(head_dim, heads_per_block, a, s);
    case 1: return launch_dim<__half>(head_dim, heads_per_block, a, s);
    case 2: return launch_dim<__nv_bfloat16>(head_dim, heads_per_block, a, s);
    default: return -1;
  }
}
