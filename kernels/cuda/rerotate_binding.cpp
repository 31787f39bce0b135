// Thin torch binding of rerotate.cu's extern "C" launcher; built only on CUDA machines by
// lcx.kernels.cuda.load_extension() (torch.utils.cpp_extension.load). Validation of the public
// signature happens in Python (lcx.cache.rerotate.check_rerotate_args); the checks here guard
// the raw-pointer contract.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

extern "C" int lcx_rerotate_launch(int dtype, const void* k, void* out, const int64_t* delta,
                                   const double* inv_turns, int64_t B, int64_t T, int64_t H,
                                   int64_t D, int64_t half, const int64_t* k_strides,
                                   const int64_t* out_strides, int64_t delta_stride_b,
                                   int64_t delta_stride_t, void* stream);

// k, out: [B, T, H, D] (any strides; out may be k); delta: [B, T] int64; inv_turns: [half] float64.
torch::Tensor rerotate(torch::Tensor k, torch::Tensor delta, torch::Tensor inv_turns, torch::Tensor out) {
  TORCH_CHECK(k.is_cuda() && out.is_cuda() && delta.is_cuda() && inv_turns.is_cuda(),
              "lcx rerotate: all tensors must be CUDA tensors");
  TORCH_CHECK(k.dim() == 4 && out.sizes() == k.sizes() && out.scalar_type() == k.scalar_type(),
              "lcx rerotate: k and out must be [B, T, H, D] of one dtype");
  TORCH_CHECK(delta.scalar_type() == torch::kInt64 && delta.dim() == 2 && delta.size(0) == k.size(0) &&
                  delta.size(1) == k.size(1),
              "lcx rerotate: delta must be int64 [B, T]");
  TORCH_CHECK(inv_turns.scalar_type() == torch::kFloat64 && inv_turns.dim() == 1 && inv_turns.is_contiguous(),
              "lcx rerotate: inv_turns must be contiguous float64 [half]");
  int dtype;
  switch (k.scalar_type()) {
    case torch::kFloat32: dtype = 0; break;
    case torch::kFloat16: dtype = 1; break;
    case torch::kBFloat16: dtype = 2; break;
    default: TORCH_CHECK(false, "lcx rerotate: unsupported dtype ", k.scalar_type());
  }
  const int64_t ks[4] = {k.stride(0), k.stride(1), k.stride(2), k.stride(3)};
  const int64_t os[4] = {out.stride(0), out.stride(1), out.stride(2), out.stride(3)};
  const c10::cuda::CUDAGuard guard(k.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(k.device().index()).stream();
  const int err = lcx_rerotate_launch(dtype, k.data_ptr(), out.data_ptr(), delta.data_ptr<int64_t>(),
                                      inv_turns.data_ptr<double>(), k.size(0), k.size(1), k.size(2),
                                      k.size(3), inv_turns.size(0), ks, os, delta.stride(0), delta.stride(1),
                                      stream);
  TORCH_CHECK(err == 0, "lcx rerotate: launch failed (",
              err < 0 ? "bad argument" : cudaGetErrorString(static_cast<cudaError_t>(err)), ")");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rerotate", &rerotate, "k <- R(delta) k for cached keys (PIE); see rerotate.cu");
}
