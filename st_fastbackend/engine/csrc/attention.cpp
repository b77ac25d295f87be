// Exact-softmax attention over packed sequences on x86-64 CPUs with AVX2 or AVX-512: one parallel region per call.
//
// q [T, Hq, D], k and v [T, Hkv, D] (Hq a multiple of Hkv; rows may be strided, each row's heads contiguous), out
// [T, Hq, D], cu_seqlens int32 [B + 1]; all fp32, or all bf16 (AVX-512 builds, AMX). One work item per (sequence,
// query head), handed out in order by an atomic counter. Per item, for each block of query rows: scores = q.k^T
// through PyTorch's cpublas::brgemm (oneDNN; fp32 sums), a softmax row by row in fp32 (max, exp, sum), out = p.v
// through brgemm, divided by the row's sum. fp32: k^T copied once per item, v read where it is. bf16: k^T and v
// packed once per item into oneDNN's VNNI pairs for AMX tiles, probabilities rounded to bf16 before p.v (as
// PyTorch's flash kernel rounds them), the output rounded to bf16. Causal: a query at row r sees keys 0..r. Built by
// engine/cpu_kernel.py with CPU_CAPABILITY AVX512 or AVX2 (the width of at::vec's vectors: 16 or 8 floats).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // 16 floats (AVX-512) or 8 (AVX2)
// fp32 q.k^T sums at most SLICE products in one chain and adds the slices: one chain of 256 (Gemma's heads) was 1.6x
// as far from exact as PyTorch's fp32 kernel on AVX2, slices of 128 as close as it (eval/RESULTS.md, 2026-12-06).
constexpr int64_t SLICE = 128;

// fp32: B = K^T [d, n] row-major.
void pack_keys(const float* k, int64_t ld, int64_t n, int64_t d, float* out) {
  for (int64_t j = 0; j < n; j++)
    for (int64_t c = 0; c < d; c++) out[c * n + j] = k[j * ld + c];
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16: B = K^T [d, n] in VNNI pairs ([d / 2, n, 2]): as 32-bit words, out[c * n + j] = k[j][2c, 2c + 1].
void pack_keys(const BFloat16* k, int64_t ld, int64_t n, int64_t d, BFloat16* out) {
  auto src = reinterpret_cast<const uint32_t*>(k);
  auto dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t j = 0; j < n; j++)
    for (int64_t c = 0; c < d / 2; c++) dst[c * n + j] = src[j * (ld / 2) + c];
}

// bf16: B = V [n_even, d] in VNNI pairs ([n_even / 2, d, 2]); a last odd row is paired with zeros.
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

#endif

void add(float* into, const float* from, int64_t count) {
  int64_t i = 0;
  for (; i + W <= count; i += W) (Vec::loadu(into + i) + Vec::loadu(from + i)).store(into + i);
  for (; i < count; i++) into[i] += from[i];
}

float reduce(const Vec& v, bool take_max) {
  float lanes[W];
  v.store(lanes);
  float r = take_max ? -INFINITY : 0.f;
  for (int64_t l = 0; l < W; l++) r = take_max ? std::max(r, lanes[l]) : r + lanes[l];
  return r;
}

// exp(scale * s[j] - max) for the first `count` of 16 values, zeros after them.
Vec exp_part(const float* s, int64_t count, const Vec& factor, const Vec& shift) {
  if (count <= 0) return Vec(0.f);
  if (count >= W) return (Vec::loadu(s) * factor - shift).exp_u20();
  return Vec::set(Vec(0.f), (Vec::loadu(s, count) * factor - shift).exp_u20(), count);
}

// One row of `keys` scores (of `width` columns): p[0..keys) = exp(scale * s - max), p[keys..width) = 0, in fp32 in
// place or rounded to bf16 into p; returns 1 / the sum.
template <typename T>
float softmax_row(float* s, int64_t keys, int64_t width, float scale, T* p) {
  Vec top(-INFINITY);
  int64_t j = 0;
  for (; j + W <= keys; j += W) top = at::vec::maximum(top, Vec::loadu(s + j));
  if (j < keys) top = at::vec::maximum(top, Vec::set(Vec(-INFINITY), Vec::loadu(s + j, keys - j), keys - j));
  const Vec factor(scale), shift(reduce(top, true) * scale);
  Vec sum(0.f);
  if constexpr (std::is_same_v<T, float>) {
    for (j = 0; j < width; j += W) {
      const Vec e = exp_part(s + j, keys - j, factor, shift);
      sum = sum + e;
      e.store(p + j, std::min(W, width - j));
    }
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    for (j = 0; j < width; j += 2 * W) {
      const Vec low = exp_part(s + j, keys - j, factor, shift), high = exp_part(s + j + W, keys - j - W, factor, shift);
      sum = sum + low + high;
      const auto mask = static_cast<__mmask32>((1ull << std::min(2 * W, width - j)) - 1);
      _mm512_mask_storeu_epi16(p + j, mask, at::vec::cvtfp32_bf16(__m512(low), __m512(high)));
    }
#endif
  }
  return 1.f / reduce(sum, false);
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, const int32_t* cu,
            int64_t sequences, int64_t longest, float scale, bool causal, int64_t block) {
  constexpr bool reduced = std::is_same_v<T, BFloat16>;
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2), group = hq / hkv, items = sequences * hq;
  const int64_t room = longest + 1;
  const T *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *V = v.data_ptr<T>();
  T* O = out.data_ptr<T>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<T> keys(d * room), values(reduced ? d * room : 0), probabilities(reduced ? block * room : 0);
    std::vector<float> scores(block * room), partial(!reduced && d > SLICE ? block * room : 0);
    std::vector<float> acc(reduced ? block * d : 0), inverse(block);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t b = item / hq, h = item % hq, start = cu[b], len = cu[b + 1] - cu[b];
      const T* v_head = V + start * sv + h / group * d;
      pack_keys(K + start * sk + h / group * d, sk, len, d, keys.data());
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (reduced) pack_values(v_head, sv, len, d, values.data());
#endif
      for (int64_t r0 = 0; r0 < len; r0 += block) {
        const int64_t m = std::min(block, len - r0), n = causal ? r0 + m : len, width = reduced ? n + (n & 1) : n;
        T* o = O + (start + r0) * so + h * d;
        const T* q_rows = Q + (start + r0) * sq + h * d;
        if (reduced || d <= SLICE) {
          at::native::cpublas::brgemm(m, n, d, sq, len, n, false, q_rows, keys.data(), scores.data(), reduced);
        } else {  // fp32 sums over slices of the head's columns, added
          for (int64_t c = 0; c < d; c += SLICE) {
            float* sums = c == 0 ? scores.data() : partial.data();
            at::native::cpublas::brgemm(m, n, std::min(SLICE, d - c), sq, len, n, false, q_rows + c,
                                        keys.data() + c * len, sums, false);
            if (c > 0) add(scores.data(), sums, m * n);
          }
        }
        T* p = reduced ? probabilities.data() : reinterpret_cast<T*>(scores.data());
        for (int64_t row = 0; row < m; row++)
          inverse[row] = softmax_row(scores.data() + row * n, causal ? r0 + row + 1 : n, width, scale, p + row * width);
        if constexpr (reduced) {
#if defined(CPU_CAPABILITY_AVX512)
          at::native::cpublas::brgemm(m, d, width, width, d, d, false, p, values.data(), acc.data(), true);
          for (int64_t row = 0; row < m; row++)
            for (int64_t c = 0; c < d; c += W)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + row * so + c),
                                  at::vec::cvtfp32_bf16(__m512(Vec::loadu(acc.data() + row * d + c) * Vec(inverse[row]))));
#endif
        } else {
          at::native::cpublas::brgemm(m, d, n, n, sv, so, false, p, v_head, o, false);
          for (int64_t row = 0; row < m; row++)
            for (int64_t c = 0; c < d; c += W) (Vec::loadu(o + row * so + c) * Vec(inverse[row])).store(o + row * so + c);
        }
      }
    }
    at::native::cpublas::brgemm_release(reduced);
  });
}

}  // namespace

void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               const at::Tensor& cu_seqlens, double scale, bool causal, int64_t block) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
              v.scalar_type() == dtype && out.scalar_type() == dtype, "q, k, v and out all fp32 or all bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "[T, H, D] q, k, v and out");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  TORCH_CHECK(hq % hkv == 0 && v.size(1) == hkv && out.size(1) == hq, "query heads a multiple of key heads");
  TORCH_CHECK(d % 16 == 0 && k.size(2) == d && v.size(2) == d && out.size(2) == d, "head size a multiple of 16");
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == d && t->stride(0) % 2 == 0,
                "heads contiguous in each row, on the CPU");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous(), "int32 cu_seqlens");
  TORCH_CHECK(block > 0, "a positive block of query rows");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t sequences = cu_seqlens.size(0) - 1;
  TORCH_CHECK(sequences >= 0 && cu[0] == 0, "cu_seqlens from 0");
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(cu[sequences] <= t->size(0), "cu_seqlens within the tokens");
  int64_t longest = 0;
  for (int64_t b = 0; b < sequences; b++) {
    TORCH_CHECK(cu[b + 1] >= cu[b], "cu_seqlens in order");
    longest = std::max<int64_t>(longest, cu[b + 1] - cu[b]);
  }
  if (dtype == at::kFloat) {
    attend<float>(q, k, v, out, cu, sequences, longest, static_cast<float>(scale), causal, block);
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  attend<BFloat16>(q, k, v, out, cu, sequences, longest, static_cast<float>(scale), causal, block);
#else
  TORCH_CHECK(false, "bf16 attention needs the AVX-512 build (a CPU with AMX)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attention", &attention, "exact-softmax attention over packed fp32 or bf16 sequences");
}
