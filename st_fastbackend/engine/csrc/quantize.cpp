// The passes around oneDNN's int8 products (engine/quantize.py), row by row: a row's codes and results are computed
// by the same vector code whatever the number of rows, so a token's numbers never depend on its pack. PyTorch's
// compiled or eager passes gave the same row 1-ulp differences at some row counts (another kernel for small packs,
// scalar tails where threads split a row), which the next product's codes turned into differences of 1e-2 in an
// embedding (eval/RESULTS.md, 2026-12-07).
//
// x [T, n] fp32 (rows strided, each row contiguous); codes [rows, n] uint8 and sums [rows, n] fp32 contiguous, rows >=
// T (oneDNN's product rows, engine/onednn.product_rows): the rows past T are written too, as codes of zero.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t GRAIN = 1 << 15;  // elements a thread takes at least: small packs run on one thread

enum Activation : int64_t { NONE = 0, GELU = 1, GELU_TANH = 2, RELU = 3, SILU = 4 };

// The first `count` of W codes (integers in 0..255 held as floats) as bytes.
void store_codes(const Vec& v, uint8_t* out, int64_t count) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(__m512(v)));
  _mm_mask_storeu_epi8(out, static_cast<__mmask16>((1u << count) - 1), bytes);
#else
  float lanes[W];
  v.store(lanes);
  for (int64_t i = 0; i < count; i++) out[i] = static_cast<uint8_t>(lanes[i]);
#endif
}

Vec activated(const Vec& x, int64_t activation) {
  switch (activation) {
    case GELU:  // 0.5 x (1 + erf(x / sqrt 2)), as PyTorch's gelu
      return x * Vec(0.5f) * (Vec(1.f) + (x * Vec(static_cast<float>(M_SQRT1_2))).erf());
    case GELU_TANH: {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
      const Vec inner = Vec(0.7978845608028654f) * (x + Vec(0.044715f) * x * x * x);
      return Vec(0.5f) * x * (Vec(1.f) + inner.tanh());
    }
    case RELU:
      return at::vec::clamp_min(x, Vec(0.f));
    case SILU:
      return x / (Vec(1.f) + x.neg().exp());
    default:
      return x;
  }
}

template <typename Row>
void rows_in_parallel(int64_t rows, int64_t n, const Row& row) {
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) row(r);
  });
}

void check_codes(const at::Tensor& x, const at::Tensor& codes) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "x: fp32 [T, n] on the CPU, each row contiguous");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(1) == x.size(1) && codes.size(0) >= x.size(0), "codes: uint8 [rows >= T, n], contiguous");
}

}  // namespace

// codes = clamp(floor(x * inverse + offset), 0, 255) per element (int8-static: inverse per input channel).
void quantize_static(const at::Tensor& x, const at::Tensor& inverse, double offset, at::Tensor& codes) {
  check_codes(x, codes);
  TORCH_CHECK(inverse.scalar_type() == at::kFloat && inverse.is_contiguous() && inverse.numel() == x.size(1),
              "inverse: fp32 [n]");
  const int64_t t = x.size(0), n = x.size(1), ld = x.stride(0);
  const float *X = x.data_ptr<float>(), *inv = inverse.data_ptr<float>();
  uint8_t* C = codes.data_ptr<uint8_t>();
  const Vec shift(static_cast<float>(offset)), low(0.f), high(255.f);
  rows_in_parallel(codes.size(0), n, [&](int64_t r) {
    if (r >= t) return void(std::memset(C + r * n, 0, n));
    for (int64_t c = 0; c < n; c += W) {
      const int64_t count = std::min(W, n - c);
      const Vec v = at::vec::fmadd(Vec::loadu(X + r * ld + c, count), Vec::loadu(inv + c, count), shift);
      store_codes(at::vec::clamp(v.floor(), low, high), C + r * n + c, count);
    }
  });
}

// Per row: scale = max(max |x| / 127, the smallest normal float), codes = floor(x / scale + 128.5) (round(x / scale)
// + 128, halves up); rows past T: codes 128 (zero), scale 1.
void quantize_rows(const at::Tensor& x, at::Tensor& codes, at::Tensor& scale) {
  check_codes(x, codes);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == codes.size(0),
              "scale: fp32 [rows]");
  const int64_t t = x.size(0), n = x.size(1), ld = x.stride(0);
  const float* X = x.data_ptr<float>();
  uint8_t* C = codes.data_ptr<uint8_t>();
  float* S = scale.data_ptr<float>();
  rows_in_parallel(codes.size(0), n, [&](int64_t r) {
    if (r >= t) {
      std::memset(C + r * n, 128, n);
      S[r] = 1.f;
      return;
    }
    const float* row = X + r * ld;
    Vec top(0.f);
    for (int64_t c = 0; c < n; c += W) top = at::vec::maximum(top, Vec::loadu(row + c, std::min(W, n - c)).abs());
    float lanes[W];
    top.store(lanes);
    const float s = std::max(*std::max_element(lanes, lanes + W) / 127.f, FLT_MIN);
    S[r] = s;
    const Vec divisor(s), half(128.5f);
    for (int64_t c = 0; c < n; c += W) {
      const int64_t count = std::min(W, n - c);
      store_codes((Vec::loadu(row + c, count) / divisor + half).floor(), C + r * n + c, count);
    }
  });
}

// In place on the first `rows` rows of y [rows', n]: y * scale[r] (per-token int8; none for int8-static) + bias, then
// the activation; gated: act(first half) * second half into the first half (a gated MLP's act(gate) * up).
void dequantize(at::Tensor& y, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                int64_t activation, int64_t rows, bool gated) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous() && y.device().is_cpu() &&
              rows <= y.size(0), "y: fp32 [rows' >= rows, n], contiguous, on the CPU");
  TORCH_CHECK(activation >= NONE && activation <= SILU, "an activation id of 0 to 4");
  const int64_t n = y.size(1), out = gated ? n / 2 : n;
  TORCH_CHECK(!gated || n % 2 == 0, "gated: an even number of columns");
  const float *S = nullptr, *B = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() >= rows,
                "scale: fp32 [rows]");
    S = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias: fp32 [n]");
    B = bias->data_ptr<float>();
  }
  float* Y = y.data_ptr<float>();
  rows_in_parallel(rows, n, [&](int64_t r) {
    const Vec s(S == nullptr ? 1.f : S[r]);
    const auto value = [&](int64_t c, int64_t count) {  // the row's column c onwards, scaled and biased
      Vec v = Vec::loadu(Y + r * n + c, count);
      v = S == nullptr ? v : v * s;
      return B == nullptr ? v : v + Vec::loadu(B + c, count);
    };
    for (int64_t c = 0; c < out; c += W) {  // gated: reads columns c and out + c before column c is written
      const int64_t count = std::min(W, out - c);
      Vec result = activated(value(c, count), activation);
      if (gated) result = result * value(out + c, count);
      result.store(Y + r * n + c, count);
    }
  });
}
