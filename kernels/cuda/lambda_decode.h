// Arguments of the Λ-decode launcher, shared by lambda_decode.cu (nvcc) and
// lambda_decode_binding.cpp (host compiler). Plain C: no torch, no CUDA types.
#pragma once
#include <cstdint>

struct LcxLambdaDecodeArgs {
  // q [B, 1, H, D] (unrotated), k/v [B, Tk, Hkv, D] (unrotated); element strides, d stride 1.
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh;
  int64_t k_sb, k_st, k_sh;
  int64_t v_sb, v_st, v_sh;
  // out [B, 1, H, D] in q's dtype (d stride 1); lse [B, H] float32 (natural log).
  void* out;
  float* lse;
  int64_t o_sb, o_sh;
  int64_t lse_sb, lse_sh;
  // split-K workspace (n_splits > 1): ws_o [B, H, S, D], ws_lse [B, H, S] float32, contiguous.
  float* ws_o;
  float* ws_lse;
  // RoPE tables, float32, contiguous (ignored when rot == 0):
  //   kcos/ksin [Bt, Tk, half]: attention_factor * cos/sin(p_j * inv_freq) of every key;
  //   qtab [Bt, 4, half]: rows cos_loc, sin_loc (query position, x attention_factor),
  //                       cos_cap, sin_cap (capped distance, x attention_factor^2).
  // Bt = 1 (shared positions: tab_sb = qtab_sb = 0) or B.
  const float* kcos;
  const float* ksin;
  const float* qtab;
  int64_t tab_sb, qtab_sb;
  int64_t B, H, Hkv, Tk;
  int64_t half;  // rotary pairs; rotary channels are [0, 2 * half), the rest pass through
  // Visible keys: [0, g_hi) then [w_lo, w_hi) (disjoint, g_hi <= w_lo), virtual index v in
  // [0, g_hi + w_hi - w_lo). Keys j < g_hi are scored by the capped global branch if capped.
  int64_t g_hi, w_lo, w_hi;
  int capped;
  float scale_log2;  // softmax scale * log2(e)
  int64_t n_splits;  // S >= 1 blocks along the visible keys, each `chunk` virtual keys
  int64_t chunk;
};

#ifdef __cplusplus
extern "C" {
#endif
// dtype: 0 float32, 1 float16, 2 bfloat16; head_dim in {32, 64, 128, 256}; heads_per_block in
// {1, 2, 4, 8} dividing H / Hkv. Returns a cudaError_t value (0 = success), -1 for a bad argument.
int lcx_lambda_decode_launch(int dtype, int head_dim, int heads_per_block,
                             const LcxLambdaDecodeArgs* args, void* stream);
#ifdef __cplusplus
}
#endif
