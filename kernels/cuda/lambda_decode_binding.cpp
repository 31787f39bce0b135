// Thin torch binding of lambda_decode.cu's extern "C" launcher; built only on CUDA machines by
// lcx.kernels.cuda.lambda_decode.load_extension() (torch.utils.cpp_extension.load). The public
// signature is validated in Python (lambda_decode.py); the checks here guard the raw-pointer
// contract (dtypes, shapes, unit channel stride, 16-byte alignment of every row).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include "lambda_decode.h"

namespace {

bool rows_aligned(const torch::Tensor& t, std::initializer_list<int> dims) {
  const int64_t vec = 16 / t.element_size();
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d : dims)
    if (t.size(d) > 1 && t.stride(d) % vec != 0) return false;
  return t.stride(-1) == 1;
}

const float* table_ptr(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

}  // namespace

// q [B, 1, H, D], k/v [B, Tk, Hkv, D] (unrotated); out [B, 1, H, D]; lse [B, H, 1] float32;
// kcos/ksin [Bt, Tk, half], qtab [Bt, 4, half] float32 contiguous (absent: no rotary).
// window = (g_hi, w_lo, w_hi); returns out.
torch::Tensor lambda_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                            torch::Tensor lse, c10::optional<torch::Tensor> kcos,
                            c10::optional<torch::Tensor> ksin, c10::optional<torch::Tensor> qtab,
                            int64_t g_hi, int64_t w_lo, int64_t w_hi, bool capped, double scale_log2,
                            int64_t n_splits, int64_t heads_per_block) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && lse.is_cuda(),
              "lcx lambda_decode: all tensors must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(1) == 1,
              "lcx lambda_decode: q [B, 1, H, D], k/v [B, Tk, Hkv, D]");
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3), Tk = k.size(1), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(3) == D && v.size(1) == Tk &&
                  v.size(2) == Hkv && Hkv > 0 && H % Hkv == 0,
              "lcx lambda_decode: q, k, v shapes do not agree");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(),
              "lcx lambda_decode: out must be [B, 1, H, D] of q's dtype, and k, v of q's dtype");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.dim() == 3 && lse.size(0) == B && lse.size(1) == H &&
                  lse.size(2) == 1,
              "lcx lambda_decode: lse must be float32 [B, H, 1]");
  TORCH_CHECK(rows_aligned(q, {0, 2}) && rows_aligned(k, {0, 1, 2}) && rows_aligned(v, {0, 1, 2}) &&
                  out.stride(3) == 1,
              "lcx lambda_decode: q, k, v need unit channel stride and 16-byte aligned rows");
  int dtype;
  switch (q.scalar_type()) {
    case torch::kFloat32: dtype = 0; break;
    case torch::kFloat16: dtype = 1; break;
    case torch::kBFloat16: dtype = 2; break;
    default: TORCH_CHECK(false, "lcx lambda_decode: unsupported dtype ", q.scalar_type());
  }
  int64_t half = 0, tab_sb = 0, qtab_sb = 0;
  TORCH_CHECK(kcos.has_value() == ksin.has_value() && kcos.has_value() == qtab.has_value(),
              "lcx lambda_decode: give all of kcos, ksin, qtab or none");
  if (kcos.has_value()) {
    for (const auto* t : {&*kcos, &*ksin, &*qtab})
      TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kFloat32 && t->dim() == 3 && t->is_contiguous(),
                  "lcx lambda_decode: rotary tables must be contiguous float32 CUDA [Bt, ., half]");
    half = kcos->size(2);
    const int64_t Bt = kcos->size(0);
    TORCH_CHECK((Bt == 1 || Bt == B) && ksin->sizes() == kcos->sizes() && kcos->size(1) == Tk &&
                    qtab->size(0) == Bt && qtab->size(1) == 4 && qtab->size(2) == half && 2 * half <= D,
                "lcx lambda_decode: tables must be kcos/ksin [Bt, Tk, half], qtab [Bt, 4, half], Bt in {1, B}");
    tab_sb = Bt == 1 ? 0 : Tk * half;
    qtab_sb = Bt == 1 ? 0 : 4 * half;
  }
  torch::Tensor ws_o, ws_lse;
  const auto f32 = q.options().dtype(torch::kFloat32);
  if (n_splits > 1) {
    ws_o = torch::empty({B, H, n_splits, D}, f32);
    ws_lse = torch::empty({B, H, n_splits}, f32);
  }
  const int64_t n_vis = g_hi + (w_hi - w_lo);
  LcxLambdaDecodeArgs a{};
  a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr();
  a.q_sb = q.stride(0); a.q_sh = q.stride(2);
  a.k_sb = k.stride(0); a.k_st = k.stride(1); a.k_sh = k.stride(2);
  a.v_sb = v.stride(0); a.v_st = v.stride(1); a.v_sh = v.stride(2);
  a.out = out.data_ptr(); a.lse = lse.data_ptr<float>();
  a.o_sb = out.stride(0); a.o_sh = out.stride(2);
  a.lse_sb = lse.stride(0); a.lse_sh = lse.stride(1);
  a.ws_o = n_splits > 1 ? ws_o.data_ptr<float>() : nullptr;
  a.ws_lse = n_splits > 1 ? ws_lse.data_ptr<float>() : nullptr;
  a.kcos = table_ptr(kcos); a.ksin = table_ptr(ksin); a.qtab = table_ptr(qtab);
  a.tab_sb = tab_sb; a.qtab_sb = qtab_sb;
  a.B = B; a.H = H; a.Hkv = Hkv; a.Tk = Tk; a.half = half;
  a.g_hi = g_hi; a.w_lo = w_lo; a.w_hi = w_hi; a.capped = capped ? 1 : 0;
  a.scale_log2 = static_cast<float>(scale_log2);
  a.n_splits = n_splits;
  a.chunk = n_splits > 0 ? std::max<int64_t>(1, (n_vis + n_splits - 1) / n_splits) : 1;
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const int err = lcx_lambda_decode_launch(dtype, static_cast<int>(D), static_cast<int>(heads_per_block), &a, stream);
  TORCH_CHECK(err == 0, "lcx lambda_decode: launch failed (",
              err < 0 ? "bad argument" : cudaGetErrorString(static_cast<cudaError_t>(err)), ")");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lambda_decode", &lambda_decode, "Λ-attention decode over unrotated cached keys; see lambda_decode.cu");
}
