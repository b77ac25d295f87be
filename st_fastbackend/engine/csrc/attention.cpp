// Exact-softmax attention over packed sequences on x86-64 CPUs with AVX2 or AVX-512: one parallel region per call.
//
// q [T, Hq, D], k and v [T, Hkv, D] (Hq a multiple of Hkv; rows may be strided, each row's heads contiguous), out
// [T, Hq, D], cu_seqlens int32 [B + 1]; all fp32, or all bf16 (AVX-512 builds, a CPU with bf16 dot products). One
// work item per (sequence, group of key heads: heads_per_item), handed out in order by an atomic counter. Per item,
// its key heads' keys and values are copied into blocks of KEYS (zeros past the sequence's end), then for each block
// of query rows and each of the item's query heads: scores = q.k^T block by block through PyTorch's cpublas::brgemm
// (oneDNN; fp32 sums), a softmax row by row in fp32 (max, exp, sum), out = p.v summed over the key blocks by brgemm,
// divided by the row's sum.
// bf16 products (of bf16 tensors, or of fp32 tensors rounded to bf16 as they are read: an fp32 model's bf16 products):
// keys and values in oneDNN's VNNI pairs, probabilities rounded to bf16 before p.v (as PyTorch's flash kernel rounds
// them), the output in the tensors' dtype.
// Causal: a query at row r sees keys 0..r.
//
// Every brgemm has one of a few shapes whatever the lengths: query rows and the last key block round up to multiples
// of ROWS, full key blocks are KEYS wide, leading dimensions are fixed. PyTorch keeps each shape's JIT kernel for the
// life of the thread (never freed), so shapes that followed the lengths grew a process by ~700 MB over MiniLM's
// 2,185 paragraphs (eval/RESULTS.md, 2026-12-06). Built by engine/cpu_kernel.py with CPU_CAPABILITY AVX512 or AVX2
// (the width of at::vec's vectors: 16 or 8 floats).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();  // 16 floats (AVX-512) or 8 (AVX2)
constexpr int64_t KEYS = 64;        // keys per block
constexpr int64_t ROWS = 16;        // query rows and a last key block round up to a multiple of this
// fp32 q.k^T sums at most SLICE products in one chain and adds the slices: one chain of 256 (Gemma's heads) was 1.6x
// as far from exact as PyTorch's fp32 kernel on AVX2, slices of 128 as close as it (eval/RESULTS.md, 2026-12-06).
constexpr int64_t SLICE = 128;
constexpr int64_t ITEM_BYTES = 256 * 1024;  // one work item's keys and values at most (where heads can be split)
constexpr int64_t PREFETCH = 8;             // rows ahead that a gather asks for

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Asks for row j + PREFETCH of x (row stride ld, `bytes` from each row's start) while row j is read.
template <typename T>
void prefetch_ahead(const T* x, int64_t ld, int64_t j, int64_t n, int64_t bytes) {
  if (j + PREFETCH < n)
    for (int64_t byte = 0; byte < bytes; byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(x + (j + PREFETCH) * ld) + byte, _MM_HINT_T0);
}

// `bytes` (a multiple of 32) from `from` to `to`.
void copy(void* to, const void* from, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<char*>(to) + at),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const char*>(from) + at)));
}

// d elements of a row in the kernel's dtype: copied, or fp32 rounded to bf16 (to nearest even, as Tensor.to rounds).
template <typename In, typename T>
const T* as_computed(const In* from, int64_t d, T* into) {
  if constexpr (std::is_same_v<In, T>) {
    return from;
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    for (int64_t c = 0; c < d; c += W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(into + c), at::vec::cvtfp32_bf16(_mm512_loadu_ps(from + c)));
#endif
    return into;
  }
}

// Keys: block b is K^T [d, KEYS] row-major, of keys b * KEYS onwards (bf16: in VNNI pairs, [d / 2, KEYS, 2]: as
// 32-bit words, key j's columns 2c and 2c + 1 at (b * d / 2 + c) * KEYS + j % KEYS). Values: block b is V [KEYS, d]
// (bf16: in VNNI pairs, [KEYS / 2, d, 2]: rows 2i and 2i + 1 of column c at (i * d + c) * 2; an odd last row is
// paired with zeros). Either way block b holds elements b * KEYS * d onwards; keys and values past the sequence are
// zeros, written by start_heads before its rows are packed.
void pack_key(const float* row, int64_t j, int64_t d, float* keys) {
  float* at = keys + j / KEYS * d * KEYS + j % KEYS;
  for (int64_t c = 0; c < d; c++) at[c * KEYS] = row[c];
}

void pack_key(const BFloat16* row, int64_t j, int64_t d, BFloat16* keys) {
  auto from = reinterpret_cast<const uint32_t*>(row);
  uint32_t* at = reinterpret_cast<uint32_t*>(keys) + j / KEYS * (d / 2) * KEYS + j % KEYS;
  for (int64_t c = 0; c < d / 2; c++) at[c * KEYS] = from[c];
}

void pack_value(const float* row, int64_t j, int64_t d, float* values) {
  copy(values + j * d, row, sizeof(float) * d);
}

void pack_value(const BFloat16* row, int64_t j, int64_t d, BFloat16* values) {
  BFloat16* at = values + j / 2 * 2 * d + j % 2;
  for (int64_t c = 0; c < d; c++) at[2 * c] = row[c];
}

// Zeros where `heads` heads' keys and values (`room` keys each) lie past a sequence of `len`.
template <typename T>
void start_heads(T* keys, T* values, int64_t heads, int64_t room, int64_t len, int64_t d) {
  const int64_t end = round_up(len, KEYS) * d, pair = std::is_same_v<T, BFloat16> ? len % 2 : 0;
  for (int64_t g = 0; g < heads; g++) {
    std::fill(keys + g * room * d + len / KEYS * KEYS * d, keys + g * room * d + end, T(0));
    std::fill(values + g * room * d + (len - pair) * d, values + g * room * d + end, T(0));
  }
}

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

// exp(scale * s[j] - max) for the first `count` of W values, zeros after them.
Vec exp_part(const float* s, int64_t count, const Vec& factor, const Vec& shift) {
  if (count <= 0) return Vec(0.f);
  if (count >= W) return (Vec::loadu(s) * factor - shift).exp_u20();
  return Vec::set(Vec(0.f), (Vec::loadu(s, count) * factor - shift).exp_u20(), count);
}

// One row of scores over `keys` keys, in key blocks `stride` apart (KEYS each; `width` columns in all, a multiple of
// ROWS): p = exp(scale * s - max) for the first `keys`, 0 for the rest of the width, in fp32 in place or rounded to
// bf16 into p (the same layout); returns 1 / the sum.
template <typename T>
float softmax_row(float* s, int64_t keys, int64_t width, int64_t stride, float scale, T* p) {
  Vec top(-INFINITY);
  for (int64_t j = 0; j < keys; j += W) {
    const float* at = s + j / KEYS * stride + j % KEYS;
    top = at::vec::maximum(top, j + W <= keys ? Vec::loadu(at)
                                              : Vec::set(Vec(-INFINITY), Vec::loadu(at, keys - j), keys - j));
  }
  const Vec factor(scale), shift(reduce(top, true) * scale);
  Vec sum(0.f);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < width; j += W) {
      const int64_t at = j / KEYS * stride + j % KEYS;
      const Vec e = exp_part(s + at, keys - j, factor, shift);
      sum = sum + e;
      e.store(p + at);
    }
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    for (int64_t j = 0; j < width; j += 2 * W) {  // 32 columns at a time; a width of 16 more ends with 16
      const int64_t at = j / KEYS * stride + j % KEYS;
      const int64_t count = std::min(2 * W, width - j);
      const Vec low = exp_part(s + at, keys - j, factor, shift);
      const Vec high = exp_part(s + at + W, std::min(keys - j, count) - W, factor, shift);
      sum = sum + low + high;
      const auto mask = static_cast<__mmask32>((1ull << count) - 1);
      _mm512_mask_storeu_epi16(p + at, mask, at::vec::cvtfp32_bf16(__m512(low), __m512(high)));
    }
#endif
  }
  return 1.f / reduce(sum, false);
}

// The kv heads one work item takes: the most that divide hkv with their keys and values within ITEM_BYTES (an L2's
// share), fewer where that would leave under 4 items per thread. A sequence's rows are read once per item, each
// row's heads in one contiguous run (a row per head, 4.6 KB apart in MiniLM's fused q/k/v, missed the prefetchers:
// 13% of the kernel's time waited on those loads). The result does not depend on it: each head's products and
// softmax are the same whatever item holds them.
int64_t heads_per_item(int64_t hkv, int64_t room, int64_t d, int64_t bytes, int64_t sequences) {
  const int64_t threads = at::get_num_threads();
  for (int64_t c = hkv; c > 1; c--)
    if (hkv % c == 0 && 2 * room * d * c * bytes <= ITEM_BYTES && sequences * (hkv / c) >= 4 * threads) return c;
  return 1;
}

// In: the tensors' dtype; T: the products' (bf16 for fp32 tensors: bf16 products of an fp32 model).
template <typename In, typename T>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, const int32_t* cu,
            int64_t sequences, int64_t longest, float scale, bool causal, int64_t block) {
  constexpr bool reduced = std::is_same_v<T, BFloat16>;
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2), group = hq / hkv;
  const int64_t room = round_up(longest, KEYS), stride = block * KEYS;  // a key block's scores: [block, KEYS]
  const int64_t per = heads_per_item(hkv, room, d, sizeof(T), sequences), chunks = hkv / per;
  const int64_t items = sequences * chunks, qheads = per * group;  // an item: kv heads c * per .. and their queries
  const In *Q = q.data_ptr<In>(), *K = k.data_ptr<In>(), *V = v.data_ptr<In>();
  In* O = out.data_ptr<In>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0), so = out.stride(0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<T> keys(per * room * d), values(per * room * d), queries(qheads * block * d);
    std::vector<T> probabilities(reduced ? room * block : 0);
    std::vector<float> scores(room * block), partial(!reduced && d > SLICE ? stride : 0), acc(qheads * block * d);
    std::vector<float> inverse(qheads * block);
    std::vector<T> rounded(std::is_same_v<In, T> ? 0 : d);  // a key or value row rounded to bf16, to be packed
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t b = item / chunks, first = item % chunks * per, start = cu[b], len = cu[b + 1] - cu[b];
      // the keys and values of the item's kv heads, packed per head, each row's heads read in one run
      const In *ks = K + start * sk + first * d, *vs = V + start * sv + first * d;
      start_heads(keys.data(), values.data(), per, room, len, d);
      for (int64_t j = 0; j < len; j++) {
        prefetch_ahead(ks, sk, j, len, sizeof(In) * per * d);
        prefetch_ahead(vs, sv, j, len, sizeof(In) * per * d);
        for (int64_t g = 0; g < per; g++) {
          pack_key(as_computed(ks + j * sk + g * d, d, rounded.data()), j, d, keys.data() + g * room * d);
          pack_value(as_computed(vs + j * sv + g * d, d, rounded.data()), j, d, values.data() + g * room * d);
        }
      }
      for (int64_t r0 = 0; r0 < len; r0 += block) {
        const int64_t m = std::min(block, len - r0), rows = round_up(m, ROWS);
        const int64_t n = causal ? r0 + m : len, width = round_up(n, ROWS);  // keys seen, their padded columns
        // the block's queries of every query head of the item: [qheads][block][d], rows past m zero
        const In* qs = Q + (start + r0) * sq + first * group * d;
        for (int64_t r = 0; r < m; r++) {
          prefetch_ahead(qs, sq, r, m, sizeof(In) * qheads * d);
          for (int64_t h = 0; h < qheads; h++) {
            T* into = queries.data() + (h * block + r) * d;
            if constexpr (std::is_same_v<In, T>) copy(into, qs + r * sq + h * d, sizeof(T) * d);
            else as_computed(qs + r * sq + h * d, d, into);
          }
        }
        for (int64_t h = 0; h < qheads; h++) {
          T* qh = queries.data() + h * block * d;
          std::fill(qh + m * d, qh + rows * d, T(0));
          const T *kh = keys.data() + h / group * room * d, *vh = values.data() + h / group * room * d;
          for (int64_t j = 0; j < width; j += KEYS) {  // scores of key block j / KEYS: [rows, KEYS], cols filled
            const int64_t cols = std::min(KEYS, width - j);
            float* s = scores.data() + j / KEYS * stride;
            const T* kt = kh + j * d;
            if (reduced || d <= SLICE) {
              at::native::cpublas::brgemm(rows, cols, d, d, KEYS, KEYS, false, qh, kt, s, reduced);
            } else {  // fp32 sums over slices of the head's columns, added
              for (int64_t c = 0; c < d; c += SLICE) {
                float* sums = c == 0 ? s : partial.data();
                at::native::cpublas::brgemm(rows, cols, std::min(SLICE, d - c), d, KEYS, KEYS, false, qh + c,
                                            kt + c * KEYS, sums, false);
                if (c > 0) add(s, sums, rows * KEYS);
              }
            }
          }
          T* p = reduced ? probabilities.data() : reinterpret_cast<T*>(scores.data());
          float* inv = inverse.data() + h * block;
          for (int64_t row = 0; row < m; row++)
            inv[row] = softmax_row(scores.data() + row * KEYS, causal ? r0 + row + 1 : n, width, stride, scale,
                                   p + row * KEYS);
          for (int64_t row = m; row < rows; row++)  // rows past the sequence: zero probabilities, ignored sums
            for (int64_t j = 0; j < width; j += KEYS)
              std::fill_n(p + j / KEYS * stride + row * KEYS, std::min(KEYS, width - j), T(0));
          float* a = acc.data() + h * block * d;
          for (int64_t j = 0; j < width; j += KEYS)  // a [rows, d] += p [rows, cols] . v [cols, d]
            at::native::cpublas::brgemm(rows, d, std::min(KEYS, width - j), KEYS, d, d, j > 0,
                                        p + j / KEYS * stride, vh + j * d, a, reduced);
        }
        for (int64_t r = 0; r < m; r++) {  // the block's output rows, each row's heads in one run
          In* o = O + (start + r0 + r) * so + first * group * d;
          for (int64_t h = 0; h < qheads; h++) {
            const Vec inv(inverse[h * block + r]);
            const float* a = acc.data() + (h * block + r) * d;
            if constexpr (std::is_same_v<In, BFloat16>) {
#if defined(CPU_CAPABILITY_AVX512)
              for (int64_t c = 0; c < d; c += W)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + h * d + c),
                                    at::vec::cvtfp32_bf16(__m512(Vec::loadu(a + c) * inv)));
#endif
            } else {
              for (int64_t c = 0; c < d; c += W) (Vec::loadu(a + c) * inv).store(o + h * d + c);
            }
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(reduced);
  });
}

}  // namespace

void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               const at::Tensor& cu_seqlens, double scale, bool causal, int64_t block, bool bf16) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
              v.scalar_type() == dtype && out.scalar_type() == dtype, "q, k, v and out all fp32 or all bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "[T, H, D] q, k, v and out");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && v.size(1) == hkv && out.size(1) == hq,
              "query heads a multiple of key heads");
  TORCH_CHECK(d % 16 == 0 && k.size(2) == d && v.size(2) == d && out.size(2) == d, "head size a multiple of 16");
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == d && t->stride(0) % 2 == 0,
                "heads contiguous in each row, on the CPU");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_contiguous() && cu_seqlens.dim() == 1 &&
              cu_seqlens.device().is_cpu(), "int32 cu_seqlens, one row on the CPU");
  TORCH_CHECK(scale > 0, "a positive softmax scale");
  TORCH_CHECK(block > 0 && block % ROWS == 0, "a block of query rows that is a positive multiple of 16");
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
  TORCH_CHECK(bf16 || dtype == at::kFloat, "bf16 tensors take bf16 products");
  const float factor = static_cast<float>(scale);
  if (!bf16) {
    attend<float, float>(q, k, v, out, cu, sequences, longest, factor, causal, block);
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (dtype == at::kFloat)
    attend<float, BFloat16>(q, k, v, out, cu, sequences, longest, factor, causal, block);
  else
    attend<BFloat16, BFloat16>(q, k, v, out, cu, sequences, longest, factor, causal, block);
#else
  TORCH_CHECK(false, "bf16 products need the AVX-512 build (a CPU with bf16 dot products)");
#endif
}
