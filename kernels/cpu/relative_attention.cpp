// Softmax attention over a paged KV cache with per-(query, key) relative rotations, on the CPU:
// the decode step and the prefill of every lcx method whose attention is plain softmax over a
// subset of keys at method-given positions (`lcx.methods.last_query`), for the vLLM plugin.
//
// For request b, query t (row q_rows[b, t] of query/out), head h (kv head g = h / (H / Hkv)), key k:
//
//     u     = index[b or 0, t, k]                      (-1: key not visible to this query)
//     s_k   = scale * q . Rot(cos[u], sin[u]) key_k     key_k = kv[rows[b, k, g], 0:D]
//             (softcap > 0: s_k = softcap * tanh(s_k / softcap), a model's logit cap, Gemma 2)
//     out   = sum_k softmax(s)_k * kv[rows[b, k, g], D:2D]
//
// Rot is lcx's half-split rotation of the first r = 2 * half channels by the angles a_i of the
// table row u (cos/sin tables [U, half]): (x_i, x_{i+half}) -> (x_i cos a_i - x_{i+half} sin a_i,
// x_{i+half} cos a_i + x_i sin a_i); channels past r pass through. So the score needs one pass:
//     q . Rot k = sum_i cos a_i (q_i k_i + q_{i+h} k_{i+h}) + sin a_i (q_{i+h} k_i - q_i k_{i+h}).
// Two ways the callers use it (only relative rotations matter):
//   - keys and queries UNROTATED: u holds the key's position relative to the query, the attention
//     factor squared folded into the tables;
//   - keys and queries rotated at their true positions (vLLM's rotary, the plugin's rotated
//     layout): u holds the method's relative position minus the true one, unit scale; for
//     window keys that is the identity row (cos 1, sin 0), which the kernel reads without
//     rotating, so only the method's few moved keys (LM-Infinite's globals, ...) are rotated.
// The tables are indexed by a small table row u, not by (query, key): a step's relative
// positions repeat, so U is small.
// Compacted calls (`cols` non-empty, [1 or B, Tq, Kc]): query t reads only the keys k = cols[.., t, c]
// (c < Kc, -1: none), with table rows index[.., t, c]. A bounded method's prefill query sees
// its window + side keys, not the Tk - window others, so the loop runs over Kc = side + window
// entries instead of skipping Tk - Kc invisible keys for every (query, head); without `cols`,
// c = k and Kc = K.
// References: `LastQueryPlan.attend` and `AttentionMethod.attend` (tests/kernels/test_relative_attention_cpu.py).
//
// Threads: one task per (request, query, kv head) through at::parallel_for (torch's intra-op pool).
// Accumulation in float32 whatever the storage dtype (float32, float16, bfloat16). A task runs
// three passes over its keys: scores (each dot product in 16 partial sums added as a tree, not a
// serial 16-add chain per key; the cache row a few entries ahead prefetched, key and value, since
// a step's keys are spread over many blocks), the unnormalised probabilities (one vectorised
// exp per head: `exp_nonpositive`, elementwise), and the weighted values head by head, the
// accumulator in registers where head_dim is 64 or 128. Every per-key quantity is computed the
// same way wherever the key sits in the call and the sums run in entry order, so a compacted call
// gives the same bits as the full one. Vectorised with `omp simd` (-fopenmp-simd: no OpenMP
// runtime; -fno-trapping-math lets the exp loop vectorise, results unchanged).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// q . k over D channels in 16 partial sums (one wide register) added as a tree: no serial
// 16-add chain per key (what a reduction(+) loop compiles to without -ffast-math), and the same
// bits for a key wherever it sits in a call (a compacted call and a full one agree exactly).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float part[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i + l < D; ++l) part[l] += a[i + l] * b[i + l];
#pragma omp simd
  for (int l = 0; l < 8; ++l) part[l] += part[l + 8];
#pragma omp simd
  for (int l = 0; l < 4; ++l) part[l] += part[l + 4];
  return (part[0] + part[2]) + (part[1] + part[3]);
}

// exp(x) for x <= 0 (a score minus the row's max), elementwise and branch-free so that `omp simd`
// vectorises it and a lane gives the same bits as the scalar loop (Cephes expf: x = n ln2 + r,
// |r| <= ln2 / 2, a degree-6 polynomial, 2^n from the exponent bits; ~1 ulp). Below -87.3 (and
// -inf) it returns ~1e-38, never 0 or NaN: callers skip invisible keys themselves.
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

// sum_c p[c] * value(c) over the visible entries (key_row[c] >= 0), in entry order, into acc [D];
// returns sum_c p[c]. DT: D known at compile time (the accumulator lives in registers), 0: D.
template <int DT, typename scalar_t>
inline float weighted_values(const float* __restrict p, const int64_t* __restrict key_row, int64_t Kc,
                             const scalar_t* __restrict kv_ptr, int64_t kvs, int64_t D, float* __restrict acc) {
  constexpr int64_t kLocal = DT > 0 ? DT : 1;
  float local[kLocal];
  float* a = DT > 0 ? local : acc;
  const int64_t width = DT > 0 ? DT : D;
  for (int64_t i = 0; i < width; ++i) a[i] = 0.f;
  float total = 0.f;
  for (int64_t c = 0; c < Kc; ++c) {
    if (key_row[c] < 0) continue;  // the same keys are visible to every head of the group
    const scalar_t* val = kv_ptr + key_row[c] * kvs + D;
    const float pc = p[c];
    total += pc;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) a[i] += pc * static_cast<float>(val[i]);
  }
  if constexpr (DT > 0) {
    for (int64_t i = 0; i < DT; ++i) acc[i] = local[i];
  }
  return total;
}

template <typename scalar_t>
void relative_attention_impl(const torch::Tensor& query, const torch::Tensor& kv, const torch::Tensor& rows,
                             const torch::Tensor& q_rows, const torch::Tensor& index, const torch::Tensor& cols,
                             const torch::Tensor& cos, const torch::Tensor& sin, double scale, torch::Tensor& out,
                             double softcap) {
  const int64_t B = rows.size(0), K = rows.size(1), Hkv = rows.size(2), Tq = q_rows.size(1);
  const int64_t Kc = index.size(2);  // entries per query: K, or the compacted width of `cols`
  const int64_t H = query.size(1), D = query.size(2), half = cos.size(1), R = kv.size(0);
  const int64_t U = cos.size(0), N = std::min(query.size(0), out.size(0));
  const int64_t group = H / Hkv;
  const bool per_request = index.size(0) != 1;
  const bool compact = cols.numel() > 0;
  const int64_t* cols_ptr = compact ? cols.data_ptr<int64_t>() : nullptr;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* kv_ptr = kv.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t* rows_ptr = rows.data_ptr<int64_t>();
  const int64_t* qr_ptr = q_rows.data_ptr<int64_t>();
  const int64_t* idx_ptr = index.data_ptr<int64_t>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t kvs = kv.stride(0);
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);  // > 0: every scaled logit soft-capped (Gemma 2)
  const int64_t row_bytes = 2 * D * static_cast<int64_t>(sizeof(scalar_t));
  constexpr int64_t kAhead = 4;

  // Rows of the tables that are the identity (relative rotation 0, unit scale): keys read through
  // them need no rotation. A cache of keys rotated at their true positions reads its window keys
  // that way (the vLLM plugin's rotated layout), so most keys of a step skip the rotation.
  std::vector<char> identity(U);
  for (int64_t u = 0; u < U; ++u) {
    bool id = true;
    for (int64_t i = 0; i < half && id; ++i) id = cos_ptr[u * half + i] == 1.f && sin_ptr[u * half + i] == 0.f;
    identity[u] = id;
  }

  std::atomic<bool> bad{false};
  // One task per (request, query, kv head): the key is read and rotated once for the `group`
  // query heads that share it (GQA), each head keeping its own scores and accumulator.
  at::parallel_for(0, B * Tq * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), s(group * Kc), kr(D), mx(group), total(group);
    std::vector<int64_t> key_row(Kc);  // cache row of entry c's key (-1: not read)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % Hkv, bt = task / Hkv, t = bt % Tq, b = bt / Tq;
      const int64_t* idx = idx_ptr + ((per_request ? b : 0) * Tq + t) * Kc;
      const int64_t* col = compact ? cols_ptr + ((per_request ? b : 0) * Tq + t) * Kc : nullptr;
      const int64_t* key_rows = rows_ptr + b * K * Hkv + g;  // key k's row: key_rows[k * Hkv]
      const int64_t row = qr_ptr[b * Tq + t];
      if (row < 0 || row >= N) {
        bad = true;
        continue;
      }
      for (int64_t j = 0; j < group; ++j) {
        const scalar_t* q = q_ptr + row * qs0 + (g * group + j) * qs1;
        for (int64_t i = 0; i < D; ++i) qf[j * D + i] = static_cast<float>(q[i]);
      }
      std::fill(mx.begin(), mx.end(), kNegInf);
      for (int64_t c = 0; c < Kc; ++c) {
        key_row[c] = -1;
        for (int64_t j = 0; j < group; ++j) s[j * Kc + c] = kNegInf;  // until scored below
        const int64_t u = idx[c];
        const int64_t k = compact ? col[c] : c;
        if (u < 0 || k < 0) continue;  // not visible (or a compacted row's padding)
        if (u >= U || k >= K) {  // checked where read, not by a separate pass
          bad = true;
          continue;
        }
        const int64_t kr_row = key_rows[k * Hkv];
        if (kr_row < 0 || kr_row >= R) {
          bad = true;
          continue;
        }
        key_row[c] = kr_row;
        const scalar_t* key = kv_ptr + kr_row * kvs;
        if (c + kAhead < Kc) {  // the row (key and value) kAhead entries on: its cache lines arrive meanwhile
          const int64_t ka = compact ? col[c + kAhead] : c + kAhead;
          if (ka >= 0 && ka < K) {
            const int64_t ra = key_rows[ka * Hkv];
            if (ra >= 0 && ra < R) {
              const char* line = reinterpret_cast<const char*>(kv_ptr + ra * kvs);
              for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(line + b);
            }
          }
        }
        const float* kp = kr.data();  // the key as the query sees it
        if (identity[u]) {
          if constexpr (std::is_same_v<scalar_t, float>) {
            kp = key;  // read in place
          } else {
            for (int64_t i = 0; i < D; ++i) kr[i] = static_cast<float>(key[i]);
          }
        } else {
          const float* cs = cos_ptr + u * half;
          const float* sn = sin_ptr + u * half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float k1 = static_cast<float>(key[i]), k2 = static_cast<float>(key[i + half]);
            kr[i] = k1 * cs[i] - k2 * sn[i];
            kr[i + half] = k2 * cs[i] + k1 * sn[i];
          }
          for (int64_t i = 2 * half; i < D; ++i) kr[i] = static_cast<float>(key[i]);
        }
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qf.data() + j * D;
          float sc = dot(qj, kp, D) * fscale;
          if (fcap > 0.f) sc = fcap * std::tanh(sc / fcap);
          s[j * Kc + c] = sc;
          mx[j] = std::max(mx[j], s[j * Kc + c]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {  // probabilities, unnormalised: one vectorised pass per head
        float* sj = s.data() + j * Kc;
        const float m = mx[j];
#pragma omp simd
        for (int64_t c = 0; c < Kc; ++c) sj[c] = exp_nonpositive(sj[c] - m);
      }
      for (int64_t j = 0; j < group; ++j) {  // head by head: its accumulator stays in registers
        float* a = acc.data() + j * D;
        switch (D) {
          case 64: total[j] = weighted_values<64>(s.data() + j * Kc, key_row.data(), Kc, kv_ptr, kvs, D, a); break;
          case 128: total[j] = weighted_values<128>(s.data() + j * Kc, key_row.data(), Kc, kv_ptr, kvs, D, a); break;
          default: total[j] = weighted_values<0>(s.data() + j * Kc, key_row.data(), Kc, kv_ptr, kvs, D, a);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        scalar_t* o = o_ptr + row * os0 + (g * group + j) * os1;
        if (mx[j] == kNegInf) {  // no visible key: NaN, as SDPA gives
          for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(std::numeric_limits<float>::quiet_NaN());
          continue;
        }
        const float inv = 1.f / total[j];
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[j * D + i] * inv);
      }
    }
  });
  TORCH_CHECK(!bad, "an index is out of range: rows outside kv, q_rows outside query/out, or index past the tables");
}

void paged_relative_attention(const torch::Tensor& query, const torch::Tensor& kv, const torch::Tensor& rows,
                              const torch::Tensor& q_rows, const torch::Tensor& index, const torch::Tensor& cols,
                              const torch::Tensor& cos, const torch::Tensor& sin, double scale, torch::Tensor out,
                              double softcap) {
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: no cap)");
  TORCH_CHECK(query.device().is_cpu() && kv.device().is_cpu() && out.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && kv.dim() == 2 && rows.dim() == 3 && q_rows.dim() == 2 &&
                  index.dim() == 3,
              "query/out [N, H, D], kv [R, 2D], rows [B, K, Hkv], q_rows [B, Tq], index [1 or B, Tq, K]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv.stride(1) == 1, "unit channel stride needed");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type() && out.scalar_type() == kv.scalar_type(),
              "query, kv and out must share one dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && q_rows.scalar_type() == torch::kInt64 &&
                  index.scalar_type() == torch::kInt64,
              "int64 indices");
  TORCH_CHECK(rows.is_contiguous() && q_rows.is_contiguous() && index.is_contiguous(), "contiguous indices");
  const int64_t B = rows.size(0), K = rows.size(1), Hkv = rows.size(2), H = query.size(1), D = query.size(2);
  const int64_t Tq = q_rows.size(1);
  TORCH_CHECK(q_rows.size(0) == B, "q_rows must have one row of queries per request");
  if (cols.numel() > 0) {
    TORCH_CHECK(cols.scalar_type() == torch::kInt64 && cols.is_contiguous() && cols.sizes() == index.sizes(),
                "cols must be contiguous int64 of index's shape [1 or B, Tq, Kc]");
    TORCH_CHECK((index.size(0) == 1 || index.size(0) == B) && index.size(1) == Tq && index.size(2) >= 1,
                "index must be [1 or B, Tq, Kc]");
  } else {
    TORCH_CHECK((index.size(0) == 1 || index.size(0) == B) && index.size(1) == Tq && index.size(2) == K,
                "index must be [1 or B, Tq, K]");
  }
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(kv.size(1) == 2 * D, "kv rows hold keys then values: width 2 * head_dim");
  TORCH_CHECK(out.size(1) == H && out.size(2) == D, "out must be [N, H, D]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "float32 tables");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes(),
              "contiguous cos/sin tables [U, r / 2]");
  TORCH_CHECK(2 * cos.size(1) <= D, "tables must be [U, r / 2] with r <= head_dim");
  if (B == 0 || Tq == 0) return;
  TORCH_CHECK(K >= 1, "at least one key per request");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, query.scalar_type(),
                                  "paged_relative_attention", [&] {
    relative_attention_impl<scalar_t>(query, kv, rows, q_rows, index, cols, cos, sin, scale, out, softcap);
  });
}

// Write token t's key and value into the cache row of its slot: kv [R, 2D] (the cache
// [num_blocks, Hkv, block_size, 2D] viewed as rows), slot s = block * block_size + offset, head g
// -> row (block * Hkv + g) * block_size + offset, keys in [0, D), values in [D, 2D). Slots < 0
// (padding) write nothing. One pass, no temporaries (the torch version is a cat + index_copy_).
template <typename scalar_t>
void write_kv_impl(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& kv,
                   const torch::Tensor& slots, int64_t block_size, int64_t hkv) {
  const int64_t N = slots.size(0), D = key.size(2), R = kv.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  scalar_t* out = kv.data_ptr<scalar_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t kvs = kv.stride(0);
  bool bad = false;
  for (int64_t t = 0; t < N; ++t) {
    const int64_t s = sl[t];
    if (s < 0) continue;
    const int64_t block = s / block_size, offset = s % block_size;
    for (int64_t g = 0; g < hkv; ++g) {
      const int64_t row = (block * hkv + g) * block_size + offset;
      if (row >= R) { bad = true; continue; }
      scalar_t* dst = out + row * kvs;
      std::copy(k + t * ks0 + g * ks1, k + t * ks0 + g * ks1 + D, dst);
      std::copy(v + t * vs0 + g * vs1, v + t * vs0 + g * vs1 + D, dst + D);
    }
  }
  TORCH_CHECK(!bad, "a slot is outside the cache");
}

void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor kv, const torch::Tensor& slots,
              int64_t block_size, int64_t hkv) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && kv.dim() == 2 && slots.dim() == 1,
              "key/value [N, Hkv, D], kv [R, 2D], slots [N]");
  TORCH_CHECK(key.scalar_type() == kv.scalar_type() && value.scalar_type() == kv.scalar_type(),
              "key, value and kv must share one dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "contiguous int64 slots");
  TORCH_CHECK(key.size(0) >= slots.size(0) && value.size(0) >= slots.size(0), "a key and value per slot");
  TORCH_CHECK(key.size(1) == hkv && value.size(1) == hkv && kv.size(1) == 2 * key.size(2) &&
                  value.size(2) == key.size(2), "kv rows hold keys then values: width 2 * head_dim");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv.stride(1) == 1, "unit channel stride needed");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, kv.scalar_type(), "write_kv", [&] {
    write_kv_impl<scalar_t>(key, value, kv, slots, block_size, hkv);
  });
}

// The decode step plan under a method's window + side decode rule: the "cpp" backend of
// `lcx.methods.plan.step_plan` (whose numpy `step_plan_ref` is the reference and states the
// rule; tests/methods/test_plan.py checks them bit for bit), fused with the vLLM plugin's
// block-table lookup (`lcx.serve.vllm_plugin.step_plan._rule_decode_cpp`): every query row of the requests `req` reads its side keys (the first `side`
// positions outside its window; side < 0: all of them) and its window keys (p_q - window < p_k
// <= p_q; window < 0: every key), padded to the longest row with invisible keys. A side key
// moves by delta = a[p_k] - b[p_q] (float64 shift tables of the rule's key / query maps); window
// keys and padding by 0. One pass over the B x K entries instead of ~40 numpy ops: the plan is
// rebuilt every step, so its fixed cost is paid per generated token.
// Returns rows [B], blocks, offsets [B, K] (int64), visible [B, K] (bool), delta [B, K]
// (float64), cache_rows [B, K, hkv] (the rows of `paged_relative_attention`'s kv for a cache
// [num_blocks, hkv, block_size, 2D]), index [B, 1, K] (-1 invisible, 0 read as cached, 1 + u for
// the u-th of the distinct non-zero deltas) and those deltas [U], ascending.
struct IntView {  // an int32 or int64 tensor's elements as int64
  const int32_t* p32 = nullptr;
  const int64_t* p64 = nullptr;
  explicit IntView(const torch::Tensor& t) {
    if (t.scalar_type() == torch::kInt32) p32 = t.data_ptr<int32_t>(); else p64 = t.data_ptr<int64_t>();
  }
  int64_t operator[](int64_t i) const { return p32 ? static_cast<int64_t>(p32[i]) : p64[i]; }
};

std::vector<torch::Tensor> rule_plan(const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                                     const torch::Tensor& block_table, const torch::Tensor& req, int64_t window,
                                     int64_t side, const torch::Tensor& key_shift, const torch::Tensor& query_shift,
                                     int64_t block_size, int64_t hkv) {
  for (const torch::Tensor* t : {&query_start_loc, &seq_lens, &block_table, &req}) {
    TORCH_CHECK((t->scalar_type() == torch::kInt32 || t->scalar_type() == torch::kInt64) && t->is_contiguous() &&
                    t->device().is_cpu(), "contiguous int32 / int64 CPU index tensors");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_size >= 1 && hkv >= 1, "block_table [n, blocks], block_size, hkv >= 1");
  TORCH_CHECK(key_shift.scalar_type() == torch::kFloat64 && query_shift.scalar_type() == torch::kFloat64 &&
                  key_shift.is_contiguous() && query_shift.is_contiguous(), "contiguous float64 shift tables");
  const int64_t R = req.size(0), n_blocks = block_table.size(1);
  const IntView qsl(query_start_loc), lens(seq_lens), table(block_table), reqs(req);
  std::vector<int64_t> start(R), n_q(R), req_i(R);
  int64_t B = 0, n_max = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = reqs[r];
    TORCH_CHECK(i >= 0 && i + 1 < query_start_loc.size(0) && i < seq_lens.size(0), "request index out of range");
    req_i[r] = i;
    start[r] = qsl[i];
    n_q[r] = qsl[i + 1] - start[r];
    TORCH_CHECK(n_q[r] >= 0 && lens[i] >= n_q[r], "a request has fewer keys than queries");
    if (n_q[r] > 0) n_max = std::max(n_max, lens[i]);
    B += n_q[r];
  }
  const bool bounded = window >= 0 && side >= 0;
  const int64_t K = bounded ? std::min(n_max, side + window) : n_max;
  const bool moves = side != 0;
  if (moves) {
    TORCH_CHECK(key_shift.size(0) >= std::min(n_max, side < 0 ? n_max : side) && query_shift.size(0) >= n_max,
                "shift tables shorter than the step's positions");
  }
  auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor rows = torch::empty({B}, i64), blocks = torch::empty({B, K}, i64), offsets = torch::empty({B, K}, i64);
  torch::Tensor visible = torch::empty({B, K}, torch::TensorOptions().dtype(torch::kBool));
  torch::Tensor delta = torch::zeros({B, K}, torch::TensorOptions().dtype(torch::kFloat64));
  torch::Tensor cache_rows = torch::empty({B, K, hkv}, i64), index = torch::empty({B, 1, K}, i64);
  int64_t* rw = rows.data_ptr<int64_t>();
  int64_t* bl = blocks.data_ptr<int64_t>();
  int64_t* of = offsets.data_ptr<int64_t>();
  bool* vis = visible.data_ptr<bool>();
  double* dl = delta.data_ptr<double>();
  int64_t* cr = cache_rows.data_ptr<int64_t>();
  int64_t* ix = index.data_ptr<int64_t>();
  const double* a = key_shift.data_ptr<double>();
  const double* bq = query_shift.data_ptr<double>();
  const int64_t n_a = key_shift.size(0);
  std::vector<double> moved;
  int64_t row = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t keys_before = lens[req_i[r]] - n_q[r];
    for (int64_t t = 0; t < n_q[r]; ++t, ++row) {
      rw[row] = start[r] + t;
      const int64_t n = keys_before + t + 1, p_q = n - 1;  // keys this row sees; the query is the last
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = row * K + j;
        const int64_t idx = bounded && j >= side ? j + std::max<int64_t>(n - (side + window), 0) : j;
        const bool valid = idx < n;
        const bool in_window = window < 0 || idx > p_q - window;
        const bool is_side = !in_window && (side < 0 || idx < side);
        const bool v = valid && (in_window || is_side);
        vis[e] = v;
        ix[e] = v ? 0 : -1;
        if (moves && v && is_side) {
          const double d = a[std::min(idx, n_a - 1)] - bq[p_q];
          dl[e] = d;
          if (d != 0.0) moved.push_back(d);
        }
        const int64_t k = valid ? idx : 0;  // padding reads a real slot (never used: invisible)
        const int64_t blk = table[req_i[r] * n_blocks + std::min(k / block_size, n_blocks - 1)];
        bl[e] = blk;
        of[e] = k % block_size;
        for (int64_t g = 0; g < hkv; ++g) cr[e * hkv + g] = (blk * hkv + g) * block_size + k % block_size;
      }
    }
  }
  std::sort(moved.begin(), moved.end());
  moved.erase(std::unique(moved.begin(), moved.end()), moved.end());
  if (!moved.empty()) {
    for (int64_t e = 0; e < B * K; ++e) {
      if (ix[e] == 0 && dl[e] != 0.0) ix[e] = 1 + (std::lower_bound(moved.begin(), moved.end(), dl[e]) - moved.begin());
    }
  }
  torch::Tensor uniq = torch::empty({static_cast<int64_t>(moved.size())}, torch::TensorOptions().dtype(torch::kFloat64));
  std::copy(moved.begin(), moved.end(), uniq.data_ptr<double>());
  return {rows, blocks, offsets, visible, delta, cache_rows, index, uniq};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "write keys/values into their cache rows by slot (CPU)", py::arg("key"),
        py::arg("value"), py::arg("kv"), py::arg("slots"), py::arg("block_size"), py::arg("hkv"));
  m.def("paged_relative_attention", &paged_relative_attention,
        "softmax attention with per-(query, key) relative positions over a paged cache (CPU)", py::arg("query"),
        py::arg("kv"), py::arg("rows"), py::arg("q_rows"), py::arg("index"), py::arg("cols"), py::arg("cos"), py::arg("sin"),
        py::arg("scale"), py::arg("out"), py::arg("softcap") = 0.0);
  m.def("rule_plan", &rule_plan, "the vLLM plugin's rotated-layout step plan under a window + side rule (CPU)",
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_table"), py::arg("req"), py::arg("window"),
        py::arg("side"), py::arg("key_shift"), py::arg("query_shift"), py::arg("block_size"), py::arg("hkv"));
}
