// Linear layers on GGUF-quantized weights for x86 CPUs with AVX2 but no AVX-512 (AMD Zen 2/3, Intel before Ice
// Lake and its client chips): integer dot products on vpmaddubsw / vpmaddwd, the activations one int8 digit per value
// with a scale per 32 (the int8x32 scheme of cpu_quant_vnni.cpp; llama.cpp's Q8_0 way). Built as a module of its own
// (quickdraft.kernels.cpu_quant_avx2), compiled for AVX2, FMA and F16C only, so it loads where cpu_linear.cpp's
// AVX-512 module cannot; the runner then keeps a GGUF file's blocks as stored instead of widening them to float32
// (4.5-6.6 bits a weight streamed instead of 32).
//
// Numerics, as in cpu_quant_vnni.cpp's int8x32: each row of x is quantized on its own, per block of 32 inputs, v =
// round(x / s) with s = max|x| / 127 (|v| <= 127); a block's (a K-quant sub-block's) dot product of the codes q with v
// is exact in int32 (the zero point as - z sum v), and becomes float32 a block at a time: y += float(dot) (d s) for
// blocks of 32 (+ m (s sum v) with mins), y += float(dot) ((d sc_j) s) for a K-quant's sub-block j, its mins' terms
// -dmin m_j (s sum v_j) after the super-block. vpmaddubsw multiplies unsigned codes by signed activation bytes and adds
// pairs into int16 with saturation: the codes' range keeps every partial sum below 2^15 (kPairs below), and Q8_0's
// signed codes take llama.cpp's sign trick, |q| times v sign(q). A row's outputs go through the same operations in the
// same order whatever the other rows, their number, the tiling or the threads: bitwise the same alone or in a batch.
//
// Layout: the chunks of cpu_quant.cpp as they are. A 64-byte vector of a chunk holds 16 int32 lanes, lane n that of
// output n: its low 32 bytes are outputs 0-7, its high 32 bytes outputs 8-15, so a group of 16 outputs is two halves
// here, each run as cpu_quant_vnni.cpp runs the whole vector.

#include <torch/extension.h>  // this module binds itself to Python
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu_quant_scalar.h"

namespace {

// --- the activations, quantized per row: one int8 digit, a scale per 32 --------------------------------------

struct Activations {
  int64_t M = 0, K = 0;
  bool nibble_order = true;  // inputs of each 8 in the order (0, 4, 1, 5, 2, 6, 3, 7); else as they come
  std::vector<int8_t> v;        // [M, K]
  std::vector<float> scale;     // [M, K / 32]
  std::vector<int32_t> sum16;   // [M, K / 16]: sum of v over each 16 inputs (the zero points)
  std::vector<float> sum32;     // [M, K / 32]: s * sum of v over each 32 (the mins' term)
};

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <class T>
void quantize_row(const T* x, Activations& a, int64_t m) {
  constexpr int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  const int64_t K = a.K;
  for (int64_t b = 0; b < K / 32; ++b) {
    float xs[32], top = 0.0f;
    for (int k = 0; k < 32; ++k) xs[k] = as_float(x[b * 32 + k]), top = std::max(top, std::fabs(xs[k]));
    const float s = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
    int32_t q[32];
    for (int k = 0; k < 32; ++k)  // nearbyint rounds to nearest even, as vcvtps2dq does
      q[k] = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(xs[k] * inv))));
    int8_t* out = a.v.data() + m * K + b * 32;
    for (int k = 0; k < 32; ++k) out[k] = static_cast<int8_t>(a.nibble_order ? q[(k & ~7) + kOrder[k & 7]] : q[k]);
    int32_t half[2] = {0, 0};
    for (int k = 0; k < 32; ++k) half[k / 16] += q[k];
    a.scale[m * (K / 32) + b] = s;
    a.sum16[m * (K / 16) + 2 * b] = half[0];
    a.sum16[m * (K / 16) + 2 * b + 1] = half[1];
    a.sum32[m * (K / 32) + b] = s * static_cast<float>(half[0] + half[1]);
  }
}

template <class T>
void quantize(const T* x, int64_t M, int64_t K, bool nibble_order, Activations& a) {
  a.M = M, a.K = K, a.nibble_order = nibble_order;
  a.v.assign(M * K, 0);
  a.scale.assign(M * (K / 32), 0.0f);
  a.sum16.assign(M * (K / 16), 0);
  a.sum32.assign(M * (K / 32), 0.0f);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, a, m);
  });
}

// --- per type: the codes of unit u (8 inputs) of half h (outputs 8h .. 8h+7) of a chunk -----------------------

inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi8(0x0F)); }
// bits at `from` of each byte moved to bit `to` (bits elsewhere are garbage: the caller masks).
inline __m256i shift_bits(__m256i v, int from, int to) {
  return from <= to ? _mm256_slli_epi32(v, to - from) : _mm256_srli_epi32(v, from - to);
}

// kPairs: how many vpmaddubsw results (each two products q v, |v| <= 127) add up in int16 without overflow before
// vpmaddwd widens them: 4-bit codes 8 (8 x 2 x 15 x 127 = 30480 < 2^15: a sub-block of 32), 5-bit 4 (31496), 6-bit 2
// (32004); Q8_0's signed codes widen each (2 x 128 x 127 = 32512).
struct Q4_0A {
  static constexpr int SB = 32, kChunk = 288, kSubs = 1, kSubK = 32, kZero = 8, kPairs = 8;
  static constexpr bool kMin = false, kNibbles = true, kSigned = false;
  static void codes(const uint8_t* c, int u, int h, __m256i& a, __m256i& b) {
    const __m256i v = load(c + u * 64 + h * 32);
    a = low_nibbles(v), b = high_nibbles(v);
  }
  static __m256 scale(const uint8_t* c, int, int h) { return half8(c + 256 + 16 * h); }
  static __m256 min(const uint8_t*, int, int) { return _mm256_setzero_ps(); }
};

struct Q4_1A : Q4_0A {
  static constexpr int kChunk = 320, kZero = 0;
  static constexpr bool kMin = true;
  static __m256 min(const uint8_t* c, int, int h) { return half8(c + 288 + 16 * h); }
};

struct Q5_0A : Q4_0A {
  static constexpr int kChunk = 352, kZero = 16, kPairs = 4;
  static void codes(const uint8_t* c, int u, int h, __m256i& a, __m256i& b) {
    Q4_0A::codes(c, u, h, a, b);
    const __m256i plane = load(c + 256 + h * 32), bit4 = _mm256_set1_epi8(0x10);  // bit 2u + half of each byte
    a = _mm256_or_si256(a, _mm256_and_si256(shift_bits(plane, 2 * u, 4), bit4));
    b = _mm256_or_si256(b, _mm256_and_si256(shift_bits(plane, 2 * u + 1, 4), bit4));
  }
  static __m256 scale(const uint8_t* c, int, int h) { return half8(c + 320 + 16 * h); }
};

struct Q5_1A : Q5_0A {  // Q5_0's codes unsigned, with a min: w = d q + m
  static constexpr int kChunk = 384, kZero = 0;
  static constexpr bool kMin = true;
  static __m256 scale(const uint8_t* c, int, int h) { return half8(c + 320 + 16 * h); }
  static __m256 min(const uint8_t* c, int, int h) { return half8(c + 352 + 16 * h); }
};

struct Q8_0A : Q4_0A {  // signed codes: no zero point (the sign trick)
  static constexpr int kChunk = 544, kZero = 0, kPairs = 1;
  static constexpr bool kNibbles = false, kSigned = true;
  static void codes(const uint8_t* c, int u, int h, __m256i& a, __m256i& b) {
    // word n of a 32-byte step holds inputs (2p, 2p+1) of output n: interleave two steps' words of outputs 8h..8h+7
    auto four_inputs = [h](const uint8_t* steps) {
      const __m256i first = load(steps), second = load(steps + 32);
      const __m256i lo = _mm256_unpacklo_epi16(first, second), hi = _mm256_unpackhi_epi16(first, second);
      return h == 0 ? _mm256_permute2x128_si256(lo, hi, 0x20) : _mm256_permute2x128_si256(lo, hi, 0x31);
    };
    a = four_inputs(c + u * 128), b = four_inputs(c + u * 128 + 64);
  }
  static __m256 scale(const uint8_t* c, int, int h) { return half8(c + 512 + 16 * h); }
};

struct Q4_KA : Q4_0A {  // 8 sub-blocks of 32 with 6-bit scales and mins: w = d sc_j q - dmin m_j
  static constexpr int SB = 256, kChunk = 2368, kSubs = 8, kZero = 0;
  static constexpr bool kMin = true;
  static __m256 sub_scale(const uint8_t* c, int j, int h) { return _mm256_mul_ps(half8(c + 2048 + 16 * h), u8x8(c + 2112 + 16 * j + 8 * h)); }
  static __m256 sub_min(const uint8_t* c, int j, int h) {  // -dmin m_j
    return _mm256_mul_ps(u8x8(c + 2240 + 16 * j + 8 * h), _mm256_sub_ps(_mm256_setzero_ps(), half8(c + 2080 + 16 * h)));
  }
};

struct Q5_KA : Q4_KA {  // Q4_K with a 5th bit a code (Q5_0's plane, one a sub-block of 32)
  static constexpr int kChunk = 2880, kPairs = 4;
  static void codes(const uint8_t* c, int u, int h, __m256i& a, __m256i& b) {
    Q4_0A::codes(c, u, h, a, b);
    const __m256i plane = load(c + 2048 + (u >> 2) * 64 + h * 32), bit4 = _mm256_set1_epi8(0x10);
    a = _mm256_or_si256(a, _mm256_and_si256(shift_bits(plane, 2 * (u & 3), 4), bit4));
    b = _mm256_or_si256(b, _mm256_and_si256(shift_bits(plane, 2 * (u & 3) + 1, 4), bit4));
  }
  static __m256 sub_scale(const uint8_t* c, int j, int h) { return _mm256_mul_ps(half8(c + 2560 + 16 * h), u8x8(c + 2624 + 16 * j + 8 * h)); }
  static __m256 sub_min(const uint8_t* c, int j, int h) {  // -dmin m_j
    return _mm256_mul_ps(u8x8(c + 2752 + 16 * j + 8 * h), _mm256_sub_ps(_mm256_setzero_ps(), half8(c + 2592 + 16 * h)));
  }
};

struct Q6_KA : Q4_0A {  // 16 sub-blocks of 16 with int8 scales: w = d sc_j (q - 32)
  static constexpr int SB = 256, kChunk = 3360, kSubs = 16, kSubK = 16, kZero = 32, kPairs = 2;
  static void codes(const uint8_t* c, int u, int h, __m256i& a, __m256i& b) {
    Q4_0A::codes(c, u, h, a, b);
    const __m256i plane = load(c + 2048 + (u >> 1) * 64 + h * 32), bits45 = _mm256_set1_epi8(0x30);
    const int at = 4 * (u & 1);  // bits at, at+1 of each byte (the low nibbles' codes), at+2, at+3 (the high's)
    a = _mm256_or_si256(a, _mm256_and_si256(shift_bits(plane, at, 4), bits45));
    b = _mm256_or_si256(b, _mm256_and_si256(shift_bits(plane, at + 2, 4), bits45));
  }
  static __m256 sub_scale(const uint8_t* c, int j, int h) { return _mm256_mul_ps(half8(c + 3072 + 16 * h), i8x8(c + 3104 + 16 * j + 8 * h)); }
  static __m256 sub_min(const uint8_t*, int, int) { return _mm256_setzero_ps(); }
};

// Fetch about 16 KB ahead in the stream of weights (past a group's end lies the next group's start), spread over
// the chunk's units (cpu_quant_vnni.cpp's prefetch_share says why).
template <class Q>
inline void prefetch_share(const uint8_t* chunk, int u) {
  constexpr int kLines = (Q::kChunk + 63) / 64, kUnitsAll = Q::SB / 8;
  constexpr int64_t kAhead = (16384 + Q::kChunk - 1) / Q::kChunk;
  for (int line = u * kLines / kUnitsAll; line < (u + 1) * kLines / kUnitsAll; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kAhead * Q::kChunk + line * 64), _MM_HINT_T0);
}

// The products of unit u's codes (a, b: 4 inputs each) with activation bytes xa, xb broadcast, pairs added in int16.
template <class Q>
inline __m256i products(__m256i a, __m256i b, __m256i xa, __m256i xb) {
  if constexpr (Q::kSigned)  // |q| (unsigned) times v sign(q): q v, and 2 x 128 x 127 fits in int16
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(xa, a)),
                                              _mm256_set1_epi16(1)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(b, b), _mm256_sign_epi8(xb, b)),
                                              _mm256_set1_epi16(1)));
  else
    return _mm256_add_epi16(_mm256_maddubs_epi16(a, xa), _mm256_maddubs_epi16(b, xb));
}

// Rows m0 .. m0+MR of the activations by one group of 16 outputs, over all of K. w: the group's chunks; y: the
// group's first output of row m0.
template <class Q, int MR>
void tile(const Activations& a, int64_t m0, const uint8_t* w, int64_t super_blocks, float* y, int64_t ldy) {
  constexpr bool kSuper = Q::kSubs > 1;
  constexpr int kUnits = Q::kSubK / 8;
  const int64_t K = a.K;
  const int8_t* v[MR];
  const float* scale[MR];
  const int32_t* sum16[MR];
  const float* sum32[MR];
  for (int m = 0; m < MR; ++m) {
    v[m] = a.v.data() + (m0 + m) * K;
    scale[m] = a.scale.data() + (m0 + m) * (K / 32);
    sum16[m] = a.sum16.data() + (m0 + m) * (K / 16);
    sum32[m] = a.sum32.data() + (m0 + m) * (K / 32);
  }
  __m256 total[MR][2];
  for (int m = 0; m < MR; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < super_blocks; ++b) {
    const uint8_t* chunk = w + b * Q::kChunk;
    const int64_t k0 = b * Q::SB;
    for (int s = 0; s < Q::kSubs; ++s) {
      const int64_t ks = k0 + s * Q::kSubK;
      // acc: the sub-block's dot, from its first widening on; pairs: products not yet widened (their live ranges
      // are short: a Q4 sub-block keeps only pairs, MR x 2 registers, through its four units)
      __m256i acc[MR][2], pairs[MR][2];
#pragma GCC unroll 4
      for (int i = 0; i < kUnits; ++i) {
        const int u = s * kUnits + i;
        prefetch_share<Q>(chunk, u);
        __m256i ca[2], cb[2];
        Q::codes(chunk, u, 0, ca[0], cb[0]);
        Q::codes(chunk, u, 1, ca[1], cb[1]);
        const int64_t k = ks + i * 8;
        for (int m = 0; m < MR; ++m) {
          const __m256i xa = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(v[m] + k));
          const __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(v[m] + k + 4));
          for (int h = 0; h < 2; ++h) {
            const __m256i p = products<Q>(ca[h], cb[h], xa, xb);
            if constexpr (Q::kSigned) {
              acc[m][h] = i == 0 ? p : _mm256_add_epi32(acc[m][h], p);
            } else {  // kPairs / 2 units' products add in int16, then widen
              constexpr int kPerWiden = Q::kPairs / 2;
              pairs[m][h] = i % kPerWiden == 0 ? p : _mm256_add_epi16(pairs[m][h], p);
              if (i % kPerWiden == kPerWiden - 1 || i == kUnits - 1) {
                const __m256i wide = _mm256_madd_epi16(pairs[m][h], ones);
                acc[m][h] = i < kPerWiden ? wide : _mm256_add_epi32(acc[m][h], wide);
              }
            }
          }
        }
      }
      if constexpr (Q::kZero != 0)
        for (int m = 0; m < MR; ++m) {  // the zero point: - z sum v (the sum exact in int32)
          const int32_t sum = Q::kSubK == 32 ? sum16[m][ks / 16] + sum16[m][ks / 16 + 1] : sum16[m][ks / 16];
          const __m256i start = _mm256_set1_epi32(-Q::kZero * sum);
          for (int h = 0; h < 2; ++h) acc[m][h] = _mm256_add_epi32(acc[m][h], start);
        }
      for (int h = 0; h < 2; ++h) {
        if constexpr (kSuper) {  // total += float(dot) ((d sc_j) s): the dot is exact in float32 (< 2^24)
          const __m256 d_sc = Q::sub_scale(chunk, s, h);
          for (int m = 0; m < MR; ++m)
            total[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), _mm256_mul_ps(d_sc, _mm256_set1_ps(scale[m][ks / 32])),
                                          total[m][h]);
        } else {
          const __m256 d = Q::scale(chunk, s, h), mn = Q::min(chunk, s, h);
          for (int m = 0; m < MR; ++m) {
            total[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][h]), d), _mm256_set1_ps(scale[m][ks / 32]),
                                          total[m][h]);
            if constexpr (Q::kMin) total[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum32[m][ks / 32]), total[m][h]);
          }
        }
      }
    }
    if constexpr (kSuper && Q::kMin) {  // the super-block's mins, sub-block by sub-block (Q4_K's are 32 inputs)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < Q::kSubs; ++j) {
          const __m256 mn = Q::sub_min(chunk, j, h);
          for (int m = 0; m < MR; ++m) total[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum32[m][k0 / 32 + j]), total[m][h]);
        }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + m * ldy + h * 8, total[m][h]);
}

// Groups [g0, g1) of one weight, all rows: one group at a time, rows in blocks of at most 4 (as even as possible;
// 16 ymm registers), the group's chunks from memory for the first block and from cache for the others.
template <class Q>
void groups(const Activations& a, const uint8_t* w, int64_t g0, int64_t g1, float* y, int64_t ldy) {
  const int64_t M = a.M, super_blocks = a.K / Q::SB, group_bytes = super_blocks * Q::kChunk;
  const int64_t row_blocks = (M + 3) / 4, block_rows = (M + row_blocks - 1) / row_blocks;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      float* ym = y + m0 * ldy + g * 16;
      const uint8_t* wg = w + g * group_bytes;
      switch (std::min<int64_t>(block_rows, M - m0)) {
        case 1: tile<Q, 1>(a, m0, wg, super_blocks, ym, ldy); break;
        case 2: tile<Q, 2>(a, m0, wg, super_blocks, ym, ldy); break;
        case 3: tile<Q, 3>(a, m0, wg, super_blocks, ym, ldy); break;
        default: tile<Q, 4>(a, m0, wg, super_blocks, ym, ldy); break;
      }
    }
  }
}

template <class F>
decltype(auto) dispatch(int64_t type, F&& f) {
  return dispatch_type<Q4_0A, Q4_1A, Q5_0A, Q5_1A, Q8_0A, Q4_KA, Q5_KA, Q6_KA>(type, std::forward<F>(f));
}

}  // namespace

// Whether this CPU runs this module's instructions.
bool quant_avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

// y = x [W_0; W_1; ...]^T as cpu_quant.cpp's linear_quant: x [M, K] float32 or bf16, weights[i] packed [N_i/16,
// K/SB_i, chunk_i] uint8 of GGML type types[i]; y [M, sum N_i] float32 if float_output or x is float32, else bf16.
// kernel_name: the model's quantized kernel, "" (none) or int8x32, the one this module computes.
at::Tensor linear_quant(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                           const std::vector<int64_t>& types, bool float_output, const std::string& kernel_name) {
  TORCH_CHECK(quant_avx2_available(), "this CPU lacks AVX2, FMA or F16C, which quickdraft's AVX2 kernels need");
  TORCH_CHECK(kernel_name.empty() || kernel_name == "int8x32", "the quantized kernel '", kernel_name,
              "' needs AVX-512 (AVX512-BF16 or AVX512-VNNI), which this CPU lacks; its AVX2 kernels compute int8x32");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous() &&
                  x.device().is_cpu(),
              "x must be a contiguous 2-d float32 or bf16 CPU tensor");
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "one type per quantized weight");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32, got ", K);
  struct Part {
    const uint8_t* w;
    int64_t type, groups, column;
    bool nibbles;
  };
  std::vector<Part> parts;
  int64_t N = 0, total_groups = 0;
  bool needed[2] = {false, false};  // activations in natural order (Q8_0), in nibble order (the others)
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], types[i], K);
    const bool nibbles = dispatch(types[i], [](auto q) { return decltype(q)::kNibbles; });
    needed[nibbles] = true;
    parts.push_back({weights[i].data_ptr<uint8_t>(), types[i], weights[i].size(0), N, nibbles});
    N += weights[i].size(0) * 16;
    total_groups += weights[i].size(0);
  }
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    Activations acts[2];
    for (int nibbles = 0; nibbles < 2; ++nibbles) {
      if (!needed[nibbles]) continue;
      if (x.scalar_type() == at::kFloat) quantize(x.data_ptr<float>(), M, K, nibbles, acts[nibbles]);
      else quantize(x.data_ptr<c10::BFloat16>(), M, K, nibbles, acts[nibbles]);
    }
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, total_groups, 4, [&](int64_t begin, int64_t end) {
      int64_t base = 0;
      for (const Part& part : parts) {
        const int64_t lo = std::max(begin, base), hi = std::min(end, base + part.groups);
        if (lo < hi)
          dispatch(part.type, [&](auto q) {
            groups<decltype(q)>(acts[part.nibbles], part.w, lo - base, hi - base, yp + part.column, N);
          });
        base += part.groups;
      }
    });
  }
  return float_output || x.scalar_type() == at::kFloat ? y : y.to(at::kBFloat16);
}

// The one scheme this module computes (cpu_quant.cpp's names); set_quant_kernel accepts only it.
std::string get_quant_kernel(const std::string&) { return "int8x32"; }
std::string set_quant_kernel(const std::string& name) {
  TORCH_CHECK(name == "int8x32", "the quantized kernel '", name, "' needs AVX-512 (bf16, int8, int16: AVX512-BF16 or "
              "AVX512-VNNI), which this CPU lacks; its AVX2 kernels compute int8x32");
  return "int8x32";
}

at::Tensor dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& rows, int64_t K) {
  return dequantize_packed_rows(w, type, rows, K);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_quant", &linear_quant, "y = x [W_0; W_1; ...]^T on GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K), int8 activations a scale per 32, AVX2; rows computed alike whatever their number",
        py::arg("x"), py::arg("weights"), py::arg("types"), py::arg("float_output") = false, py::arg("kernel") = "");
  m.def("quant_kernel", &get_quant_kernel, "the quantized linear kernel: int8x32 (the only one on AVX2)",
        py::arg("kernel") = "");
  m.def("set_quant_kernel", &set_quant_kernel, "choose the quantized linear kernel (only int8x32 here); returns the one before");
  m.def("dequantize_rows", &dequantize_rows, "rows of a packed quantized weight as float32 (the embedding lookup)");
  m.def("available", &quant_avx2_available, "whether this CPU has AVX2, FMA and F16C");
}
