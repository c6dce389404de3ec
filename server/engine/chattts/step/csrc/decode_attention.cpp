// Single-query attention for the CPU token step, each row read only as far as its own mask
// reaches (issue #23). See server/engine/chattts/step/decode_attention.py for why and how it
// is built; this file is the kernel and its operator registration, nothing else.
//
// chattts_stream::decode_attention(q, keys, values, mask, scale) computes, for every row r
// and head h, softmax(scale * q[r,h] . keys[r,h,l]) over the positions l where mask[r,l] is
// true, times values[r,h,l] -- the arithmetic of math_attention in llama.py, in float32 --
// but it stops at each row's last true position instead of the longest row's length: at
// eight streams of different ages that halves the bytes the attention reads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(uint16_t bf16_bits) {
  uint32_t wide = static_cast<uint32_t>(bf16_bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}
inline float to_float(float value) { return value; }
inline float to_float(at::BFloat16 value) { return static_cast<float>(value); }

// What one (row, head) needs: its query (float32), its keys' and values' first position, the
// distance between positions, and the row's mask.
template <typename T>
struct Item {
  const float* q;
  const T* k;
  const T* v;
  int64_t k_stride, v_stride, dim;
  const bool* keep;  // keep[l * keep_stride]
  int64_t keep_stride, reach;
  float scale;
};

// Positions taken at a time: their scores, then their values. Keys and values are read in
// turns of this many rows (two memory streams at once), and the running softmax is rescaled
// once per turn (the one-pass softmax of flash-decoding).
constexpr int64_t CHUNK = 16;

// Portable form (any CPU, any head size): plain loops.
template <typename T>
void scores_generic(const Item<T>& it, int64_t l0, int64_t n, float* scores) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = it.k + (l0 + i) * it.k_stride;
    float acc = 0.f;
    for (int64_t j = 0; j < it.dim; ++j) acc += it.q[j] * to_float(row[j]);
    scores[i] = acc * it.scale;
  }
}

template <typename T>
void accumulate_generic(const Item<T>& it, int64_t l0, int64_t n, const float* p, float* acc) {
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] == 0.f) continue;  // masked
    const T* row = it.v + (l0 + i) * it.v_stride;
    for (int64_t j = 0; j < it.dim; ++j) acc[j] += p[i] * to_float(row[j]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CHATTTS_X86 1

// AVX-512: 16 floats a register; bf16 widens by a zero-extension and a shift.
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <typename T>
__attribute__((target("avx512f"))) void scores_avx512(const Item<T>& it, int64_t l0, int64_t n, float* scores) {
  for (int64_t i = 0; i < n; ++i) {  // dim: a multiple of 16
    const T* row = it.k + (l0 + i) * it.k_stride;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(it.q), load16(row));
    for (int64_t j = 16; j < it.dim; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(it.q + j), load16(row + j), acc);
    scores[i] = _mm512_reduce_add_ps(acc) * it.scale;
  }
}

template <typename T>
__attribute__((target("avx512f"))) void accumulate_avx512(const Item<T>& it, int64_t l0, int64_t n, const float* p,
                                                          float* acc) {
  int64_t j = 0;
  for (; j + 64 <= it.dim; j += 64) {  // 64 columns in four registers
    __m512 a0 = _mm512_loadu_ps(acc + j), a1 = _mm512_loadu_ps(acc + j + 16);
    __m512 a2 = _mm512_loadu_ps(acc + j + 32), a3 = _mm512_loadu_ps(acc + j + 48);
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] == 0.f) continue;
      const __m512 w = _mm512_set1_ps(p[i]);
      const T* row = it.v + (l0 + i) * it.v_stride + j;
      a0 = _mm512_fmadd_ps(w, load16(row), a0);
      a1 = _mm512_fmadd_ps(w, load16(row + 16), a1);
      a2 = _mm512_fmadd_ps(w, load16(row + 32), a2);
      a3 = _mm512_fmadd_ps(w, load16(row + 48), a3);
    }
    _mm512_storeu_ps(acc + j, a0);
    _mm512_storeu_ps(acc + j + 16, a1);
    _mm512_storeu_ps(acc + j + 32, a2);
    _mm512_storeu_ps(acc + j + 48, a3);
  }
  for (; j < it.dim; j += 16) {  // then 16 at a time
    __m512 a = _mm512_loadu_ps(acc + j);
    for (int64_t i = 0; i < n; ++i)
      if (p[i] != 0.f) a = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), load16(it.v + (l0 + i) * it.v_stride + j), a);
    _mm512_storeu_ps(acc + j, a);
  }
}

// AVX2 + FMA: 8 floats a register.
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
__attribute__((target("avx2,fma"))) void scores_avx2(const Item<T>& it, int64_t l0, int64_t n, float* scores) {
  for (int64_t i = 0; i < n; ++i) {  // dim: a multiple of 8
    const T* row = it.k + (l0 + i) * it.k_stride;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(it.q), load8(row));
    for (int64_t j = 8; j < it.dim; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(it.q + j), load8(row + j), acc);
    scores[i] = sum8(acc) * it.scale;
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void accumulate_avx2(const Item<T>& it, int64_t l0, int64_t n, const float* p,
                                                        float* acc) {
  int64_t j = 0;
  for (; j + 32 <= it.dim; j += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + j), a1 = _mm256_loadu_ps(acc + j + 8);
    __m256 a2 = _mm256_loadu_ps(acc + j + 16), a3 = _mm256_loadu_ps(acc + j + 24);
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] == 0.f) continue;
      const __m256 w = _mm256_set1_ps(p[i]);
      const T* row = it.v + (l0 + i) * it.v_stride + j;
      a0 = _mm256_fmadd_ps(w, load8(row), a0);
      a1 = _mm256_fmadd_ps(w, load8(row + 8), a1);
      a2 = _mm256_fmadd_ps(w, load8(row + 16), a2);
      a3 = _mm256_fmadd_ps(w, load8(row + 24), a3);
    }
    _mm256_storeu_ps(acc + j, a0);
    _mm256_storeu_ps(acc + j + 8, a1);
    _mm256_storeu_ps(acc + j + 16, a2);
    _mm256_storeu_ps(acc + j + 24, a3);
  }
  for (; j < it.dim; j += 8) {
    __m256 a = _mm256_loadu_ps(acc + j);
    for (int64_t i = 0; i < n; ++i)
      if (p[i] != 0.f) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), load8(it.v + (l0 + i) * it.v_stride + j), a);
    _mm256_storeu_ps(acc + j, a);
  }
}
#endif

enum class Isa { generic, avx2, avx512 };

Isa best_isa(int64_t dim) {
#ifdef CHATTTS_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f");
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (has_avx512 && dim % 16 == 0) return Isa::avx512;
  if (has_avx2 && dim % 8 == 0) return Isa::avx2;
#endif
  (void)dim;
  return Isa::generic;
}

template <typename T>
void scores_for(Isa isa, const Item<T>& it, int64_t l0, int64_t n, float* scores) {
#ifdef CHATTTS_X86
  if (isa == Isa::avx512) return scores_avx512(it, l0, n, scores);
  if (isa == Isa::avx2) return scores_avx2(it, l0, n, scores);
#endif
  (void)isa;
  scores_generic(it, l0, n, scores);
}

template <typename T>
void accumulate_for(Isa isa, const Item<T>& it, int64_t l0, int64_t n, const float* p, float* acc) {
#ifdef CHATTTS_X86
  if (isa == Isa::avx512) return accumulate_avx512(it, l0, n, p, acc);
  if (isa == Isa::avx2) return accumulate_avx2(it, l0, n, p, acc);
#endif
  (void)isa;
  accumulate_generic(it, l0, n, p, acc);
}

// out = softmax over the kept positions of [0, reach) of the scores, times the values: CHUNK
// positions at a time, the running maximum and sum rescaled as a larger score comes.
template <typename T>
void attend(Isa isa, const Item<T>& it, float* out) {
  const float none = -std::numeric_limits<float>::infinity();
  float scores[CHUNK];
  float top = none, total = 0.f;
  for (int64_t j = 0; j < it.dim; ++j) out[j] = 0.f;
  for (int64_t l0 = 0; l0 < it.reach; l0 += CHUNK) {
    const int64_t n = std::min(CHUNK, it.reach - l0);
    scores_for(isa, it, l0, n, scores);
    float chunk_top = none;
    for (int64_t i = 0; i < n; ++i) {
      if (!it.keep[(l0 + i) * it.keep_stride]) scores[i] = none;
      chunk_top = std::max(chunk_top, scores[i]);
    }
    if (chunk_top == none) continue;  // all masked
    if (chunk_top > top) {
      const float rescale = top == none ? 0.f : std::exp(top - chunk_top);
      for (int64_t j = 0; j < it.dim; ++j) out[j] *= rescale;
      total *= rescale;
      top = chunk_top;
    }
    for (int64_t i = 0; i < n; ++i) {
      scores[i] = scores[i] == none ? 0.f : std::exp(scores[i] - top);
      total += scores[i];
    }
    accumulate_for(isa, it, l0, n, scores, out);
  }
  if (total > 0.f) {
    const float inv = 1.f / total;
    for (int64_t j = 0; j < it.dim; ++j) out[j] *= inv;
  }
}

template <typename T, typename Q>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, float scale,
         at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(3), length = k.size(2);
  const int64_t groups = heads / k.size(1);
  const Isa isa = best_isa(dim);
  const Q* q_data = q.data_ptr<Q>();
  const T* k_data = static_cast<const T*>(k.data_ptr());
  const T* v_data = static_cast<const T*>(v.data_ptr());
  const bool* m_data = mask.data_ptr<bool>();
  Q* o_data = out.data_ptr<Q>();
  // The mask may be broadcast over rows or positions (stride 0): it is read through its strides.
  const int64_t m_row = mask.size(0) == 1 ? 0 : mask.stride(0), m_col = mask.size(3) == 1 ? 0 : mask.stride(3);

  // Each row reads up to its last kept position, never past it: found once per row, for all its heads.
  std::vector<int64_t> reach(static_cast<size_t>(batch));
  for (int64_t r = 0; r < batch; ++r) {
    const bool* keep = m_data + r * m_row;
    int64_t n = length;
    while (n > 0 && !keep[(n - 1) * m_col]) --n;
    reach[r] = n;
  }

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_row(static_cast<size_t>(dim)), o_row(static_cast<size_t>(dim));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads, hk = h / groups;
      const bool* keep = m_data + r * m_row;
      const Q* q_src = q_data + r * q.stride(0) + h * q.stride(1);
      for (int64_t j = 0; j < dim; ++j) q_row[j] = to_float(q_src[j * q.stride(3)]);
      const Item<T> it{q_row.data(),
                       k_data + r * k.stride(0) + hk * k.stride(1),
                       v_data + r * v.stride(0) + hk * v.stride(1),
                       k.stride(2),
                       v.stride(2),
                       dim,
                       keep,
                       m_col,
                       reach[r],
                       scale};
      attend(isa, it, o_row.data());
      Q* o_dst = o_data + item * dim;
      for (int64_t j = 0; j < dim; ++j) o_dst[j] = static_cast<Q>(o_row[j]);
    }
  });
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "decode_attention: q must be (batch, heads, 1, dim)");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: keys and values must be (batch, kv_heads, length, dim), the same shape");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "decode_attention: keys and values differ in dtype");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 || keys.scalar_type() == at::kFloat,
              "decode_attention: keys must be bfloat16 or float32");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: q must be bfloat16 or float32");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(3), length = keys.size(2);
  TORCH_CHECK(keys.size(0) == batch && keys.size(3) == dim, "decode_attention: keys do not match q");
  TORCH_CHECK(keys.size(1) > 0 && heads % keys.size(1) == 0, "decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4 && (mask.size(0) == batch || mask.size(0) == 1) &&
                  (mask.size(3) == length || mask.size(3) == 1),
              "decode_attention: mask must be bool, broadcastable to (batch, 1, 1, length)");
  // The slot views are strided (a row and a head are whole slots apart); only the head
  // dimension must be contiguous. Anything else is made so (a copy, never taken by the step).
  const at::Tensor k = keys.stride(3) == 1 ? keys : keys.contiguous();
  const at::Tensor v = values.stride(3) == 1 ? values : values.contiguous();
  at::Tensor out = at::empty({batch, heads, 1, dim}, q.options());
  const float s = static_cast<float>(scale);
  const bool kv_bf16 = k.scalar_type() == at::kBFloat16, q_bf16 = q.scalar_type() == at::kBFloat16;
  if (kv_bf16 && q_bf16) run<uint16_t, at::BFloat16>(q, k, v, mask, s, out);
  else if (kv_bf16) run<uint16_t, float>(q, k, v, mask, s, out);
  else if (q_bf16) run<float, at::BFloat16>(q, k, v, mask, s, out);
  else run<float, float>(q, k, v, mask, s, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chattts_stream, m) {
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(chattts_stream, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }
