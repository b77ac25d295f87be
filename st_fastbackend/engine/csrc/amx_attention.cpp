// Exact-softmax attention over packed bf16 sequences on CPUs with AMX, one parallel region per call.
//
// q [T, Hq, D], k and v [T, Hkv, D] (Hq a multiple of Hkv; rows may be strided, heads contiguous), out [T, Hq, D],
// cu_seqlens int32 [B + 1]. One work item per (sequence, query head), handed out in order by an atomic counter.
// Per item: K^T and V packed once into oneDNN's VNNI pairs; then per block of query rows, scores = q.k^T through
// cpublas::brgemm (AMX tiles, fp32 sums), a softmax row by row (max, exp, sum in fp32; probabilities rounded to
// bf16 as PyTorch's flash kernel rounds them), out = p.v through brgemm, divided by the row's sum, rounded to bf16.
// Causal: a query at row r sees keys 0..r. Built by engine/cpu_kernel.py with -march=native.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // 16 floats

// B = K^T [d, n] in VNNI pairs ([d / 2, n, 2]): as 32-bit words, out[c * n + j] = k[j][2c, 2c + 1].
void pack_keys(const BFloat16* k, int64_t ld, int64_t n, int64_t d, BFloat16* out) {
  auto src = reinterpret_cast<const uint32_t*>(k);
  auto dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t j = 0; j < n; j++)
    for (int64_t c = 0; c < d / 2; c++) dst[c * n + j] = src[j * (ld / 2) + c];
}

// B = V [n_even, d] in VNNI pairs ([n_even / 2, d, 2]); a last odd row is paired with zeros.
void pack_values(const BFloat16* v, int64_t ld, int64_t n, int64_t d, BFloat16* out) {
  for (int64_t j = 0; j < n; j += 2) {
    auto a = reinterpret_cast<const uint16_t*>(v + j * ld);
    auto dst = reinterpret_cast<uint32_t*>(out + j * d);
    if (j + 1 < n) {
      auto b = reinterpret_cast<const uint16_t*>(v + (j + 1) * ld);
      for (int64_t c = 0; c < d; c++) dst[c] = uint32_t(a[c]) | (uint32_t(b[c]) << 16);
    } else {
      for (int64_t c = 0; c < d; c++) dst[c] = uint32_t(a[c]);
    }
  }
}

float reduce(const Vec& v, bool take_max) {
  float lanes[W];
  v.store(lanes);
  float r = take_max ? -INFINITY : 0.f;
  for (int64_t l = 0; l < W; l++) r = take_max ? std::max(r, lanes[l]) : r + lanes[l];
  return r;
}

// One row: p[0..keys) = exp(scale * s - max) rounded to bf16, p[keys..n_even) = 0; returns 1 / sum.
float softmax_row(float* s, int64_t keys, int64_t n_even, float scale, BFloat16* p) {
  Vec top(-INFINITY);
  int64_t j = 0;
  for (; j + W <= keys; j += W) top = at::vec::maximum(top, Vec::loadu(s + j));
  if (j < keys) top = at::vec::maximum(top, Vec::set(Vec(-INFINITY), Vec::loadu(s + j, keys - j), keys - j));
  const Vec factor(scale), shift(reduce(top, true) * scale);
  Vec sum(0.f);
  for (j = 0; j < n_even; j += 2 * W) {
    const int64_t lo = std::clamp<int64_t>(keys - j, 0, W), hi = std::clamp<int64_t>(keys - j - W, 0, W);
    Vec e0 = lo ? (Vec::loadu(s + j, lo) * factor - shift).exp_u20() : Vec(0.f);
    Vec e1 = hi ? (Vec::loadu(s + j + W, hi) * factor - shift).exp_u20() : Vec(0.f);
    if (lo < W) e0 = Vec::set(Vec(0.f), e0, lo);
    if (hi < W) e1 = Vec::set(Vec(0.f), e1, hi);
    sum = sum + e0 + e1;
    const int64_t count = std::min<int64_t>(2 * W, n_even - j);
    _mm512_mask_storeu_epi16(p + j, (__mmask32)((1ull << count) - 1), at::vec::cvtfp32_bf16(__m512(e0), __m512(e1)));
  }
  return 1.f / reduce(sum, false);
}

}  // namespace

void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               const at::Tensor& cu_seqlens, double scale, bool causal, int64_t block) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "bf16 q, k, v and out");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "[T, H, D] q, k, v and out");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  TORCH_CHECK(hq % hkv == 0 && v.size(1) == hkv && out.size(1) == hq, "query heads a multiple of key heads");
  TORCH_CHECK(d % W == 0 && k.size(2) == d && v.size(2) == d && out.size(2) == d, "head size a multiple of 16");
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == d && t->stride(0) % 2 == 0, "heads contiguous in each row");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous(), "int32 cu_seqlens");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t sequences = cu_seqlens.size(0) - 1;
  TORCH_CHECK(sequences >= 0 && cu[sequences] <= q.size(0), "cu_seqlens within the tokens");
  int64_t longest = 0;
  for (int64_t b = 0; b < sequences; b++) longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
  const int64_t room = longest + 1, group = hq / hkv, items = sequences * hq;
  const BFloat16 *Q = q.data_ptr<BFloat16>(), *K = k.data_ptr<BFloat16>(), *V = v.data_ptr<BFloat16>();
  BFloat16* O = out.data_ptr<BFloat16>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  const float factor = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<BFloat16> keys_packed(d * room), values_packed(d * room), p(block * room);
    std::vector<float> scores(block * room), acc(block * d), inverse(block);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t b = item / hq, h = item % hq, start = cu[b], len = cu[b + 1] - cu[b];
      pack_keys(K + start * sk + h / group * d, sk, len, d, keys_packed.data());
      pack_values(V + start * sv + h / group * d, sv, len, d, values_packed.data());
      for (int64_t r0 = 0; r0 < len; r0 += block) {
        const int64_t m = std::min(block, len - r0), n = causal ? r0 + m : len, n_even = n + (n & 1);
        at::native::cpublas::brgemm(m, n, d, sq, len, n, false, Q + (start + r0) * sq + h * d,
                                    keys_packed.data(), scores.data(), true);
        for (int64_t row = 0; row < m; row++)
          inverse[row] = softmax_row(scores.data() + row * n, causal ? r0 + row + 1 : n, n_even, factor,
                                     p.data() + row * n_even);
        at::native::cpublas::brgemm(m, d, n_even, n_even, d, d, false, p.data(), values_packed.data(), acc.data(),
                                    true);
        for (int64_t row = 0; row < m; row++) {
          BFloat16* o = O + (start + r0 + row) * so + h * d;
          const Vec by(inverse[row]);
          for (int64_t c = 0; c < d; c += W)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                                at::vec::cvtfp32_bf16(__m512(Vec::loadu(acc.data() + row * d + c) * by)));
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attention", &attention, "exact-softmax bf16 attention over packed sequences (AMX)");
}
