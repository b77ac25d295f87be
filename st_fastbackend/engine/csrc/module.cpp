// The Python module of our CPU kernels (engine/cpu_kernel.py builds it from every file of this folder).
#include <torch/extension.h>

void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               const at::Tensor& cu_seqlens, double scale, bool causal, int64_t block, bool bf16);
void quantize_static(const at::Tensor& x, const at::Tensor& inverse, double offset, at::Tensor& codes);
void quantize_rows(const at::Tensor& x, at::Tensor& codes, at::Tensor& scale);
void dequantize(at::Tensor& y, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                int64_t activation, int64_t rows, bool gated);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attention", &attention,
             "exact-softmax attention over packed fp32 or bf16 sequences, its products in fp32 or bf16");
  module.def("quantize_static", &quantize_static, "int8-static codes of each row, rows past the input zero");
  module.def("quantize_rows", &quantize_rows, "per-row symmetric int8 codes (+ 128) and scales");
  module.def("dequantize", &dequantize, "y * scale + bias, then the activation or act(gate) * up, in place");
}
