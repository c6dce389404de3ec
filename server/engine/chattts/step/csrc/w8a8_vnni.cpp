// The w8a8 product for CPUs with AVX512-VNNI (issue #46): int8 weights times int8 activations,
// each activation row quantized on its own scale, the weights laid out for VNNI. See
// server/engine/chattts/step/w8a8_vnni.py for why and how it is built and packed; this file is
// the kernel and its operator registration, nothing else.
//
// chattts_stream::w8a8_vnni(x, packed, colsum, scale, out_features) computes, for every row m
// of x (float32 or bfloat16, (M, K)) and output channel n:
//
//   q[m, k] = round(x[m, k] * (127 / max_k |x[m, k]|))     (in -127..127; half to even)
//   y[m, n] = (sum_k q[m, k] * w[n, k]) * (scale[n] * s[m]),  s[m] = max_k |x[m, k]| / 127
//
// in float32, where w is the int8 weight and scale its per-channel scale. The sum is exact
// integer arithmetic: a row's output depends on nothing but the row.
//
// Layout of `packed` (int8, (Np / 64, Kp / 4, 64, 4)): output channels in groups of 64, and
// within a group, for every 4 input channels, the 4 weights of each of the 64 channels side by
// side. One 64-byte load is then 16 channels x 4 inputs, what one VPDPBUSD multiplies with 4
// activation bytes broadcast to every lane, and a group's weights are one contiguous stream
// (the hardware prefetcher's best case). Np and Kp are padded with zero weights.
//
// VPDPBUSD multiplies unsigned by signed bytes, so activations enter as q + 128 and the sum is
// corrected by 128 * colsum[n] (colsum: each channel's sum of int8 weights).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 64;  // output channels a group of the packed layout holds

#if defined(__x86_64__)

// acc += a (unsigned bytes) . w (signed bytes), four at a time into each int32 lane. Inline
// assembly on named accumulators: given the intrinsic, GCC 12 copies the accumulators from
// register to register around every product (twice the instructions), and given an array of
// accumulators it keeps them on the stack.
#define W8A8_DOT(acc, a, w) asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(w))

// One row's four products of a 4-block step (its bytes k..k+3 broadcast, times 64 channels).
#define W8A8_ROW4(r)                                                          \
  if constexpr (MR > r) {                                                     \
    const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(x##r[k]));       \
    W8A8_DOT(c##r##0, a, w0);                                                 \
    W8A8_DOT(c##r##1, a, w1);                                                 \
    W8A8_DOT(c##r##2, a, w2);                                                 \
    W8A8_DOT(c##r##3, a, w3);                                                 \
  }

// Integer sums of MR (1..4) rows times a whole group (4 blocks of 16 channels): each weight is
// loaded once for all the rows. sums: MR x 64 int32.
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void sums_group(const uint32_t* const* x, int64_t k4,
                                                                         const int8_t* w, int32_t* sums) {
  const uint32_t *x0 = x[0], *x1 = x[MR > 1 ? 1 : 0], *x2 = x[MR > 2 ? 2 : 0], *x3 = x[MR > 3 ? 3 : 0];
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00,
          c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  for (int64_t k = 0; k < k4; ++k, w += kGroup * 4) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
    W8A8_ROW4(0) W8A8_ROW4(1) W8A8_ROW4(2) W8A8_ROW4(3)
  }
  const __m512i all[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}};
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(sums + i * kGroup + j * 16, all[i][j]);
}

// out[m, n] = (sums[m, n] - 128 colsum[n]) * scale[n] * row_scale[m] for a group's valid channels.
__attribute__((target("avx512f,avx512bw"))) void finish(const int32_t* sums, int64_t count, int64_t m0, int64_t n0,
                                                          int64_t n_valid, const int32_t* colsum, const float* scale,
                                                          const float* row_scale, float* out) {
  for (int64_t j = 0; j < kGroup / 16; ++j) {
    const int64_t n = n0 + j * 16;
    if (n >= n_valid) break;
    const __mmask16 keep = n + 16 <= n_valid ? __mmask16(0xFFFF) : __mmask16((1u << (n_valid - n)) - 1);
    const __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(keep, colsum + n), 7);
    const __m512 channel = _mm512_maskz_loadu_ps(keep, scale + n);
    for (int64_t i = 0; i < count; ++i) {
      const __m512i total = _mm512_sub_epi32(_mm512_loadu_si512(sums + i * kGroup + j * 16), offset);
      const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(channel, _mm512_set1_ps(row_scale[m0 + i])));
      _mm512_mask_storeu_ps(out + (m0 + i) * n_valid + n, keep, y);
    }
  }
}

// Every row times group g, four rows at a time: the first four read the group from memory,
// the next ones from the core's cache (a group is 64 x in_features bytes: 48 KiB at 768, 192 KiB
// at 3072). Tried and slower at eight rows: eight at a time over each half of the group
// (2 x 8 accumulators), which reads every weight from memory once but in two strided passes.
void group_product(const uint8_t* xq, int64_t kp, int64_t rows, const int8_t* packed, int64_t g, int64_t n_valid,
                   const int32_t* colsum, const float* scale, const float* row_scale, float* out) {
  const int8_t* group = packed + g * kGroup * kp;
  const int64_t k4 = kp / 4;
  alignas(64) int32_t sums[4 * kGroup];
  const uint32_t* x[4];
  for (int64_t m = 0; m < rows;) {
    const int64_t count = std::min<int64_t>(rows - m, 4);
    for (int64_t i = 0; i < count; ++i) x[i] = reinterpret_cast<const uint32_t*>(xq + (m + i) * kp);
    switch (count) {
      case 1: sums_group<1>(x, k4, group, sums); break;
      case 2: sums_group<2>(x, k4, group, sums); break;
      case 3: sums_group<3>(x, k4, group, sums); break;
      default: sums_group<4>(x, k4, group, sums); break;
    }
    finish(sums, count, m, g * kGroup, n_valid, colsum, scale, row_scale, out);
    m += count;
  }
}

// 16 inputs as float32 (masked: the rest read as zero).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* p, __mmask16 keep) {
  return _mm512_maskz_loadu_ps(keep, p);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const at::BFloat16* p, __mmask16 keep) {
  const __m256i bits = _mm256_maskz_loadu_epi16(keep, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Each row's scale and its bytes (q + 128), padded with the zero byte 128 to kp. The product
// q = round(x * 127 / largest) rounds half to even (the CPU's default rounding), like
// std::nearbyint and torch.round.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_rows(const T* x, int64_t rows, int64_t k,
                                                                          int64_t kp, uint8_t* xq, float* row_scale) {
  const auto mask = [k](int64_t i) {
    return k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
  };
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * k;
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(row + i, mask(i))));
    const float largest = _mm512_reduce_max_ps(top);
    const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
    uint8_t* q = xq + m * kp;
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 keep = mask(i);
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + i, keep), inverse));
      v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127)),
                           _mm512_set1_epi32(128));
      _mm_mask_storeu_epi8(q + i, keep, _mm512_cvtepi32_epi8(v));
    }
    std::fill(q + k, q + kp, uint8_t{128});
    row_scale[m] = largest / 127.f;
  }
}

#endif

at::Tensor w8a8_vnni_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& colsum,
                         const at::Tensor& scale, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "w8a8_vnni: x must be (rows, in_features)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "w8a8_vnni: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == kGroup &&
                  packed.size(3) == 4 && packed.is_contiguous(),
              "w8a8_vnni: packed must be contiguous int8 (groups, in/4, 64, 4)");
  const int64_t rows = x.size(0), k = x.size(1), kp = packed.size(1) * 4;
  TORCH_CHECK(k <= kp && kp - k < 4, "w8a8_vnni: x has ", k, " inputs, the weights ", kp, " (padded)");
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kGroup && out_features > (packed.size(0) - 1) * kGroup,
              "w8a8_vnni: out_features does not match the packed groups");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() >= out_features,
              "w8a8_vnni: colsum must be int32 with a value per output channel");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() >= out_features,
              "w8a8_vnni: scale must be float32 with a value per output channel");
  at::Tensor out = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  if (rows == 0) return out;
#if defined(__x86_64__)
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "w8a8_vnni: this CPU has no AVX512-VNNI");
  const at::Tensor xc = x.contiguous();
  std::vector<uint8_t> xq(static_cast<size_t>(rows * kp));
  std::vector<float> row_scale(static_cast<size_t>(rows));
  if (xc.scalar_type() == at::kFloat) quantize_rows(xc.data_ptr<float>(), rows, k, kp, xq.data(), row_scale.data());
  else quantize_rows(xc.data_ptr<at::BFloat16>(), rows, k, kp, xq.data(), row_scale.data());
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* sc = scale.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Groups are the unit of work: each is read by one thread, once.
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) group_product(xq.data(), kp, rows, w, g, out_features, cs, sc, row_scale.data(), y);
  });
  return out;
#else
  TORCH_CHECK(false, "w8a8_vnni: x86-64 only");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(chattts_stream, m) {
  m.def("w8a8_vnni(Tensor x, Tensor packed, Tensor colsum, Tensor scale, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(chattts_stream, CPU, m) { m.impl("w8a8_vnni", &w8a8_vnni_cpu); }
