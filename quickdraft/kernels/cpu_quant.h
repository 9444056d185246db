// The packed chunk layout of quickdraft's GGUF-quantized weights, shared by the two kernels that read it:
// cpu_quant.cpp (codes widened to bf16, AVX512-BF16: the fallback) and cpu_quant_vnni.cpp (integer dot products,
// AVX512-VNNI). quickdraft.kernels.quant packs the chunks; cpu_quant.cpp describes where the codes sit.
//
// Everything defined here has internal linkage (an unnamed namespace in each file that includes it): the two files
// are compiled for different instruction sets, and the linker must never swap one file's copy of an inline function
// for the other's. (argmax_by_blocks is only declared: cpu_rows.cpp defines it.)

#pragma once

#include <c10/util/Exception.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

#include "cpu_quant_scalar.h"  // the type ids, the high bits' positions, one weight's value

// cpu_rows.cpp: each row's first index of its maximum over columns [0, valid_columns) of an [M, 16 total_groups]
// float32 output that is never written whole: compute(g0, g1, y, ldy) writes its groups [g0, g1) of 16 columns
// (column 16 g0 at y, rows ldy apart) into a small scratch per thread, reduced there. Returns the indices [M] and
// whether some row holds a NaN (then the indices mean nothing: the caller falls back).
using GroupsToFloat = std::function<void(int64_t g0, int64_t g1, float* y, int64_t ldy)>;
std::tuple<at::Tensor, bool> argmax_by_blocks(int64_t M, int64_t total_groups, int64_t valid_columns,
                                              const GroupsToFloat& compute);

namespace {

// Calls f(part, lo, hi) for each part's groups [lo, hi) (its own numbering) within groups [begin, end) of all
// parts side by side (a range may span parts; P has `groups`).
template <class P, class F>
void for_parts(const std::vector<P>& parts, int64_t begin, int64_t end, F&& f) {
  int64_t base = 0;
  for (const P& part : parts) {
    const int64_t lo = std::max(begin, base), hi = std::min(end, base + part.groups);
    if (lo < hi) f(part, lo - base, hi - base);
    base += part.groups;
  }
}

inline __m512i load(const void* p) { return _mm512_loadu_si512(p); }
inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i u8x16i(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i i8x16i(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16 outputs stored as bf16 (a layer's activations) or float32 (logits: bf16 would round near-ties into ties).
inline void store16(c10::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }

// Per type: SB inputs per chunk (a packed super-block) and the chunk's bytes, its kSubs sub-blocks of kSubK
// inputs, whether it has mins, and the float32 scale (and min) of sub-block j for the chunk's 16 outputs.
// A weight is w = scale_j * (q - kZero) + min_j with q its stored unsigned code.
struct Q4_0Layout {
  static constexpr int SB = 32, kChunk = 288, kSubs = 1, kSubK = 32, kZero = 8;
  static constexpr bool kMin = false;
  static __m512 scale(const uint8_t* c, int) { return half16(c + 256); }
  static __m512 min(const uint8_t*, int) { return _mm512_setzero_ps(); }
};

struct Q4_1Layout {
  static constexpr int SB = 32, kChunk = 320, kSubs = 1, kSubK = 32, kZero = 0;
  static constexpr bool kMin = true;
  static __m512 scale(const uint8_t* c, int) { return half16(c + 256); }
  static __m512 min(const uint8_t* c, int) { return half16(c + 288); }
};

struct Q5_0Layout {
  static constexpr int SB = 32, kChunk = 352, kSubs = 1, kSubK = 32, kZero = 16;
  static constexpr bool kMin = false;
  static __m512 scale(const uint8_t* c, int) { return half16(c + 320); }
  static __m512 min(const uint8_t*, int) { return _mm512_setzero_ps(); }
};

struct Q5_1Layout {
  static constexpr int SB = 32, kChunk = 384, kSubs = 1, kSubK = 32, kZero = 0;
  static constexpr bool kMin = true;
  static __m512 scale(const uint8_t* c, int) { return half16(c + 320); }
  static __m512 min(const uint8_t* c, int) { return half16(c + 352); }
};

struct Q8_0Layout {  // codes stored as signed bytes; kZero applies to them read as unsigned (code ^ 0x80)
  static constexpr int SB = 32, kChunk = 544, kSubs = 1, kSubK = 32, kZero = 128;
  static constexpr bool kMin = false;
  static __m512 scale(const uint8_t* c, int) { return half16(c + 512); }
  static __m512 min(const uint8_t*, int) { return _mm512_setzero_ps(); }
};

// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins: w = d * sc_j * q - dmin * m_j (q in 0..15).
struct Q4_KLayout {
  static constexpr int SB = 256, kChunk = 2368, kSubs = 8, kSubK = 32, kZero = 0;
  static constexpr bool kMin = true;
  static __m512 scale(const uint8_t* c, int j) { return _mm512_mul_ps(half16(c + 2048), u8x16(c + 2112 + 16 * j)); }
  static __m512 min(const uint8_t* c, int j) {  // -dmin * m_j
    return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(c + 2080), u8x16(c + 2240 + 16 * j)));
  }
};

// Q5_K: Q4_K's sub-blocks with a 5th bit a code (q in 0..31), in a plane per sub-block after the nibbles.
struct Q5_KLayout {
  static constexpr int SB = 256, kChunk = 2880, kSubs = 8, kSubK = 32, kZero = 0;
  static constexpr bool kMin = true;
  static __m512 scale(const uint8_t* c, int j) { return _mm512_mul_ps(half16(c + 2560), u8x16(c + 2624 + 16 * j)); }
  static __m512 min(const uint8_t* c, int j) {  // -dmin * m_j
    return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(c + 2592), u8x16(c + 2752 + 16 * j)));
  }
};

// Q6_K: 16 sub-blocks of 16 with int8 scales: w = d * sc_j * (q - 32) (q in 0..63).
struct Q6_KLayout {
  static constexpr int SB = 256, kChunk = 3360, kSubs = 16, kSubK = 16, kZero = 32;
  static constexpr bool kMin = false;
  static __m512 scale(const uint8_t* c, int j) { return _mm512_mul_ps(half16(c + 3072), i8x16(c + 3104 + 16 * j)); }
  static __m512 min(const uint8_t*, int) { return _mm512_setzero_ps(); }
};

}  // namespace
