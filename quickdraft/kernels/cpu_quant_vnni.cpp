// Linear layers on GGUF-quantized weights with integer dot products: AVX512-VNNI's vpdpbusd (64 multiply-adds of
// unsigned by signed bytes into 16 int32 lanes, one instruction), for the rows of a decoding, verification or
// batched step. cpu_quant.cpp's bf16 kernel is the fallback where the CPU lacks VNNI.
//
// Why: on these CPUs the bf16 kernel is bound by its dot-product instruction, not by memory (vdpbf16ps does 32
// multiply-adds in ~2 cycles, plus a table lookup per 32 codes; RESULTS.md session 11). With the activations
// as integers the stored codes are the multiplicands as they are: 64 multiply-adds an instruction, no lookup.
//
// Numerics. Each row of x is quantized on its own, per block of the weight's block size (32; 256 for the
// K-quants): v = round(x / s), s = max|x| / R, as one int8 digit (R = 127: llama.cpp's Q8_K way) or two
// (v = 256 h + l, h and l int8, R = 32639: |x - s v| <= max|x| / 65278, about 2^-16 of the block's max). A
// sub-block's dot product of the codes q with v is exact in int32, the zero point included (sum q v - z sum v).
// Blocks of 32 become float32 a block at a time: y += (float(dot) * d) * s (+ m * (s sum v)). The K-quants'
// sub-block scales are integers (Q4_K and Q5_K 6 bits, Q6_K int8): a super-block's sum_j sc_j float(dot_j) (its dots exact in
// float32: below 2^24) is scaled by d * s once (one s per 256 inputs), its mins -dmin m_j (s sum v_j) added
// then. A row's outputs go through the same operations in the same order whatever the other rows, their number,
// the tiling (vpdpbusd or AMX tiles) or the threads: bitwise the same alone or in a batch.
//
// Layout: the chunks of cpu_quant.cpp as they are. A nibble vector (64 bytes: 8 inputs of 16 outputs) read as 16
// int32 lanes holds in lane n the nibbles of output n for inputs 0, 2, 4, 6 (low 16 bits) and 1, 3, 5, 7: masked,
// its low nibbles are the bytes of inputs (0, 4, 1, 5), its high nibbles those of (2, 6, 3, 7). The activations are
// stored in that order, so each half is one vpdpbusd against 4 activation bytes broadcast. Q5_0's and Q6_K's high
// bits sit in their planes at one bit position of each byte (cpu_quant.h): a shift and a bit-select. Q8_0's
// steps (two inputs of 16 outputs in 32 bytes) become four inputs a lane by one word permute, and unsigned
// codes (q + 128) by flipping the sign bit.

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512vnni")

#include "cpu_quant.h"

namespace {

// --- the activations, quantized per row ----------------------------------------------------------------------

struct Activations {
  int64_t M = 0, K = 0, block = 0;  // block: inputs per scale
  int digits = 1;
  bool nibble_order = true;  // inputs of each 8 in the order (0, 4, 1, 5, 2, 6, 3, 7); else as they come
  // [rows * digits, K]: digit e of row m (0 the high, 1 the low) at row m * digits + e, so that one AMX A tile
  // holds both digits of its rows (one tile product for both).
  std::vector<int8_t> digits_;
  std::vector<float> scale;        // [M, K / block]
  std::vector<int32_t> sum16;      // [M, K / 16]: sum of v over each 16 inputs
  // two digits, blocks of 256 (the K-quants' zero point, per digit): [rows * 2, K / 16], sum of each digit over
  // each 16 inputs; else empty (one digit's sums are sum16)
  std::vector<int32_t> digit_sum16;
  std::vector<float> sum32;        // [M, K / 32]: s * sum of v over each 32 (the mins' term)
  const int8_t* digit(int64_t m, int e) const { return digits_.data() + (m * digits + e) * K; }
};

constexpr float kRange[3] = {0.0f, 127.0f, 32639.0f};

inline __m512 bf16x16(const c10::BFloat16* p) {
  __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

inline __m512 load_x16(const c10::BFloat16* p) { return bf16x16(p); }
inline __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }

// x: bf16 rows, or float32 ones (a float32 residual stream's norms: no bf16 rounding before the integer digits).
template <typename T>
void quantize_row(const T* x, Activations& a, int64_t m) {
  const int64_t K = a.K, B = a.block;
  const float range = kRange[a.digits];
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __m512i lo = _mm512_set1_epi32(-static_cast<int>(range)), hi = _mm512_set1_epi32(static_cast<int>(range));
  for (int64_t b = 0; b < K / B; ++b) {
    const T* xb = x + b * B;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < B; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_x16(xb + k)));
    const float top = _mm512_reduce_max_ps(amax);
    a.scale[m * (K / B) + b] = top / range;
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? range / top : 0.0f);
    for (int64_t k = 0; k < B; k += 16) {
      const int64_t at = m * K + b * B + k;
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_x16(xb + k), inv));  // rounds to nearest even
      v = _mm512_min_epi32(_mm512_max_epi32(v, lo), hi);
      if (a.nibble_order) v = _mm512_permutexvar_epi32(order, v);
      a.sum16[at / 16] = _mm512_reduce_add_epi32(v);
      int8_t* high = a.digits_.data() + (m * a.digits) * K + b * B + k;
      if (a.digits == 1) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high), _mm512_cvtepi32_epi8(v));
      } else {
        const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(128)), 8);
        const __m512i l = _mm512_sub_epi32(v, _mm512_slli_epi32(h, 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high), _mm512_cvtepi32_epi8(h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(high + K), _mm512_cvtepi32_epi8(l));
        if (!a.digit_sum16.empty()) {
          int32_t* digit_sums = a.digit_sum16.data() + (m * 2) * (K / 16) + (b * B + k) / 16;
          digit_sums[0] = _mm512_reduce_add_epi32(h);
          digit_sums[K / 16] = _mm512_reduce_add_epi32(l);
        }
      }
    }
  }
  for (int64_t i = 0; i < K / 32; ++i) {
    const float s = a.scale[m * (K / B) + (i * 32) / B];
    a.sum32[m * (K / 32) + i] = s * static_cast<float>(a.sum16[m * (K / 16) + 2 * i] + a.sum16[m * (K / 16) + 2 * i + 1]);
  }
}

// rows: M, or more (a multiple of the AMX tile's rows): the rows past M are zeros.
template <typename T>
void quantize(const T* x, int64_t M, int64_t rows, int64_t K, int64_t block, int digits,
              bool nibble_order, Activations& a) {
  a.M = M, a.K = K, a.block = block, a.digits = digits, a.nibble_order = nibble_order;
  a.digits_.assign(rows * digits * K, 0);
  a.scale.assign(rows * (K / block), 0.0f);
  a.sum16.assign(rows * (K / 16), 0);
  a.digit_sum16.assign(digits == 2 && block == 256 ? rows * 2 * (K / 16) : 0, 0);
  a.sum32.assign(rows * (K / 32), 0.0f);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, a, m);
  });
}

// --- the per-type parts: the two vpdpbusd operands of unit u (8 inputs) of a chunk --------------------------

inline __m512i low_nibbles(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline __m512i high_nibbles(__m512i v) { return _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi8(0x0F)); }
// bits at `from` of each byte moved to bit `to` (bits elsewhere are garbage: the caller selects).
inline __m512i shift_bits(__m512i v, int from, int to) {
  return from <= to ? _mm512_slli_epi32(v, to - from) : _mm512_srli_epi32(v, from - to);
}

struct Q4_0V : Q4_0Layout {
  static constexpr bool kNibbles = true;
  static __m512 sub_scale(const uint8_t* c, int j) { return scale(c, j); }
  static __m512 sub_min(const uint8_t* c, int j) { return min(c, j); }
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) {
    const __m512i v = load(c + u * 64);
    a = low_nibbles(v), b = high_nibbles(v);
  }
};
struct Q4_1V : Q4_1Layout {
  static constexpr bool kNibbles = true;
  static __m512 sub_scale(const uint8_t* c, int j) { return scale(c, j); }
  static __m512 sub_min(const uint8_t* c, int j) { return min(c, j); }
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) { Q4_0V::codes(c, u, a, b); }
};
struct Q4_KV : Q4_KLayout {
  static constexpr bool kNibbles = true;
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) { Q4_0V::codes(c, u, a, b); }
  static __m512 super_scale(const uint8_t* c) { return half16(c + 2048); }  // d
  static __m512i sub_scale_int(const uint8_t* c, int j) { return u8x16i(c + 2112 + 16 * j); }  // sc_j, an integer
  static constexpr bool kSignedProducts = false;  // (q - z) sc_j in 0 .. 945: its high byte 0 .. 3
  static void mins(const uint8_t* c, __m512* mn) {  // -dmin * m_j
    const __m512 minus_dmin = _mm512_sub_ps(_mm512_setzero_ps(), half16(c + 2080));
    for (int j = 0; j < kSubs; ++j) mn[j] = _mm512_mul_ps(u8x16(c + 2240 + 16 * j), minus_dmin);
  }
};

struct Q5_0V : Q5_0Layout {
  static constexpr bool kNibbles = true;
  static __m512 sub_scale(const uint8_t* c, int j) { return scale(c, j); }
  static __m512 sub_min(const uint8_t* c, int j) { return min(c, j); }
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) {
    Q4_0V::codes(c, u, a, b);
    const __m512i plane = load(c + 256), bit4 = _mm512_set1_epi8(0x10);  // bit 2u + half of each byte
    a = _mm512_ternarylogic_epi32(bit4, shift_bits(plane, 2 * u, 4), a, 0xCA);
    b = _mm512_ternarylogic_epi32(bit4, shift_bits(plane, 2 * u + 1, 4), b, 0xCA);
  }
};

struct Q5_KV : Q5_KLayout {
  static constexpr bool kNibbles = true;
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) {  // Q5_0's plane, one a sub-block of 32
    Q4_0V::codes(c, u, a, b);
    const __m512i plane = load(c + 2048 + (u >> 2) * 64), bit4 = _mm512_set1_epi8(0x10);
    a = _mm512_ternarylogic_epi32(bit4, shift_bits(plane, 2 * (u & 3), 4), a, 0xCA);
    b = _mm512_ternarylogic_epi32(bit4, shift_bits(plane, 2 * (u & 3) + 1, 4), b, 0xCA);
  }
  static __m512 super_scale(const uint8_t* c) { return half16(c + 2560); }  // d
  static __m512i sub_scale_int(const uint8_t* c, int j) { return u8x16i(c + 2624 + 16 * j); }  // sc_j, an integer
  static constexpr bool kSignedProducts = false;  // q sc_j in 0 .. 1953: its high byte 0 .. 7
  static void mins(const uint8_t* c, __m512* mn) {  // -dmin * m_j
    const __m512 minus_dmin = _mm512_sub_ps(_mm512_setzero_ps(), half16(c + 2592));
    for (int j = 0; j < kSubs; ++j) mn[j] = _mm512_mul_ps(u8x16(c + 2752 + 16 * j), minus_dmin);
  }
};

struct Q5_1V : Q5_1Layout {
  static constexpr bool kNibbles = true;
  static __m512 sub_scale(const uint8_t* c, int j) { return scale(c, j); }
  static __m512 sub_min(const uint8_t* c, int j) { return min(c, j); }
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) { Q5_0V::codes(c, u, a, b); }
};

struct Q6_KV : Q6_KLayout {
  static constexpr bool kNibbles = true;
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) {
    Q4_0V::codes(c, u, a, b);
    const __m512i plane = load(c + 2048 + (u >> 1) * 64), bits45 = _mm512_set1_epi8(0x30);
    const int at = 4 * (u & 1);  // bits at, at+1 of each byte (the low nibbles' codes), at+2, at+3 (the high's)
    a = _mm512_ternarylogic_epi32(bits45, shift_bits(plane, at, 4), a, 0xCA);
    b = _mm512_ternarylogic_epi32(bits45, shift_bits(plane, at + 2, 4), b, 0xCA);
  }
  static __m512 super_scale(const uint8_t* c) { return half16(c + 3072); }  // d
  static __m512i sub_scale_int(const uint8_t* c, int j) { return i8x16i(c + 3104 + 16 * j); }  // sc_j, an integer
  static constexpr bool kSignedProducts = true;  // (q - z) sc_j in -4064 .. 4096: its high byte -16 .. 16
  static void mins(const uint8_t*, __m512*) {}
};

struct Q8_0V : Q8_0Layout {
  static constexpr bool kNibbles = false;
  static __m512 sub_scale(const uint8_t* c, int j) { return scale(c, j); }
  static __m512 sub_min(const uint8_t* c, int j) { return min(c, j); }
  static void codes(const uint8_t* c, int u, __m512i& a, __m512i& b) {
    // word n of a 32-byte step holds inputs (2p, 2p+1) of output n: interleave two steps' words
    const __m512i words = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                            0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                            0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    a = _mm512_xor_si512(_mm512_permutexvar_epi16(words, load(c + u * 128)), sign);
    b = _mm512_xor_si512(_mm512_permutexvar_epi16(words, load(c + u * 128 + 64)), sign);
  }
};

// --- the float finish, op for op the same in tile() and amx_groups() ------------------------------------------
// (so a row's bits do not depend on which kernel ran it: the integer dots are exact either way). Blocks of 32: y +=
// (float(dot) * d) * s (+ m * (s sum v)), a block at a time. K-quants: a sub-block's dot times its integer scale
// sc_j goes into the super-block's float sum, which d * s scales once a super-block (s is one per 256 inputs);
// the mins' terms, -dmin m_j * (s sum v_j), follow then in sub-block order. Vector operations a sub-block and
// row: Q4_K two digits 6 -> 4 (shared by the rows: 11 -> 2). Measured (benchmarks/quant_kernels.py, one thread,
// vpdpbusd, ns a weight and row, before -> after, one run each): two digits Q6_K at 1 row 0.0335 -> 0.0278, at 8
// rows 0.0140 -> 0.0123; Q4_K at 2 rows 0.0143 -> 0.0124, at 8 0.0098 -> 0.0092; one digit Q6_K at 8 rows 0.0094
// -> 0.0079. Blocks of 32 are unchanged.

inline __m512i combine(__m512i high, __m512i low) { return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low); }

template <class Q>
inline __m512 add_block(__m512 total, __m512i dot, __m512 d, __m512 mn, float s, float sum32) {
  total = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), d), _mm512_set1_ps(s), total);
  if constexpr (Q::kMin) total = _mm512_fmadd_ps(mn, _mm512_set1_ps(sum32), total);
  return total;
}

// K-quants: a super-block's sum_j sc_j dot_j, one exact int32 per digit (tile(): sc_j times each sub-block's dot;
// amx_super_groups(): one tile product over the super-block with sc_j folded into the codes), as one float32:
// h 256 + l with two digits (a sum too wide for int32 when the digits are joined first).
template <int D>
inline __m512 super_block_part(const __m512i* whole) {
  if constexpr (D == 2)
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole[0]), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(whole[1]));
  else
    return _mm512_cvtepi32_ps(whole[0]);
}

// mn[j] = -dmin m_j, sum32[j] = s * sum v over sub-block j (Q4_K's sub-blocks are 32 inputs)
template <class Q>
inline __m512 add_super_block(__m512 total, __m512 part, __m512 d, float s, const __m512* mn, const float* sum32) {
  total = _mm512_fmadd_ps(part, _mm512_mul_ps(d, _mm512_set1_ps(s)), total);
  if constexpr (Q::kMin)
    for (int j = 0; j < Q::kSubs; ++j) total = _mm512_fmadd_ps(mn[j], _mm512_set1_ps(sum32[j]), total);
  return total;
}

// A super-block's mins' terms alone (int8x32: its sub-blocks' products were added one by one; sum32 holds each
// 32's own s times its sum of v).
template <class Q>
inline __m512 add_mins(__m512 total, const __m512* mn, const float* sum32) {
  if constexpr (Q::kMin)
    for (int j = 0; j < Q::kSubs; ++j) total = _mm512_fmadd_ps(mn[j], _mm512_set1_ps(sum32[j]), total);
  return total;
}

// --- the kernel -----------------------------------------------------------------------------------------------

// Fetch about 16 KB ahead in every stream of weights (past a group's end lies the next group's start), spread over
// the chunk's units: unit u of SB / 8 asks for its share of the chunk's lines, kAhead chunks on. Why spread: a
// chunk's lines asked for at once (37 for Q4_K, for each of 4 groups) stall the core once the line fill buffers
// are full, so it computed with few lines in flight and waited with no work (measured: 45% of the one-row Q4_K
// kernel's samples on the instruction after such a burst). Qwen 1.5B forward, 1 / 2 / 5 / 8 rows, ms, one run
// each: 8 KB ahead 45.5 / 52.9 / 65.1 / 82.6, 16 KB 40.3 / 45.4 / 65.5 / 83.0, 32 KB 42.5 / 49.4 / 69.5 / 85.7.
template <class Q>
inline void prefetch_share(const uint8_t* const* chunks, int count, int u) {
  constexpr int kLines = (Q::kChunk + 63) / 64, kUnitsAll = Q::SB / 8;
  constexpr int64_t kAhead = (16384 + Q::kChunk - 1) / Q::kChunk;
  for (int line = u * kLines / kUnitsAll; line < (u + 1) * kLines / kUnitsAll; ++line)
    for (int j = 0; j < count; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(chunks[j] + kAhead * Q::kChunk + line * 64), _MM_HINT_T0);
}

// Rows m0 .. m0+MR of the activations by NB groups of 16 outputs, over all of K, with D digits an activation.
// w: the chunks of the tile's first group (groups `group_bytes` apart); y: the tile's first output of row m0.
// F (fine): the K-quants' activations carry a scale per 32 inputs (the int8x32 scheme), not per super-block: each
// sub-block's dot goes into the row's float sum at once, times (d sc_j) s (d sc_j once per group and sub-block,
// shared by the rows), and a super-block's mins follow as for one scale. (sc_j in int32, then float per 32 times
// s, then d once a super-block, the one-scale way, kept three arrays of accumulators: 40 zmm live with 8 rows,
// spilled; one thread, in cache, Q4_K 8 rows 0.0045-0.0047 -> 0.0042-0.0044 ns a weight and row.)
template <class Q, int MR, int NB, int D, bool F, class Y>
void tile(const Activations& a, int64_t m0, const uint8_t* w, int64_t group_bytes, int64_t super_blocks,
          Y* y, int64_t ldy) {
  constexpr bool kSuper = Q::kSubs > 1;
  constexpr bool kFine = kSuper && F;
  static_assert(!kFine || D == 1, "a scale per 32 inputs is a one-digit scheme");
  const int64_t K = a.K, scales_per_row = K / a.block;
  const int8_t* high[MR];
  const int8_t* low[MR];
  const float* scale[MR];
  const int32_t* sum16[MR];
  const float* sum32[MR];
  for (int m = 0; m < MR; ++m) {
    high[m] = a.digit(m0 + m, 0);
    low[m] = D == 2 ? a.digit(m0 + m, 1) : nullptr;
    scale[m] = a.scale.data() + (m0 + m) * scales_per_row;
    sum16[m] = a.sum16.data() + (m0 + m) * (K / 16);
    sum32[m] = a.sum32.data() + (m0 + m) * (K / 32);
  }
  __m512 total[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = _mm512_setzero_ps();
  constexpr int kUnits = Q::kSubK / 8;
  for (int64_t b = 0; b < super_blocks; ++b) {
    const uint8_t* chunk[NB];
    for (int j = 0; j < NB; ++j) chunk[j] = w + j * group_bytes + b * Q::kChunk;
    const int64_t k0 = b * Q::SB;
    __m512i whole[MR][NB][D];  // K-quants: the super-block's sum_j sc_j dot_j, per digit (super_block_part)
    if constexpr (kSuper && !kFine)
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NB; ++j)
          for (int e = 0; e < D; ++e) whole[m][j][e] = _mm512_setzero_si512();
    for (int s = 0; s < Q::kSubs; ++s) {
      const int64_t ks = k0 + s * Q::kSubK;
      __m512i acc[MR][NB], acc_low[MR][NB];
      for (int m = 0; m < MR; ++m) {
        // the zero point, as the starting value of the accumulators: blocks of 32, - z * sum v on the (last)
        // digit's; K-quants, - z * (sum of the digit) on each digit's (their dots stay apart: super_block_part)
        const int32_t* sums = kSuper && D == 2 ? a.digit_sum16.data() + (m0 + m) * 2 * (K / 16) : sum16[m];
        auto sum_of = [&](int e) {
          const int32_t* at = sums + e * (K / 16) + ks / 16;
          return Q::kSubK == 32 ? at[0] + at[1] : at[0];
        };
        const __m512i start = _mm512_set1_epi32(-Q::kZero * sum_of(0));
        for (int j = 0; j < NB; ++j) {
          if constexpr (D == 2 && kSuper) acc[m][j] = start, acc_low[m][j] = _mm512_set1_epi32(-Q::kZero * sum_of(1));
          else if constexpr (D == 2) acc[m][j] = _mm512_setzero_si512(), acc_low[m][j] = start;
          else acc[m][j] = start;
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < kUnits; ++i) {
        const int u = s * kUnits + i;
        prefetch_share<Q>(chunk, NB, u);
        __m512i ca[NB], cb[NB];
        for (int j = 0; j < NB; ++j) Q::codes(chunk[j], u, ca[j], cb[j]);
        const int64_t k = k0 + u * 8;
        for (int m = 0; m < MR; ++m) {
          const __m512i xa = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(high[m] + k));
          const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(high[m] + k + 4));
          for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[m][j], ca[j], xa), cb[j], xb);
          if constexpr (D == 2) {
            const __m512i la = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(low[m] + k));
            const __m512i lb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(low[m] + k + 4));
            for (int j = 0; j < NB; ++j)
              acc_low[m][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc_low[m][j], ca[j], la), cb[j], lb);
          }
        }
      }
      for (int j = 0; j < NB; ++j) {
        if constexpr (kFine) {  // total += float(dot) ((d sc_j) s): the dot is exact in float32 (< 2^24)
          const __m512 d_sc = _mm512_mul_ps(Q::super_scale(chunk[j]), _mm512_cvtepi32_ps(Q::sub_scale_int(chunk[j], s)));
          for (int m = 0; m < MR; ++m)
            total[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][j]), _mm512_mul_ps(d_sc, _mm512_set1_ps(scale[m][ks / 32])),
                                          total[m][j]);
        } else if constexpr (kSuper) {
          const __m512i sc = Q::sub_scale_int(chunk[j], s);
          for (int m = 0; m < MR; ++m) {
            whole[m][j][0] = _mm512_add_epi32(whole[m][j][0], _mm512_mullo_epi32(acc[m][j], sc));
            if constexpr (D == 2) whole[m][j][1] = _mm512_add_epi32(whole[m][j][1], _mm512_mullo_epi32(acc_low[m][j], sc));
          }
        } else {
          const __m512 sc = Q::sub_scale(chunk[j], s), mn = Q::sub_min(chunk[j], s);
          for (int m = 0; m < MR; ++m) {
            __m512i dot = acc[m][j];
            if constexpr (D == 2) dot = combine(dot, acc_low[m][j]);
            total[m][j] = add_block<Q>(total[m][j], dot, sc, mn, scale[m][ks / a.block], sum32[m][ks / 32]);
          }
        }
      }
    }
    if constexpr (kSuper) {
      for (int j = 0; j < NB; ++j) {
        const __m512 d = Q::super_scale(chunk[j]);
        __m512 mn[Q::kMin ? Q::kSubs : 1];
        Q::mins(chunk[j], mn);
        for (int m = 0; m < MR; ++m) {
          if constexpr (kFine) total[m][j] = add_mins<Q>(total[m][j], mn, sum32[m] + k0 / 32);
          else total[m][j] = add_super_block<Q>(total[m][j], super_block_part<D>(whole[m][j]), d, scale[m][b], mn,
                                                sum32[m] + k0 / 32);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j)
      store16(y + m * ldy + j * 16, total[m][j]);
}

// Groups a tile of one or two rows: 4 on Intel (independent accumulators hide the dot product's latency; measured
// there, sessions 14-16), 1 on AMD, one stream of weights at a time as for more rows. Measured on an AMD EPYC
// (Zen 5, 2 threads, Qwen 1.5B forward after 256 cached, medians of 7 interleaved rounds, same bits): 4 groups ->
// 1, one row int8x32 27.6 -> 21.6 ms, int16 31.1 -> 24.8; two rows 28.9 -> 21.9, 32.7 -> 25.4 (4 rows, one group
// a tile already, took 26.3 / 28.4: the four streams were slower, not the compute). QUICKDRAFT_QUANT_FEW_ROW_GROUPS
// = 1 or 4 overrides (to measure both on another CPU). Either way a row's bits are the same.
// Groups a tile as the environment variable `name` says (1 or `intel`), else `intel` on Intel and 1 on AMD.
int groups_a_tile(const char* name, int intel) {
  const char* env = std::getenv(name);
  if (env && (std::string(env) == "1" || std::string(env) == std::to_string(intel))) return std::atoi(env);
  return __builtin_cpu_is("amd") ? 1 : intel;
}

int few_row_groups() {
  static const int groups = groups_a_tile("QUICKDRAFT_QUANT_FEW_ROW_GROUPS", 4);
  return groups;
}

// Groups a tile of three rows or more: 2 on Intel, 1 on AMD. Two groups a tile share each activation broadcast
// between two dot products and keep two streams of weights in flight. Measured on an Intel Xeon (Emerald Rapids,
// no AMX, session 26): in cache, one thread, every type, int8x32 and int16, 3 to 16 rows, 0.80-0.95x the time
// of one group a tile (median of per-round ratios); the Qwen 1.5B forward after 256 cached, 2 threads, int16,
// 15 rounds, 4 / 5 / 8 / 16 rows 0.98 / 0.95 / 0.92 / 0.89x (benchmarks/RESULTS.md). Not measured on AMD, where
// more streams a thread were slower for one row (above): 1 there. QUICKDRAFT_QUANT_MANY_ROW_GROUPS = 1 or 2
// overrides.
int many_row_groups() {
  static const int groups = groups_a_tile("QUICKDRAFT_QUANT_MANY_ROW_GROUPS", 2);
  return groups;
}

// Groups [g0, g1) of one weight, all rows, into y (group g0's first output of row 0). One or two rows take
// few_row_groups() groups a tile; more rows go in blocks of at most 8 (as even as possible) by many_row_groups()
// groups: the groups' chunks come from memory once, for the first block, and from cache for the others. A last group
// left over from the pairs goes alone.
template <class Q, int D, bool F, class Y>
void groups(const Activations& a, const uint8_t* w, int64_t g0, int64_t g1, Y* y, int64_t ldy) {
  const int64_t M = a.M, super_blocks = a.K / Q::SB, group_bytes = super_blocks * Q::kChunk;
  auto at = [&](int64_t g) { return w + g * group_bytes; };
  int64_t g = g0;
  if (M <= 2 && few_row_groups() == 4) {
    for (; g + 4 <= g1; g += 4) {
      if (M == 1) tile<Q, 1, 4, D, F>(a, 0, at(g), group_bytes, super_blocks, y + (g - g0) * 16, ldy);
      else tile<Q, 2, 4, D, F>(a, 0, at(g), group_bytes, super_blocks, y + (g - g0) * 16, ldy);
    }
  }
  const int64_t row_blocks = (M + 7) / 8, block_rows = (M + row_blocks - 1) / row_blocks;
  auto row_blocks_of = [&](auto group_count) {  // groups g .. g + NB - 1, every block of rows
    constexpr int NB = decltype(group_count)::value;
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      Y* ym = y + m0 * ldy + (g - g0) * 16;
#define QD_TILE(R) \
  case R: tile<Q, R, NB, D, F>(a, m0, at(g), group_bytes, super_blocks, ym, ldy); break;
      switch (std::min<int64_t>(block_rows, M - m0)) { QD_TILE(1) QD_TILE(2) QD_TILE(3) QD_TILE(4) QD_TILE(5) QD_TILE(6) QD_TILE(7) QD_TILE(8) }
#undef QD_TILE
    }
  };
  if (M > 2 && many_row_groups() == 2)
    for (; g + 2 <= g1; g += 2) row_blocks_of(std::integral_constant<int, 2>{});
  for (; g < g1; ++g) row_blocks_of(std::integral_constant<int, 1>{});
}

// --- AMX-INT8 tiles, for many rows -------------------------------------------------------------------------
// The same integer dot products on tiles, the float finish tile()'s op for op, so each row's outputs are bitwise
// those of the vpdpbusd kernel (integer sums have no rounding). The A tile is TR rows of activation digits (with
// two digits, the high and low digit of TR / 2 rows, interleaved: one tile product for both), in the order the
// codes are stored (a B tile row is 4 inputs of 16 outputs, 64 bytes: exactly AMX's B layout).

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Blocks of 32 (a float scale each): groups [g0, g1), one at a time; rows in passes of R = TR / D (the activations
// are padded with zero rows to a multiple of R). For a block, B holds the codes less their zero point (signed
// bytes, tdpbssd): the same integer as the vpdpbusd kernel's sum q v - z sum v. Eight blocks' codes are unpacked at
// a time, once for all passes, and a pass's tile products all issued before any is finished, so that the tiles'
// latency overlaps (measured: a block at a time, unpack, multiply, finish, ran no faster than vpdpbusd). Tiles
// 0/1 A, 2/5 B, 3/4 C, alternating by block.
template <class Q, int D, int TR, class Y>
__attribute__((target("avx512vnni,amx-tile,amx-int8")))
void amx_groups(const Activations& a, const uint8_t* w, int64_t g0, int64_t g1, Y* y, int64_t ldy) {
  static_assert(Q::kSubs == 1, "K-quants run on amx_super_groups");
  constexpr int R = TR / D;
  const int64_t M = a.M, K = a.K, blocks = K / Q::SB, group_bytes = blocks * Q::kChunk;
  const int64_t passes = (M + R - 1) / R, scales_per_row = K / a.block;
  constexpr int kUnits = Q::kSubK / 8, kRowsB = Q::kSubK / 4;
  constexpr int kBatch = 8;  // blocks unpacked and multiplied before the first of them is finished
  alignas(64) uint8_t codes[kBatch][kRowsB * 64];
  alignas(64) int32_t dots[kBatch][TR * 16];  // [block][row * D + digit][output]
  std::vector<float> total(passes * R * 16);  // [row][output]
  auto at = [&](int64_t row) { return total.data() + row * 16; };
  TileConfig config;
  for (int t : {0, 1}) config.rows[t] = TR, config.colsb[t] = Q::kSubK;
  for (int t : {2, 5}) config.rows[t] = kRowsB, config.colsb[t] = 64;
  for (int t : {3, 4}) config.rows[t] = TR, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  const __m512i zero_point = _mm512_set1_epi8(static_cast<char>(Q::kZero));
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    std::fill(total.begin(), total.end(), 0.0f);
    for (int64_t t0 = 0; t0 < blocks; t0 += kBatch) {
      const int batch = static_cast<int>(std::min<int64_t>(kBatch, blocks - t0));
      for (int i = 0; i < batch; ++i) {
        const uint8_t* chunk = wg + (t0 + i) * Q::kChunk;
        for (int u = 0; u < kUnits; ++u) {
          prefetch_share<Q>(&chunk, 1, u);
          __m512i ca, cb;
          Q::codes(chunk, u, ca, cb);
          if constexpr (Q::kZero != 0) ca = _mm512_sub_epi8(ca, zero_point), cb = _mm512_sub_epi8(cb, zero_point);
          _mm512_store_si512(codes[i] + (2 * u) * 64, ca);
          _mm512_store_si512(codes[i] + (2 * u + 1) * 64, cb);
        }
      }
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t r0 = p * R;
        for (int i = 0; i < batch; ++i) {  // tile numbers must be immediates: even and odd ones spelled out
          const int8_t* digits = a.digit(r0, 0) + (t0 + i) * Q::kSubK;
          if (i % 2 == 0) {
            _tile_loadd(2, codes[i], 64); _tile_loadd(0, digits, K);
            _tile_zero(3); _tile_dpbssd(3, 0, 2); _tile_stored(3, dots[i], 64);
          } else {
            _tile_loadd(5, codes[i], 64); _tile_loadd(1, digits, K);
            _tile_zero(4); _tile_dpbssd(4, 1, 5); _tile_stored(4, dots[i], 64);
          }
        }
        __m512 acc[R];
        for (int m = 0; m < R; ++m) acc[m] = _mm512_loadu_ps(at(r0 + m));
        for (int i = 0; i < batch; ++i) {
          const int64_t t = t0 + i, ks = t * Q::kSubK;
          const uint8_t* chunk = wg + t * Q::kChunk;
          const __m512 sc = Q::sub_scale(chunk, 0), mn = Q::sub_min(chunk, 0);
          for (int m = 0; m < R; ++m) {
            __m512i dot = _mm512_load_si512(dots[i] + (m * D) * 16);
            if constexpr (D == 2) dot = combine(dot, _mm512_load_si512(dots[i] + (m * D + 1) * 16));
            const int64_t row = r0 + m;
            acc[m] = add_block<Q>(acc[m], dot, sc, mn, a.scale[row * scales_per_row + ks / a.block],
                                  a.sum32[row * (K / 32) + ks / 32]);
          }
        }
        for (int m = 0; m < R; ++m) _mm512_storeu_ps(at(r0 + m), acc[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) store16(y + m * ldy + (g - g0) * 16, _mm512_loadu_ps(at(m)));
  }
  _tile_release();
}

// K-quants (Q4_K, Q5_K, Q6_K): the sub-block scales folded into the codes, so that one tile product spans a
// super-block and its finish is once a super-block, not once a sub-block. p = (q - z) sc_j is an int16 (Q4_K 0 ..
// 945, Q5_K 0 .. 1953, Q6_K -4064 .. 4096); its low bytes (unsigned, tdpbsud) and high bytes (tdpbsud or, signed,
// tdpbssd) are two B tiles, and C_low + 256 C_high is the vpdpbusd kernel's sum_j sc_j dot_j per digit, exactly
// (|.| < 2^28).
// A super-block's B tiles are built once (in L1) for all passes of 8 or 16 rows, so a row costs a few tile
// products and its finish; the products of 4 x 64 inputs accumulate in two pairs of C tiles (even and odd
// 64-input steps) so that consecutive products do not wait for each other. Tiles: 0/1 A, 2/3 B (low/high), 4..7 C.
template <class Q, int D, int TR, class Y>
__attribute__((target("avx512vnni,avx512bw,amx-tile,amx-int8")))
void amx_super_groups(const Activations& a, const uint8_t* w, int64_t g0, int64_t g1, Y* y, int64_t ldy) {
  static_assert(Q::SB == 256, "super-blocks of 256 inputs");
  constexpr int R = TR / D, kSteps = Q::SB / 64, kUnitsPerSub = Q::kSubK / 8;
  const int64_t M = a.M, K = a.K, super_blocks = K / Q::SB, group_bytes = super_blocks * Q::kChunk;
  const int64_t passes = (M + R - 1) / R, scales_per_row = K / a.block;
  alignas(64) uint8_t low[kSteps * 16 * 64], high[kSteps * 16 * 64];  // B: [64-input step][4 inputs][16 outputs]
  alignas(64) int32_t dots[4][TR * 16];  // C: low even, high even, low odd, high odd steps: [row * D + digit][output]
  std::vector<float> total(passes * R * 16);  // [row][output]
  TileConfig config;
  for (int t : {0, 1}) config.rows[t] = TR, config.colsb[t] = 64;
  for (int t : {2, 3}) config.rows[t] = 16, config.colsb[t] = 64;
  for (int t : {4, 5, 6, 7}) config.rows[t] = TR, config.colsb[t] = 64;
  _tile_loadconfig(&config);
  const __m512i byte = _mm512_set1_epi32(0xFF), word = _mm512_set1_epi32(0xFFFF);
  const __m512i low_of_words = _mm512_set1_epi16(0x00FF);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    std::fill(total.begin(), total.end(), 0.0f);
    for (int64_t b = 0; b < super_blocks; ++b) {
      const uint8_t* chunk = wg + b * Q::kChunk;
      for (int s = 0; s < Q::kSubs; ++s) {
        // sc_j of each output as the signed byte of the even (odd) byte of each 16-bit word: vpmaddubsw's
        // products of the even (odd) codes, q sc_j, one a word; z sc_j in each word of an output's lane
        const __m512i sc = Q::sub_scale_int(chunk, s);
        const __m512i sc_bytes = _mm512_and_si512(sc, byte);
        const __m512i even = _mm512_or_si512(sc_bytes, _mm512_slli_epi32(sc_bytes, 16));
        const __m512i odd = _mm512_slli_epi32(even, 8);
        const __m512i z_sc = _mm512_mullo_epi32(sc, _mm512_set1_epi32(Q::kZero));
        const __m512i z_words = _mm512_or_si512(_mm512_and_si512(z_sc, word), _mm512_slli_epi32(z_sc, 16));
        for (int i = 0; i < kUnitsPerSub; ++i) {
          const int u = s * kUnitsPerSub + i;
          prefetch_share<Q>(&chunk, 1, u);
          __m512i code[2];
          Q::codes(chunk, u, code[0], code[1]);
          for (int half = 0; half < 2; ++half) {
            __m512i pe = _mm512_maddubs_epi16(code[half], even), po = _mm512_maddubs_epi16(code[half], odd);
            if constexpr (Q::kZero != 0) pe = _mm512_sub_epi16(pe, z_words), po = _mm512_sub_epi16(po, z_words);
            const int row = 2 * u + half;  // of the super-block's 64 B rows
            // the low (high) bytes of the even inputs' and the odd inputs' products, interleaved (word w of a
            // B row: the byte of pe's word w, then po's): a shift and a bit-select each. Measured in one process
            // against a byte permute (vpermt2b) each, one thread, 1024 x 1536 in cache, 8 / 16 rows, same bits:
            // Q4_K 0.93x / 0.96x the time, Q6_K 0.95x / 0.95x.
            _mm512_store_si512(low + row * 64, _mm512_ternarylogic_epi32(low_of_words, pe, _mm512_slli_epi16(po, 8), 0xCA));
            _mm512_store_si512(high + row * 64, _mm512_ternarylogic_epi32(low_of_words, _mm512_srli_epi16(pe, 8), po, 0xCA));
          }
        }
      }
      const __m512 d = Q::super_scale(chunk);
      __m512 mn[Q::kMin ? Q::kSubs : 1];
      Q::mins(chunk, mn);
      // Passes two at a time share the B tiles (C 4/5 the first's, 6/7 the second's); a pass alone splits its
      // products by even and odd 64-input steps instead (C 4/5 and 6/7), so that no product waits for the last.
      for (int64_t p = 0; p < passes; p += 2) {
        const bool pair = p + 1 < passes;
        const int8_t* first = a.digit(p * R, 0) + b * Q::SB;
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        if (pair) {
          const int8_t* second = a.digit((p + 1) * R, 0) + b * Q::SB;
          for (int c = 0; c < kSteps; ++c) {
            _tile_loadd(2, low + c * 1024, 64); _tile_loadd(3, high + c * 1024, 64);
            _tile_loadd(0, first + c * 64, K); _tile_loadd(1, second + c * 64, K);
            _tile_dpbsud(4, 0, 2); _tile_dpbsud(6, 1, 2);
            if constexpr (Q::kSignedProducts) { _tile_dpbssd(5, 0, 3); _tile_dpbssd(7, 1, 3); }
            else { _tile_dpbsud(5, 0, 3); _tile_dpbsud(7, 1, 3); }
          }
        } else {
          for (int c = 0; c < kSteps; c += 2) {  // tile numbers must be immediates: even and odd steps spelled out
            _tile_loadd(0, first + c * 64, K); _tile_loadd(2, low + c * 1024, 64); _tile_loadd(3, high + c * 1024, 64);
            _tile_dpbsud(4, 0, 2);
            if constexpr (Q::kSignedProducts) _tile_dpbssd(5, 0, 3); else _tile_dpbsud(5, 0, 3);
            _tile_loadd(1, first + (c + 1) * 64, K); _tile_loadd(2, low + (c + 1) * 1024, 64); _tile_loadd(3, high + (c + 1) * 1024, 64);
            _tile_dpbsud(6, 1, 2);
            if constexpr (Q::kSignedProducts) _tile_dpbssd(7, 1, 3); else _tile_dpbsud(7, 1, 3);
          }
        }
        _tile_stored(4, dots[0], 64); _tile_stored(5, dots[1], 64);
        _tile_stored(6, dots[2], 64); _tile_stored(7, dots[3], 64);
        for (int q = 0; q < (pair ? 2 : 1); ++q) {
          const int32_t* c_low = dots[2 * q];
          const int32_t* c_high = dots[2 * q + 1];
          const int64_t real = std::min<int64_t>(R, M - (p + q) * R);  // the zero rows past M need no finish
          for (int m = 0; m < real; ++m) {
            __m512i whole[D];
            for (int e = 0; e < D; ++e) {
              const int at = (m * D + e) * 16;
              whole[e] = _mm512_add_epi32(_mm512_load_si512(c_low + at), _mm512_slli_epi32(_mm512_load_si512(c_high + at), 8));
              if (!pair)
                whole[e] = _mm512_add_epi32(whole[e], _mm512_add_epi32(_mm512_load_si512(dots[2] + at),
                                                                       _mm512_slli_epi32(_mm512_load_si512(dots[3] + at), 8)));
            }
            const int64_t row = (p + q) * R + m;
            float* t = total.data() + row * 16;
            _mm512_storeu_ps(t, add_super_block<Q>(_mm512_loadu_ps(t), super_block_part<D>(whole), d,
                                                    a.scale[row * scales_per_row + b], mn,
                                                    a.sum32.data() + row * (K / 32) + b * (Q::SB / 32)));
          }
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) store16(y + m * ldy + (g - g0) * 16, _mm512_loadu_ps(total.data() + m * 16));
  }
  _tile_release();
}

// The tile kernel of a type: K-quants fold their sub-block scales into the codes, blocks of 32 cannot. Built
// with QUICKDRAFT_AMX only (quickdraft/kernels/__init__.py defines it on CPUs with AMX): elsewhere the tile
// kernels, instantiated for every type, digit count, tile height and output type, are never compiled (half this
// file's build) and amx_tiles_usable() is false, so this is never called.
#ifndef QUICKDRAFT_AMX
#define QUICKDRAFT_AMX 0
#endif
constexpr bool kAmxBuilt = QUICKDRAFT_AMX;

template <class Q, int D, int TR, class Y>
void amx_kernel(const Activations& a, const uint8_t* w, int64_t g0, int64_t g1, Y* y, int64_t ldy) {
  if constexpr (!kAmxBuilt) {
    TORCH_CHECK(false, "quickdraft's kernels were built without AMX");
  } else if constexpr (Q::kSubs > 1) {
    amx_super_groups<Q, D, TR>(a, w, g0, g1, y, ldy);
  } else {
    amx_groups<Q, D, TR>(a, w, g0, g1, y, ldy);
  }
}

template <class F>
decltype(auto) dispatch(int64_t type, F&& f) {
  return dispatch_type<Q4_0V, Q4_1V, Q5_0V, Q5_1V, Q8_0V, Q4_KV, Q5_KV, Q6_KV>(type, std::forward<F>(f));
}

}  // namespace

#pragma GCC pop_options

bool amx_available();  // cpu_linear.cpp: the OS lets this process use AMX tiles

bool quant_vnni_available() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return ok;
}

namespace {
// Where the CPU has AMX-INT8, calls of this many rows run on tiles (the same bits either way). Measured
// (benchmarks/quant_kernels.py, one thread, weights in cache, ns a weight and row, vpdpbusd -> tiles; one run on
// a shared machine): blocks of 32, two digits at 8 rows Q4_0 0.0097 -> 0.0071, Q8_0 0.0109 -> 0.0086, at 4 rows
// none; one digit at 8 rows slower, at 16 faster. K-quants (amx_super_groups, session 16): two digits Q4_K at 5
// rows 0.0105 -> 0.0119, at 8 0.0105 -> 0.0075, at 16 0.0099 -> 0.0058; one digit at 8 rows 0.0060 -> 0.0076, at
// 16 0.0060 -> 0.0049. A block-of-32 tile product costs about the same whatever its rows (57 cycles a block of 32
// x 16 outputs: the tiles' own load, product and store latency); a K-quant call costs its B tiles (~0.03 ns a
// weight, once) and ~0.02 ns a weight a pass of 8 or 16 rows.
constexpr int64_t kAmxRows[3] = {0, 16, 8};  // by digits
// set_quant_amx_rows(n): tiles from n rows instead (tests and benchmarks/quant_kernels.py: every tiling's bits
// and the crossovers); 0: kAmxRows.
std::atomic<int64_t> amx_rows_set{0};
int64_t amx_rows(int digits) {
  const int64_t set = amx_rows_set.load();
  return set > 0 ? set : kAmxRows[digits];
}
// The tiles (the OS must grant them to the process).
bool amx_tiles_usable() {
  return kAmxBuilt && __builtin_cpu_supports("amx-int8") && amx_available();
}
// -1: not chosen yet; QUICKDRAFT_QUANT_AMX=0 keeps the vpdpbusd kernel for every call (to test it on AMX CPUs).
std::atomic<int> use_amx{-1};

bool amx_int8_in_use() {
  int on = use_amx.load();
  if (on < 0) {
    const char* env = std::getenv("QUICKDRAFT_QUANT_AMX");
    on = quant_vnni_available() && amx_tiles_usable() &&
         !(env && std::string(env) == "0");
    use_amx.store(on);
  }
  return on;
}
}  // namespace

// Whether calls of many rows run on AMX-INT8 tiles; set_quant_amx(false) keeps them on vpdpbusd, true asks for
// tiles (granted where the CPU has them). Returns the setting before.
bool set_quant_amx(bool on) {
  const bool before = amx_int8_in_use();
  use_amx.store(on && quant_vnni_available() && amx_tiles_usable());
  return before;
}
bool get_quant_amx() { return amx_int8_in_use(); }
// From how many rows calls run on tiles where they are on (0: the measured default); returns the setting before.
int64_t set_quant_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "rows must be >= 0 (0: the default)");
  return amx_rows_set.exchange(rows);
}

namespace {

// A call of the integer kernels, set up once for either entry point: its parts, the activations quantized in each
// variant its parts need, and whether it runs on AMX tiles. `digits` (1 or 2) integer digits an activation, a scale
// per 32 activations for every type if `fine` (one digit only: int8x32), else per weight block (256 for the
// K-quants). With `fine` the K-quants stay on vpdpbusd (amx_super_groups folds one activation scale per
// super-block).
class IntegerCall {
 public:
  IntegerCall(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
              int digits, bool fine)
      : digits_(digits), fine_(fine) {
    TORCH_CHECK(digits == 1 || digits == 2, "digits must be 1 or 2");
    TORCH_CHECK(!fine || digits == 1, "a scale per 32 activations is a one-digit scheme");
    M = x.size(0);
    const int64_t K = x.size(1);
    // activation variants: [K-quant blocks of 256 or blocks of 32][nibble order or natural]
    bool needed[2][2] = {};
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto [wide, nibbles] = dispatch(types[i], [](auto q) {
        using Q = decltype(q);
        return std::pair<int, int>{Q::SB == 256, Q::kNibbles};
      });
      needed[wide][nibbles] = true;
      parts_.push_back({weights[i].data_ptr<uint8_t>(), types[i], weights[i].size(0), N, 2 * wide + nibbles});
      N += weights[i].size(0) * 16;
      total_groups += weights[i].size(0);
    }
    if (M == 0) return;
    // A tiles of 8 rows (each row's digits) for few rows, else 16; zero rows past M up to a whole pass
    tile_rows_ = M * digits <= 8 ? 8 : 16;
    const int64_t pass = tile_rows_ / digits;
    // Blocks of 32: a pass costs about the same whatever rows it holds (the tiles' latency and the finish a block),
    // a vpdpbusd row about 1/7 of a pass: a call whose last pass would be mostly zero rows runs on vpdpbusd instead
    // (the same bits). Measured on the Qwen 1.5B forward before the K-quants' kernel (2 threads, two digits, ms:
    // tiles / vpdpbusd): 8 rows 94 / 97, 9 138 / 107, 12 148 / 128, 16 166 / 161, 17 208 / 173, 24 198 / 218, 32
    // 275 / 283. K-quants (amx_super_groups): a call costs its B tiles once and a pass little, so every call from
    // kAmxRows rows runs on tiles. set_quant_amx_rows(n) puts every call of n rows or more on tiles, for the tests
    // of every tiling.
    const int64_t waste = (pass - M % pass) % pass;
    const bool many = M >= amx_rows(digits) && amx_int8_in_use();
    block_tiles_ = many && (amx_rows_set.load() > 0 || waste <= pass / 4);
    tiles_ = many && !fine;  // K-quants
    const int64_t rows = tiles_ || block_tiles_ ? (M + pass - 1) / pass * pass : M;
    for (int wide = 0; wide < 2; ++wide)
      for (int nibbles = 0; nibbles < 2; ++nibbles)
        if (needed[wide][nibbles]) {
          const int64_t block = wide && !fine ? 256 : 32;
          Activations& a = acts_[2 * wide + nibbles];
          if (x.scalar_type() == at::kFloat) quantize(x.data_ptr<float>(), M, rows, K, block, digits, nibbles, a);
          else quantize(x.data_ptr<c10::BFloat16>(), M, rows, K, block, digits, nibbles, a);
        }
  }

  // Groups [begin, end) of all parts into y: output column c of row m at y[m * ldy + c - first].
  template <class Y>
  void run_groups(int64_t begin, int64_t end, Y* y, int64_t ldy, int64_t first) const {
    for_parts(parts_, begin, end, [&](const Part& part, int64_t g0, int64_t g1) {
      dispatch(part.type, [&](auto q) {
        using Q = decltype(q);
        const Activations& a = acts_[part.variant];
        Y* yq = y + part.column + g0 * 16 - first;
        if (Q::kSubs > 1 ? tiles_ : block_tiles_) {
          if (digits_ == 1 && tile_rows_ == 8) amx_kernel<Q, 1, 8>(a, part.w, g0, g1, yq, ldy);
          else if (digits_ == 1) amx_kernel<Q, 1, 16>(a, part.w, g0, g1, yq, ldy);
          else if (tile_rows_ == 8) amx_kernel<Q, 2, 8>(a, part.w, g0, g1, yq, ldy);
          else amx_kernel<Q, 2, 16>(a, part.w, g0, g1, yq, ldy);
        }
        else if (fine_) groups<Q, 1, true>(a, part.w, g0, g1, yq, ldy);
        else if (digits_ == 1) groups<Q, 1, false>(a, part.w, g0, g1, yq, ldy);
        else groups<Q, 2, false>(a, part.w, g0, g1, yq, ldy);
      });
    });
  }

  int64_t M = 0, N = 0, total_groups = 0;

 private:
  struct Part {
    const uint8_t* w;
    int64_t type, groups, column, variant;
  };
  int digits_;
  bool fine_, tiles_ = false, block_tiles_ = false;
  int tile_rows_ = 8;
  std::vector<Part> parts_;
  Activations acts_[4];
};

}  // namespace

// y = x [W_0; W_1; ...]^T as cpu_quant.cpp's linear_quant (which checked the arguments) on the integer kernels
// (IntegerCall says how); y float32 if float_output, else bf16. Runs only where quant_vnni_available().
at::Tensor linear_quant_vnni(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                const std::vector<int64_t>& types, int digits, bool fine, bool float_output) {
  const IntegerCall call(x, weights, types, digits, fine);
  auto y = at::empty({call.M, call.N}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  if (call.M == 0) return y;
  auto run = [&](auto* yp) {
    at::parallel_for(0, call.total_groups, 4, [&](int64_t begin, int64_t end) {
      call.run_groups(begin, end, yp, call.N, 0);
    });
  };
  if (float_output) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

// cpu_quant.cpp's linear_quant_argmax (which checked the arguments) on the integer kernels: the same logits, bit
// for bit, never written whole.
std::tuple<at::Tensor, bool> linear_quant_vnni_argmax(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                                      const std::vector<int64_t>& types, int digits, bool fine,
                                                      int64_t valid_columns) {
  const IntegerCall call(x, weights, types, digits, fine);
  return argmax_by_blocks(call.M, call.total_groups, valid_columns, [&](int64_t g0, int64_t g1, float* y, int64_t ldy) {
    call.run_groups(g0, g1, y, ldy, g0 * 16);
  });
}
