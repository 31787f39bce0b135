// Causal (or sliding-window) softmax attention of the newest nq of a row's n keys, float32, on
// the CPU: the engine's prefill and mixed-step rows (`lcx.hf.attention_call.attend_loaded_rows`),
// where torch's fused CPU kernel computes every block of queries against whole 512-key blocks
// (much of it past the diagonal at a few hundred queries) and runs at ~40 GFLOP/s per core.
//
//     q [b, nq, H, D], k [b, n, Hkv, D], v [b, n, Hkv, Dv]  (any strides, unit last stride)
//     query i of row b sits at position n - nq + i, key j at position j; query i sees key j iff
//         j <= n - nq + i   and (window > 0)  j > n - nq + i - window
//     s_ij = scale * q_i . k_j    (softcap > 0: s = softcap * tanh(s / softcap))
//     out [b, nq, H, Dv] = softmax_j(s_ij) v_j      (head h reads kv head h / (H / Hkv))
//
// One task per (row, kv head, block of mq queries): its G = H / Hkv query heads x mq queries are
// R = G * mq rows that share every key and value (mq chosen so that R is a multiple of 64 where
// that stays <= 256). The rows are the LANES of the score tiles: the scaled queries are transposed
// once per task into Qt [D, R], and per block of KB = 64 keys the scores St [64 keys, R] come from
// register tiles of KT keys x 64 lanes (per channel: four loads of Qt, one broadcast of each key's
// channel straight from the cache layout, KT x 4 FMAs; 24 accumulators), so neither the keys nor
// the scores are ever transposed. The online softmax then runs down the keys with every lane a
// row (vectorised max, exp_nonpositive, sums; the output rows rescaled where their max grew), and
// O += P V in register tiles of rows x head_dim (the probability broadcast per key and row, the
// value row loaded once per tile). Keys are walked up to the block's last visible key (nothing
// past the diagonal block); the diagonal block is masked per (key, lane) from each lane's position.
// No [nq, n] mask, no score matrix beyond [64, R]: O(R (D + Dv + 64)) memory per thread.
//
// AVX-512 intrinsics where the compiler targets it (`__AVX512F__`, head_dim a multiple of 16, Dv
// up to 256); otherwise the same tiles as plain loops (portable, `omp simd`). Accumulation is
// float32 as in torch's kernel; the reference is float64 attention (tests/kernels/
// test_causal_attention_cpu.py: within 2x torch's own float32 error on a grid of odd lengths,
// GQA, windows and caps). Threads: at::parallel_for over the tasks (torch's intra-op pool).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LCX_AVX512 1
#else
#define LCX_AVX512 0
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int KB = 64;  // keys per block (four 16-float vectors)

// exp(x) for x <= 0 (a score minus its row's max): Cephes expf, branch-free so `omp simd`
// vectorises it (x = n ln2 + r, a degree-6 polynomial, 2^n from the exponent bits; ~1 ulp).
// Below -87.3 it returns ~1e-38, never 0 or NaN; masked entries are set to 0 by the caller.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// O[r, :] += sum_{j < nk} P[r * rs + j * js] V[j, :] for R rows, plain loops (any Dv; the portable build).
inline void value_rows_plain(const float* __restrict P, int64_t rs, int64_t js, int R, int nk,
                             const float* __restrict V, int64_t ldv, float* __restrict O, int64_t Dv) {
  for (int r = 0; r < R; ++r) {
    float* o = O + r * Dv;
    for (int j = 0; j < nk; ++j) {
      const float p = P[r * rs + j * js];
      const float* vr = V + j * ldv;
#pragma omp simd
      for (int64_t c = 0; c < Dv; ++c) o[c] += p * vr[c];
    }
  }
}

// O[r, :] += sum_{j < nk} P[r * rs + j * js] V[j, :] for ROWS rows, V rows `ldv` apart, Dv = 16 * NV:
// the probability broadcast per key and row, the value row loaded once per tile. (rs, js) = (ldp, 1)
// for rows of probabilities (the decode step), (1, ldp) for keys x lanes (prefill rows).
template <int ROWS, int NV>
inline void value_tile(const float* __restrict P, int64_t rs, int64_t js, int nk, const float* __restrict V,
                       int64_t ldv, float* __restrict O, int64_t Dv) {
#if LCX_AVX512
  __m512 acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(O + r * Dv + 16 * c);
  for (int j = 0; j < nk; ++j) {
    __m512 vj[NV];
    for (int c = 0; c < NV; ++c) vj[c] = _mm512_loadu_ps(V + j * ldv + 16 * c);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 p = _mm512_set1_ps(P[r * rs + j * js]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(p, vj[c], acc[r][c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(O + r * Dv + 16 * c, acc[r][c]);
#else
  (void)NV;
  value_rows_plain(P, rs, js, ROWS, nk, V, ldv, O, Dv);
#endif
}

// O[r, :] += sum_j P[r * rs + j * js] V[j, :] for R rows, in register tiles of rows.
template <int NV>
void values(const float* P, int64_t rs, int64_t js, int R, int nk, const float* V, int64_t ldv, float* O,
            int64_t Dv) {
  constexpr int T = NV <= 4 ? (NV <= 2 ? 8 : 6) : (NV <= 8 ? 3 : 1);
  int r = 0;
  for (; r + T <= R; r += T) value_tile<T, NV>(P + r * rs, rs, js, nk, V, ldv, O + r * Dv, Dv);
  for (; r < R; ++r) value_tile<1, NV>(P + r * rs, rs, js, nk, V, ldv, O + r * Dv, Dv);
}

void values_any(const float* P, int64_t rs, int64_t js, int R, int nk, const float* V, int64_t ldv, float* O,
                int64_t Dv) {
#if LCX_AVX512
  switch (Dv) {
    case 16: return values<1>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 32: return values<2>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 48: return values<3>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 64: return values<4>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 80: return values<5>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 96: return values<6>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 128: return values<8>(P, rs, js, R, nk, V, ldv, O, Dv);
    case 256: return values<16>(P, rs, js, R, nk, V, ldv, O, Dv);
    default: break;
  }
#endif
  value_rows_plain(P, rs, js, R, nk, V, ldv, O, Dv);
}

// ----------------------------------------------------------------------------------- prefill rows
// Scores transposed: St[j, lane] = sum_d K[j, d] Qt[d, lane] for nk keys (K rows `ldk` apart, one
// key's channels contiguous, as the cache holds them) and 16 * NV lanes (query rows; Qt [D, ldq]
// holds the scaled queries transposed once per task). Tiles of KT keys x NV vectors: per channel,
// NV loads of Qt, one broadcast per key, KT * NV FMAs; no transposition of the keys.
template <int NV, int KT>
inline void score_keys(const float* __restrict Qt, int64_t ldq, int64_t D, const float* __restrict K, int64_t ldk,
                       float* __restrict St, int64_t lds) {
#if LCX_AVX512
  __m512 acc[KT][NV];
  for (int j = 0; j < KT; ++j)
    for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(Qt + d * ldq + 16 * c);
    for (int j = 0; j < KT; ++j) {
      const __m512 kb = _mm512_set1_ps(K[j * ldk + d]);
      for (int c = 0; c < NV; ++c) acc[j][c] = _mm512_fmadd_ps(kb, qv[c], acc[j][c]);
    }
  }
  for (int j = 0; j < KT; ++j)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(St + j * lds + 16 * c, acc[j][c]);
#else
  for (int j = 0; j < KT; ++j) {
    float acc[16 * NV] = {0.f};
    for (int64_t d = 0; d < D; ++d) {
      const float kd = K[j * ldk + d];
      const float* qr = Qt + d * ldq;
#pragma omp simd
      for (int l = 0; l < 16 * NV; ++l) acc[l] += kd * qr[l];
    }
    std::memcpy(St + j * lds, acc, sizeof acc);
  }
#endif
}

template <int NV>
void scores_t(const float* Qt, int64_t ldq, int64_t D, const float* K, int64_t ldk, int nk, float* St, int64_t lds) {
  constexpr int KT = NV == 1 ? 24 : NV == 2 ? 12 : NV == 3 ? 8 : 6;
  int j = 0;
  for (; j + KT <= nk; j += KT) score_keys<NV, KT>(Qt, ldq, D, K + j * ldk, ldk, St + j * lds, lds);
  for (; j < nk; ++j) score_keys<NV, 1>(Qt, ldq, D, K + j * ldk, ldk, St + j * lds, lds);
}

}  // namespace

// Rows as lanes (module comment): per task, its R = G * mq query rows are the lanes of the score
// tiles (padded to a multiple of 16, W lanes per chunk), the keys the tile rows, so neither the
// keys nor the scores are transposed and the online softmax runs down the keys, lane-parallel.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k, v must be 4-d [b, t, heads, dim]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32, "causal_attention: float32 tensors only");
  TORCH_CHECK(!q.is_cuda() && !k.is_cuda() && !v.is_cuda(), "causal_attention: CPU tensors only");
  const int64_t b = q.size(0), nq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t n = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == n && v.size(2) == Hkv && k.size(3) == D,
              "causal_attention: k, v must be [b, n, Hkv, D] / [b, n, Hkv, Dv] with q's b and D");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "causal_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(nq <= n, "causal_attention: more queries than keys (the queries are the newest keys)");
  TORCH_CHECK(window >= 0 && softcap >= 0, "causal_attention: window and softcap must be >= 0 (0: none)");
  const torch::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const torch::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const torch::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  auto out = torch::empty({b, nq, H, Dv}, q.options());
  if (b == 0 || nq == 0 || H == 0) return out;
  const int64_t G = H / Hkv, off = n - nq;
  // queries per task: G * MQ rows, a multiple of 64 lanes where that stays <= 256 rows
  int64_t MQt = 64 / std::gcd<int64_t>(G, 64);
  while (MQt * G < 64) MQt *= 2;
  if (MQt * G > 256) MQt = std::max<int64_t>(1, 256 / G);
  MQt = std::min(MQt, nq);
  const int64_t nblocks = (nq + MQt - 1) / MQt;
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = qc.stride(0), qs1 = qc.stride(1), qs2 = qc.stride(2);
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t Rmax = G * MQt, RP = (Rmax + 15) / 16 * 16;  // lanes, padded

  at::parallel_for(0, b * Hkv * nblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Qt(D * RP), O(RP * Dv), St(KB * RP), m(RP), l(RP), alpha(RP);
    std::vector<int64_t> pos(RP);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t blk = task % nblocks, g = (task / nblocks) % Hkv, bi = task / (nblocks * Hkv);
      const int64_t i0 = blk * MQt, mq = std::min<int64_t>(MQt, nq - i0);
      const int64_t R = G * mq, Rp = (R + 15) / 16 * 16;
      // lanes r = t * G + h: query i0 + t, head g * G + h; scaled and transposed once; padding lanes 0
      std::fill(Qt.begin(), Qt.begin() + D * Rp, 0.f);
      for (int64_t t = 0; t < mq; ++t)
        for (int64_t h = 0; h < G; ++h) {
          const float* src = qp + bi * qs0 + (i0 + t) * qs1 + (g * G + h) * qs2;
          const int64_t r = t * G + h;
          for (int64_t d = 0; d < D; ++d) Qt[d * Rp + r] = src[d] * fscale;
        }
      const int64_t first_pos = off + i0, last_pos = off + i0 + mq - 1;
      for (int64_t r = 0; r < Rp; ++r) pos[r] = r < R ? first_pos + r / G : last_pos;
      std::fill(O.begin(), O.begin() + R * Dv, 0.f);
      std::fill(m.begin(), m.begin() + Rp, kNegInf);
      std::fill(l.begin(), l.begin() + Rp, 0.f);
      const int64_t key_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      const float* kbase = kp + bi * ks0 + g * ks2;
      const float* vbase = vp + bi * vs0 + g * vs2;
      for (int64_t j0 = key_begin; j0 <= last_pos; j0 += KB) {
        const int nk = static_cast<int>(std::min<int64_t>(KB, last_pos + 1 - j0));
        const float* kb = kbase + j0 * ks1;
        for (int64_t c0 = 0; c0 < Rp; c0 += 64) {  // lane chunks of up to 64
          const int64_t w = std::min<int64_t>(64, Rp - c0);
          switch (w / 16) {
            case 4: scores_t<4>(Qt.data() + c0, Rp, D, kb, ks1, nk, St.data() + c0, Rp); break;
            case 3: scores_t<3>(Qt.data() + c0, Rp, D, kb, ks1, nk, St.data() + c0, Rp); break;
            case 2: scores_t<2>(Qt.data() + c0, Rp, D, kb, ks1, nk, St.data() + c0, Rp); break;
            default: scores_t<1>(Qt.data() + c0, Rp, D, kb, ks1, nk, St.data() + c0, Rp); break;
          }
        }
        // every lane sees every key of the block: it ends at or before the first query and, with
        // a window, starts inside the last query's window
        const bool full = j0 + nk - 1 <= first_pos && (window <= 0 || j0 > last_pos - window);
        float* mx = alpha.data();  // the block's max per lane (alpha reuses the buffer below)
        std::fill(mx, mx + Rp, kNegInf);
        for (int j = 0; j < nk; ++j) {
          float* s = St.data() + j * Rp;
          const int64_t kpos = j0 + j;
          if (cap > 0)
            for (int64_t r = 0; r < Rp; ++r) s[r] = cap * std::tanh(s[r] / cap);
          if (full) {
#pragma omp simd
            for (int64_t r = 0; r < Rp; ++r) mx[r] = std::max(mx[r], s[r]);
          } else {
            const int64_t* pr = pos.data();
#pragma omp simd
            for (int64_t r = 0; r < Rp; ++r) {
              const bool vis = kpos <= pr[r] && (window <= 0 || kpos > pr[r] - window);
              const float x = vis ? s[r] : kNegInf;
              s[r] = x;
              mx[r] = std::max(mx[r], x);
            }
          }
        }
        // new running max; alpha = exp(old - new) (1 where nothing is seen yet), P = exp(S - max)
        float* ml = m.data();
        float* ll = l.data();
        float rowsum[256 + 16];
        for (int64_t r0 = 0; r0 < Rp; r0 += 256) {
          const int64_t r1 = std::min<int64_t>(Rp, r0 + 256);
#pragma omp simd
          for (int64_t r = r0; r < r1; ++r) {
            const float mn = std::max(ml[r], mx[r]);
            const float a = mn == kNegInf ? 1.f : exp_nonpositive(ml[r] - mn);
            mx[r] = mn;  // mx now holds the new max
            ml[r] = mn;
            ll[r] *= a;
            rowsum[r - r0] = a;  // alpha, kept until O is rescaled
          }
          for (int64_t r = r0; r < r1; ++r) {
            if (r < R && rowsum[r - r0] != 1.f) {
              float* o = O.data() + r * Dv;
              const float a = rowsum[r - r0];
#pragma omp simd
              for (int64_t c = 0; c < Dv; ++c) o[c] *= a;
            }
          }
        }
        for (int j = 0; j < nk; ++j) {
          float* s = St.data() + j * Rp;
#pragma omp simd
          for (int64_t r = 0; r < Rp; ++r) {
            const float e = s[r] == kNegInf ? 0.f : exp_nonpositive(s[r] - mx[r]);
            s[r] = e;
            ll[r] += e;
          }
        }
        values_any(St.data(), 1, Rp, static_cast<int>(R), nk, vbase + j0 * vs1, vs1, O.data(), Dv);
      }
      for (int64_t t = 0; t < mq; ++t)
        for (int64_t h = 0; h < G; ++h) {
          const int64_t r = t * G + h;
          const float inv = 1.f / l[r];
          const float* o = O.data() + r * Dv;
          float* dst = op + ((bi * nq + i0 + t) * H + g * G + h) * Dv;
#pragma omp simd
          for (int64_t c = 0; c < Dv; ++c) dst[c] = o[c] * inv;
        }
    }
  });
  return out;
}

// The engine's decode step over a slot store (`lcx.engine.decode_step.decode_attention` without a
// side branch: vanilla and sliding-window layers): one query per row, q [B, H, D], k [B, Hkv, C, D],
// v [B, Hkv, C, Dv], visible [B, C] (the slots a row's query sees; holes allowed) -> [B, H, Dv].
// One task per (row, kv head): the scores of its G query heads (each key's dot products in 16-lane
// partial sums, reduced per key), the softmax over the visible slots, O = P V in register tiles.
// Keys past the row's last visible slot are not read.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& visible, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && visible.dim() == 2,
              "decode_attention: q [B, H, D], k/v [B, Hkv, C, D], visible [B, C]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32, "decode_attention: float32 tensors only");
  TORCH_CHECK(visible.scalar_type() == torch::kBool, "decode_attention: visible must be bool");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k.size(1), C = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(1) == Hkv && v.size(2) == C &&
                  visible.size(0) == B && visible.size(1) == C,
              "decode_attention: shapes disagree (q [B, H, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv], visible [B, C])");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "decode_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(softcap >= 0, "decode_attention: softcap must be >= 0 (0: none)");
  const torch::Tensor qc = q.contiguous();
  const torch::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const torch::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  const torch::Tensor vis = visible.contiguous();
  auto out = torch::zeros({B, H, Dv}, q.options());
  if (B == 0 || H == 0 || C == 0) return out;
  const int64_t G = H / Hkv;
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* mp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> Qs(G * D), P(G * C), O(G * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / Hkv, g = task % Hkv;
      const bool* m = mp + bi * C;
      int64_t last = C - 1;
      while (last >= 0 && !m[last]) --last;
      if (last < 0) continue;  // nothing visible: zeros
      const int64_t n = last + 1;
      for (int64_t h = 0; h < G; ++h)
        for (int64_t d = 0; d < D; ++d) Qs[h * D + d] = qp[(bi * H + g * G + h) * D + d] * fscale;
      const float* kbase = kp + bi * ks0 + g * ks1;
      const float* vbase = vp + bi * vs0 + g * vs1;
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = Qs.data() + h * D;
        float* ph = P.data() + h * C;
#if LCX_AVX512
        if (D % 16 == 0) {
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = kbase + j * ks2;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), _mm512_loadu_ps(kr));
            for (int64_t d = 16; d < D; d += 16)
              acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), _mm512_loadu_ps(kr + d), acc);
            ph[j] = _mm512_reduce_add_ps(acc);
          }
        } else
#endif
        {
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = kbase + j * ks2;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qh[d] * kr[d];
            ph[j] = acc;
          }
        }
        if (cap > 0)
          for (int64_t j = 0; j < n; ++j) ph[j] = cap * std::tanh(ph[j] / cap);
        float mx = kNegInf;
        for (int64_t j = 0; j < n; ++j)
          if (m[j]) mx = std::max(mx, ph[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          const float e = m[j] ? exp_nonpositive(ph[j] - mx) : 0.f;
          ph[j] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) ph[j] *= inv;
      }
      std::fill(O.begin(), O.end(), 0.f);
      for (int64_t j0 = 0; j0 < n; j0 += 256) {
        const int nk = static_cast<int>(std::min<int64_t>(256, n - j0));
        values_any(P.data() + j0, C, 1, static_cast<int>(G), nk, vbase + j0 * vs2, vs2, O.data(), Dv);
      }
      for (int64_t h = 0; h < G; ++h)
        std::memcpy(op + (bi * H + g * G + h) * Dv, O.data() + h * Dv, Dv * sizeof(float));
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_attention", &causal_attention,
        "causal / sliding-window float32 attention of the newest nq of n keys (CPU)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("decode_attention", &decode_attention, "one query per row over a slot store with a visibility mask (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("visible"), py::arg("scale"), py::arg("softcap") = 0.0);
}
