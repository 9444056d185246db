// Linear layers on GGUF-quantized weights kept in their block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K):
// y = x W^T for the few rows of a decoding or verification step, streaming 4.5-8.5 bits per weight.
//
// Why: a decoding step reads every weight once; at batch 1 its time is the bytes streamed over the memory
// bandwidth. The packaged models are stored at 4-6 bits a weight; widened to bf16 they stream 2.8-3.5x more.
//
// Numerics: weights are never widened in memory. Each block's integer codes become bf16 in registers (every
// code is exact in bf16), a block's dot product with x accumulates bf16 pairs in float32 (AVX512-BF16), and
// the block's scale (and min) multiply that float32 sum: y = sum over blocks of d_b * (x . q_b) + m_b *
// sum(x_b). Every output y[m, n] is computed by the same instruction sequence whatever the number of rows,
// the tiling of rows and outputs, or the threads: a token's logits are bitwise the same when it is verified
// alone or among K+1 tokens or other sequences' rows.
//
// Layout (quickdraft.kernels.quant packs it from the GGUF blocks): the outputs in groups of 16; for each
// group, K in super-blocks of SB (32, or 256 for the K-quants); for each (group, super-block) one chunk of
// bytes, chunks stored group-major so a group's weights are one contiguous stream. Within a chunk, the codes
// are laid out for the dot-product instruction: "step" p of a 32-K block covers k = 2p, 2p+1 for the 16
// outputs, 32 bf16 lanes (lane 2n + e holds W[n, 2p + e]). 4-bit codes: a 64-byte vector holds four steps,
// the nibble of step 4g + s in bits 4s..4s+3 of each 16-bit lane, so a shift and one permute (a 32-entry
// table of bf16 values indexed by the lane's low 5 bits) give the step's weights. 5th bits (Q5_0, Q5_1, Q5_K) and the
// 2 high bits of Q6_K codes sit in planes of their own (in the order cpu_quant.h gives, which suits the integer
// kernel) and are merged into the index by a shift and one ternary-logic. Q8_0 codes are bytes in lane order,
// widened to bf16.
//
// This file is the fallback: where the CPU has AVX512-VNNI, linear_quant runs the integer-dot-product kernel
// (cpu_quant_vnni.cpp) on the same chunks, its activations quantized to two int8 digits (the default) or one.

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_quant.h"

// The integer-dot-product kernels (cpu_quant_vnni.cpp): whether this CPU runs them, and y = x W^T on them.
bool quant_vnni_available();
at::Tensor linear_quant_vnni(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                const std::vector<int64_t>& types, int digits, bool fine, bool float_output);
std::tuple<at::Tensor, bool> linear_quant_vnni_argmax(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                                      const std::vector<int64_t>& types, int digits, bool fine,
                                                      int64_t valid_columns);

namespace {

struct Tables {
  alignas(64) uint16_t q4[32];      // i & 15
  alignas(64) uint16_t q4_0[32];    // (i & 15) - 8
  alignas(64) uint16_t q5_0[32];    // i - 16
  alignas(64) uint16_t q5[32];      // i
  alignas(64) uint16_t q6_k[64];    // i - 32
};

const Tables& tables() {
  static const Tables t = [] {
    Tables t{};
    auto bf = [](int v) { return c10::BFloat16(static_cast<float>(v)).x; };
    for (int i = 0; i < 32; ++i) {
      t.q4[i] = bf(i & 15);
      t.q4_0[i] = bf((i & 15) - 8);
      t.q5_0[i] = bf(i - 16);
      t.q5[i] = bf(i);
    }
    for (int i = 0; i < 64; ++i) t.q6_k[i] = bf(i - 32);
    return t;
  }();
  return t;
}

// The index lanes of step p from a plane of nibbles (four steps per 64-byte vector).
inline __m512i nibbles(const uint8_t* plane, int p) {
  return _mm512_srli_epi16(load(plane + (p >> 2) * 64), 4 * (p & 3));
}

// bits [lo, lo + n) of each lane of `from` moved to bit `to` upward.
inline __m512i move_bits(__m512i from, int lo, int to) {
  return lo <= to ? _mm512_slli_epi16(from, to - lo) : _mm512_srli_epi16(from, lo - to);
}

// The per-type parts of the bf16 kernel: the codes of step p as bf16.
struct Q4_0 : Q4_0Layout {
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    return (__m512bh)_mm512_permutexvar_epi16(nibbles(c, p), t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q4_0); }
};

struct Q4_1 : Q4_1Layout {  // the min is added: + m * sum(x)
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    return (__m512bh)_mm512_permutexvar_epi16(nibbles(c, p), t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q4); }
};

struct Q5_0 : Q5_0Layout {
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    __m512i high = move_bits(load(c + 256), q5_high_bit(p), 4);  // the 5th bit of step p
    __m512i index = _mm512_ternarylogic_epi32(t[1], high, nibbles(c, p), 0xCA);  // bit 4 from high, rest from lo
    return (__m512bh)_mm512_permutexvar_epi16(index, t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q5_0); t[1] = _mm512_set1_epi16(0x0010); }
};

struct Q5_1 : Q5_1Layout {  // Q5_0's codes unsigned; the min is added
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    __m512i high = move_bits(load(c + 256), q5_high_bit(p), 4);
    __m512i index = _mm512_ternarylogic_epi32(t[1], high, nibbles(c, p), 0xCA);
    return (__m512bh)_mm512_permutexvar_epi16(index, t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q5); t[1] = _mm512_set1_epi16(0x0010); }
};

struct Q8_0 : Q8_0Layout {
  static __m512bh weights(const uint8_t* c, int p, const __m512i*) {
    __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + p * 32)));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  static void load_tables(__m512i*) {}
};

struct Q4_K : Q4_KLayout {
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    return (__m512bh)_mm512_permutexvar_epi16(nibbles(c, p), t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q4); }
};

struct Q5_K : Q5_KLayout {  // Q5_0's 5th bits, a plane per sub-block of 32; the min is added
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    __m512i high = move_bits(load(c + 2048 + (p >> 4) * 64), q5_high_bit(p & 15), 4);
    __m512i index = _mm512_ternarylogic_epi32(t[1], high, nibbles(c, p), 0xCA);
    return (__m512bh)_mm512_permutexvar_epi16(index, t[0]);
  }
  static void load_tables(__m512i* t) { t[0] = load(tables().q5); t[1] = _mm512_set1_epi16(0x0010); }
};

struct Q6_K : Q6_KLayout {
  static __m512bh weights(const uint8_t* c, int p, const __m512i* t) {
    __m512i high = move_bits(load(c + 2048 + (p >> 3) * 64), q6_high_bits(p & 7), 4);
    __m512i index = _mm512_ternarylogic_epi32(t[2], high, nibbles(c, p), 0xCA);  // bits 4-5 from high
    return (__m512bh)_mm512_permutex2var_epi16(t[0], index, t[1]);
  }
  static void load_tables(__m512i* t) {
    t[0] = load(tables().q6_k); t[1] = load(tables().q6_k + 32); t[2] = _mm512_set1_epi16(0x0030);
  }
};

// --- the kernel -----------------------------------------------------------------------------------------------

// MR rows of x by NB groups of 16 outputs, over all of K. x: pairs of bf16 as 32-bit words, row stride
// half_k; xsum: per row, the float32 sum of x over each 32-wide block (types with mins); w: the chunks of
// the tile's first group (groups `group_bytes` apart); y: the tile's first output of row 0.
template <class Q, int MR, int NB, class Y>
void tile(const int32_t* x, int64_t half_k, const float* xsum, int64_t xsum_stride, const uint8_t* w,
          int64_t group_bytes, int64_t super_blocks, Y* y, int64_t ldy) {
  __m512i t[3];
  Q::load_tables(t);
  __m512 total[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) total[m][j] = _mm512_setzero_ps();
  constexpr int kSteps = Q::kSubK / 2;
  // The kernel computes for long on each line it reads, so few lines are in flight: fetch about 8 KB ahead in
  // every stream (past a group's end lies the next group's start, read next). Measured: 3-15% faster. Each
  // sub-block asks for its share of the lines (a whole chunk's at once stalls the core once the line fill
  // buffers are full: cpu_quant_vnni.cpp's prefetch_share).
  constexpr int kAhead = (8192 + Q::kChunk - 1) / Q::kChunk, kLines = (Q::kChunk + 63) / 64;
  for (int64_t b = 0; b < super_blocks; ++b) {
    const uint8_t* chunk[NB];
    for (int j = 0; j < NB; ++j) chunk[j] = w + j * group_bytes + b * Q::kChunk;
    const int32_t* xb = x + b * (Q::SB / 2);
    for (int s = 0; s < Q::kSubs; ++s) {
      for (int line = s * kLines / Q::kSubs; line < (s + 1) * kLines / Q::kSubs; ++line)
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(chunk[j] + kAhead * Q::kChunk + line * 64), _MM_HINT_T0);
      __m512 acc[MR][NB];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int i = 0; i < kSteps; ++i) {
        const int p = s * kSteps + i;
        __m512bh wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = Q::weights(chunk[j], p, t);
        for (int m = 0; m < MR; ++m) {
          __m512bh xv = (__m512bh)_mm512_set1_epi32(xb[m * half_k + p]);
          for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
        }
      }
      for (int j = 0; j < NB; ++j) {
        const __m512 scale = Q::scale(chunk[j], s);
        for (int m = 0; m < MR; ++m) total[m][j] = _mm512_fmadd_ps(acc[m][j], scale, total[m][j]);
        if constexpr (Q::kMin) {
          const __m512 min = Q::min(chunk[j], s);
          const int64_t block = (b * Q::SB + s * Q::kSubK) / 32;
          for (int m = 0; m < MR; ++m)
            total[m][j] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[m * xsum_stride + block]), total[m][j]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j)
      store16(y + m * ldy + j * 16, total[m][j]);
}

// Groups [g0, g1) of one weight, all M rows, into y (group g0's first output of row 0). One or two rows take 4
// groups a tile (independent accumulators hide the dot product's latency); more rows go in blocks of at most 6, as
// even as possible, by 2 groups (each unpacked weight vector then serves up to 6 rows).
template <class Q, class Y>
void groups(const int32_t* x, int64_t M, int64_t half_k, const float* xsum, int64_t xsum_stride, const uint8_t* w,
            int64_t g0, int64_t g1, Y* y, int64_t ldy) {
  const int64_t super_blocks = 2 * half_k / Q::SB;
  const int64_t group_bytes = super_blocks * Q::kChunk;
  auto at = [&](int64_t g) { return w + g * group_bytes; };
  int64_t g = g0;
  if (M <= 2) {
    for (; g + 4 <= g1; g += 4) {
      Y* yg = y + (g - g0) * 16;
      if (M == 1) tile<Q, 1, 4>(x, half_k, xsum, xsum_stride, at(g), group_bytes, super_blocks, yg, ldy);
      else tile<Q, 2, 4>(x, half_k, xsum, xsum_stride, at(g), group_bytes, super_blocks, yg, ldy);
    }
  }
  const int64_t row_blocks = (M + 5) / 6, block_rows = (M + row_blocks - 1) / row_blocks;
  for (; g < g1; g += 2) {
    const bool pair = g + 2 <= g1;
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t rows = std::min<int64_t>(block_rows, M - m0);
      const int32_t* xm = x + m0 * half_k;
      const float* sm = xsum + m0 * xsum_stride;
      Y* ym = y + m0 * ldy + (g - g0) * 16;
#define QD_TILE(R)                                                                                         \
  case R:                                                                                                  \
    if (pair) tile<Q, R, 2>(xm, half_k, sm, xsum_stride, at(g), group_bytes, super_blocks, ym, ldy);        \
    else tile<Q, R, 1>(xm, half_k, sm, xsum_stride, at(g), group_bytes, super_blocks, ym, ldy);             \
    break;
      switch (rows) { QD_TILE(1) QD_TILE(2) QD_TILE(3) QD_TILE(4) QD_TILE(5) QD_TILE(6) }
#undef QD_TILE
    }
  }
}

template <class F>
decltype(auto) dispatch(int64_t type, F&& f) {
  return dispatch_type<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K>(type, std::forward<F>(f));
}

struct Part {
  const uint8_t* w;
  int64_t type, groups, column;  // column: its first output in y
};

// Which kernel linear_quant runs: it decides a model's numerics, as a dtype does. kInt8: one int8 digit an
// activation, a scale per weight block (256 for the K-quants: llama.cpp's Q8_K way); kInt8x32: one digit, a scale
// per 32 activations for every type (llama.cpp's Q8_0 way); kInt16: two digits, a scale per weight block
// (cpu_quant_vnni.cpp); kBf16: bf16 activations and codes (this file). A call names its model's kernel (the
// runner's choice by family, models/families.py; "" for none); a process-wide override (QUICKDRAFT_QUANT_KERNEL,
// or set_quant_kernel for tests and benchmarks) beats it; without either, the default.
constexpr int kBf16 = 0, kInt8 = 1, kInt16 = 2, kInt8x32 = 3, kKernels = 4;
constexpr const char* kKernelNames[] = {"bf16", "int8", "int16", "int8x32"};
// The default where the CPU has VNNI: int16, whose quality matched llama.cpp's where int8's did not (RESULTS.md,
// session 13: next-token agreement and KL against the float32 model); int8 costs 0.6x its compute at 8 rows.
constexpr int kDefaultKernel = kInt16;
constexpr int kUnread = -2, kNone = -1;
std::atomic<int> quant_override{kUnread};  // kUnread: QUICKDRAFT_QUANT_KERNEL not read yet; kNone: no override

int kernel_by_name(const std::string& name) {
  for (int k = 0; k < kKernels; ++k)
    if (name == kKernelNames[k]) return k;
  TORCH_CHECK(false, "unknown quantized kernel '", name, "' (choose bf16, int8, int8x32 or int16)");
  return kBf16;
}

int checked_kernel(const std::string& name, const char* what) {
  const int k = kernel_by_name(name);
  TORCH_CHECK(k == kBf16 || quant_vnni_available(), what, name,
              " needs AVX512-VNNI, which this CPU lacks (use bf16)");
  return k;
}

int override_in_use() {
  int k = quant_override.load();
  if (k == kUnread) {
    const char* env = std::getenv("QUICKDRAFT_QUANT_KERNEL");
    k = env && *env ? checked_kernel(env, "QUICKDRAFT_QUANT_KERNEL=") : kNone;
    int expected = kUnread;
    if (!quant_override.compare_exchange_strong(expected, k)) k = expected;  // set_quant_kernel came first
  }
  return k;
}

// The kernel a call runs whose model chose `model_kernel` ("" for none).
int kernel_for(const std::string& model_kernel) {
  const int k = override_in_use();
  if (k != kNone) return k;
  if (!model_kernel.empty()) return checked_kernel(model_kernel, "the model's quantized kernel ");
  return quant_vnni_available() ? kDefaultKernel : kBf16;
}

}  // namespace

// The quantized kernel a call of linear_quant runs for a model that chose `model_kernel` ("" for none: the
// default); set_quant_kernel(name) overrides every model's choice ("" removes the override) and returns the
// override before ("" for none). The integer kernels need AVX512-VNNI.
std::string get_quant_kernel(const std::string& model_kernel) { return kKernelNames[kernel_for(model_kernel)]; }
std::string set_quant_kernel(const std::string& name) {
  const int before = override_in_use();
  quant_override.store(name.empty() ? kNone : checked_kernel(name, "the quantized kernel "));
  return before == kNone ? "" : kKernelNames[before];
}

namespace {

// A checked call of linear_quant or linear_quant_argmax: the kernel it runs, x as that kernel reads it, and the
// parts side by side.
struct Call {
  int kernel;
  at::Tensor x;
  std::vector<Part> parts;
  int64_t M, K, N = 0, total_groups = 0;
  bool mins = false;
  int digits() const { return kernel == kInt16 ? 2 : 1; }
  bool fine() const { return kernel == kInt8x32; }
};

Call checked_call(const at::Tensor& x_in, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& types,
                  const std::string& kernel_name) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) &&
              x_in.is_contiguous() && x_in.device().is_cpu(), "x must be a contiguous 2-d bf16 or float32 CPU tensor");
  Call call;
  // float32 x: the integer kernels quantize it as it is; the bf16 kernel reads it rounded to bf16.
  call.kernel = kernel_for(kernel_name);
  call.x = call.kernel == kBf16 ? x_in.to(at::kBFloat16) : x_in;
  TORCH_CHECK(!weights.empty() && weights.size() == types.size(), "one type per quantized weight");
  call.M = call.x.size(0), call.K = call.x.size(1);
  TORCH_CHECK(call.K % 32 == 0, "K must be a multiple of 32, got ", call.K);
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], types[i], call.K);
    call.parts.push_back({weights[i].data_ptr<uint8_t>(), types[i], weights[i].size(0), call.N});
    call.N += weights[i].size(0) * 16;
    call.total_groups += weights[i].size(0);
    call.mins = call.mins || packed_type(types[i]).mins;
  }
  return call;
}

// The bf16 kernel's inputs: x as pairs of bf16, and per row the float32 sum of x over each 32-wide block, in one
// fixed order (the mins' term).
class Bf16Inputs {
 public:
  explicit Bf16Inputs(const Call& call)
      : call_(call), half_k_(call.K / 2), blocks_(call.K / 32), xsum_(call.mins ? call.M * blocks_ : 1, 0.0f) {
    if (!call.mins) return;
    const auto* xb = call.x.data_ptr<c10::BFloat16>();
    for (int64_t m = 0; m < call.M; ++m)
      for (int64_t b = 0; b < blocks_; ++b) {
        float s = 0.0f;
        for (int k = 0; k < 32; ++k) s += static_cast<float>(xb[m * call.K + b * 32 + k]);
        xsum_[m * blocks_ + b] = s;
      }
  }

  // Groups [begin, end) of all parts into y: output column c of row m at y[m * ldy + c - first].
  template <class Y>
  void run_groups(int64_t begin, int64_t end, Y* y, int64_t ldy, int64_t first) const {
    const auto* xp = reinterpret_cast<const int32_t*>(call_.x.data_ptr<c10::BFloat16>());
    for_parts(call_.parts, begin, end, [&](const Part& part, int64_t lo, int64_t hi) {
      dispatch(part.type, [&](auto q) {
        groups<decltype(q)>(xp, call_.M, half_k_, xsum_.data(), blocks_, part.w, lo, hi,
                            y + part.column + lo * 16 - first, ldy);
      });
    });
  }

 private:
  const Call& call_;
  int64_t half_k_, blocks_;
  std::vector<float> xsum_;
};

}  // namespace

// y = x [W_0; W_1; ...]^T: the outputs of several quantized weights (each its own type) side by side, as a fused
// q|k|v or gate|up projection whose parts GGUF stores in different types. x: [M, K] bf16 or float32; weights[i]: packed
// [N_i/16, K/SB_i, chunk_i] uint8 of GGML type types[i]. Returns [M, sum N_i] bf16, or float32 if float_output
// (logits: rounded to bf16, near-ties of the largest logits become ties). kernel_name: the model's quantized kernel,
// "" for none (kernel_for says which runs).
at::Tensor linear_quant(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                           const std::vector<int64_t>& types, bool float_output, const std::string& kernel_name) {
  const Call call = checked_call(x_in, weights, types, kernel_name);
  if (call.kernel != kBf16)
    return linear_quant_vnni(call.x, weights, types, call.digits(), call.fine(), float_output);
  auto y = at::empty({call.M, call.N}, call.x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  if (call.M == 0) return y;
  const Bf16Inputs inputs(call);
  // Threads split the groups of all parts (4 at a time: one few-row tile); a range may span parts.
  auto run = [&](auto* yp) {
    at::parallel_for(0, call.total_groups, 4, [&](int64_t begin, int64_t end) {
      inputs.run_groups(begin, end, yp, call.N, 0);
    });
  };
  if (float_output) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

// Each row's first index of its maximum over columns [0, valid_columns) of linear_quant(x, weights, types, true,
// kernel_name) (bitwise those logits: each computed by the same kernel, a small block of columns at a time into a
// scratch that stays in cache, so the [M, N] logits are never written to memory), and whether some row holds a NaN
// there (then the indices mean nothing: use linear_quant and torch). valid_columns: the real outputs (the last
// group's padding excluded).
std::tuple<at::Tensor, bool> linear_quant_argmax(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                                                 const std::vector<int64_t>& types, const std::string& kernel_name,
                                                 int64_t valid_columns) {
  const Call call = checked_call(x_in, weights, types, kernel_name);
  if (call.kernel != kBf16)
    return linear_quant_vnni_argmax(call.x, weights, types, call.digits(), call.fine(), valid_columns);
  const Bf16Inputs inputs(call);
  return argmax_by_blocks(call.M, call.total_groups, valid_columns, [&](int64_t g0, int64_t g1, float* y, int64_t ldy) {
    inputs.run_groups(g0, g1, y, ldy, g0 * 16);
  });
}

// Rows `rows` of a packed weight as float32 [len(rows), K] (the embedding lookup; the tests' view of the layout).
at::Tensor dequantize_rows(const at::Tensor& w, int64_t type, const at::Tensor& rows, int64_t K) {
  return dequantize_packed_rows(w, type, rows, K);
}
