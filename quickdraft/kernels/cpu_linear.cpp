// Weight-streaming linear layers for decoding on x86 CPUs with AVX512-BF16: y = x W^T for the few rows
// (tokens) of a decoding or verification step.
//
// Why: at one to a few rows a linear layer only streams its weights once; oneDNN's bf16 path reaches
// about half of this machine's read bandwidth there. And every output y[m, n] is computed by the same
// instruction sequence (bf16 pairs accumulated in float32 over K in a fixed order), whatever the number
// of rows and however rows and outputs are split between threads and tiles: the logits of a token are
// bitwise the same when it is verified alone or among K+1 tokens.
//
// Weights: bf16, or int8 with a float32 scale per output (the int8 values are exact in bf16, so the same
// dot product runs on them and the scale multiplies the float32 sum); both packed by
// quickdraft.kernels.pack into [N/16, K/2, 16, 2].

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

inline __m512bh load_bf16(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh widen_int8(__m256i bytes) {
  __m512i words = _mm512_cvtepi8_epi16(bytes);
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi: the order of the bytes
}

inline __m512bh load_weight(const c10::BFloat16* p) { return load_bf16(p); }
inline __m512bh load_weight(const int8_t* p) {
  return widen_int8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The weights are packed so that one 64-byte load holds, for 16 consecutive outputs n, the pair of
// weights W[n, 2p], W[n, 2p+1] ("VNNI" layout, [N/16, K/2, 16, 2]); the rows of x are broadcast a pair at a
// time. Each output lane accumulates its own dot product over p = 0 .. K/2-1 in order: no horizontal sums.
// A tile is MR rows of x by NB blocks of 16 outputs, its accumulators in registers.
template <int MR, int NB, typename W>
inline void tile(const c10::BFloat16* x, int64_t M_stride, const W* w, int64_t half_k, const float* scales,
                 c10::BFloat16* y, int64_t ldy, int64_t block) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t block_stride = half_k * 32;  // elements per 16-output block
  const W* wp = w + block * block_stride;
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // a pair of bf16 as one 32-bit word
  const int64_t x_stride = M_stride / 2;
  for (int64_t p = 0; p < half_k; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_weight(wp + j * block_stride + p * 32);
    for (int m = 0; m < MR; ++m) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * x_stride + p]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = (block + j) * 16;
    __m512 scale = scales ? _mm512_loadu_ps(scales + n) : _mm512_set1_ps(1.0f);
    for (int m = 0; m < MR; ++m) {
      __m512 v = scales ? _mm512_mul_ps(acc[m][j], scale) : acc[m][j];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int MR, typename W>
void blocks(const c10::BFloat16* x, int64_t ldx, const W* w, int64_t half_k, const float* s,
            c10::BFloat16* y, int64_t ldy, int64_t begin, int64_t end) {
  constexpr int NB = 4;
  int64_t b = begin;
  for (; b + NB <= end; b += NB) tile<MR, NB>(x, ldx, w, half_k, s, y, ldy, b);
  switch (end - b) {
    case 3: return tile<MR, 3>(x, ldx, w, half_k, s, y, ldy, b);
    case 2: return tile<MR, 2>(x, ldx, w, half_k, s, y, ldy, b);
    case 1: return tile<MR, 1>(x, ldx, w, half_k, s, y, ldy, b);
    default: return;
  }
}

constexpr int64_t kRowsPerTile = 6;
constexpr int64_t kInt8AmxRows = 32;  // from this many rows, int8 weights are widened once and multiplied on AMX

template <typename W>
void row_block(int64_t mr, const c10::BFloat16* x, int64_t ldx, const W* w, int64_t half_k, const float* s,
               c10::BFloat16* y, int64_t ldy, int64_t b, int64_t e) {
  switch (mr) {
    case 1: return blocks<1>(x, ldx, w, half_k, s, y, ldy, b, e);
    case 2: return blocks<2>(x, ldx, w, half_k, s, y, ldy, b, e);
    case 3: return blocks<3>(x, ldx, w, half_k, s, y, ldy, b, e);
    case 4: return blocks<4>(x, ldx, w, half_k, s, y, ldy, b, e);
    case 5: return blocks<5>(x, ldx, w, half_k, s, y, ldy, b, e);
    default: return blocks<6>(x, ldx, w, half_k, s, y, ldy, b, e);
  }
}

template <typename W>
at::Tensor run(const at::Tensor& x, const W* w, int64_t N, const float* scales) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Threads split the 16-output blocks; each walks its blocks 64 outputs at a time, for every 6 rows of x
  // (the weights of a 64-output strip stay in L2 between row groups).
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t strip = begin; strip < end; strip += 4) {
      const int64_t strip_end = std::min(end, strip + 4);
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile) {
        row_block(std::min(kRowsPerTile, M - m0), xp + m0 * K, K, w, K / 2, scales, yp + m0 * N, N, strip,
                  strip_end);
      }
    }
  });
  return y;
}

// --- AMX (bf16 tiles), used when the CPU has it and K is a multiple of 32 ---------------------------------
// The same packed weights are exactly AMX's B-tile layout: for a 16-output block, 16 consecutive pairs of
// K are 16 rows of 64 bytes. A tile holds up to 16 rows of x by 32 of K; C[m][n] accumulates one 32-wide
// chunk of K per instruction, chunks in order, so every row is computed alike whatever M is.

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles only in a build with QUICKDRAFT_AMX (quickdraft/kernels/__init__.py defines it on CPUs with AMX); the
// one tile function below is small and compiled either way.
#ifndef QUICKDRAFT_AMX
#define QUICKDRAFT_AMX 0
#endif

bool amx_permitted() {
  if (!QUICKDRAFT_AMX) return false;
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

__attribute__((target("amx-tile,amx-bf16")))
void amx_rows(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, c10::BFloat16* y,
              int64_t N, int64_t begin, int64_t end, const float* scales) {
  const int64_t block_stride = K * 16;  // elements per 16-output block: K/2 pairs x 16 outputs x 2
  alignas(64) float out[16 * 64];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
    TileConfig config;
    for (int t = 0; t < 4; ++t) { config.rows[t] = rows; config.colsb[t] = 64; }  // C: rows x 16 floats
    config.rows[4] = rows; config.colsb[4] = 64;                                    // A: rows x 32 bf16
    config.rows[5] = 16; config.colsb[5] = 64;                                      // B: 16 pairs x 16 outputs
    _tile_loadconfig(&config);
    for (int64_t b = begin; b < end; b += 4) {
      const int nb = static_cast<int>(std::min<int64_t>(4, end - b));
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, x + m0 * K + k, K * 2);
        const c10::BFloat16* wk = w + b * block_stride + (k / 2) * 32;
        _tile_loadd(5, wk, 64); _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) { _tile_loadd(5, wk + block_stride, 64); _tile_dpbf16ps(1, 4, 5); }
        if (nb > 2) { _tile_loadd(5, wk + 2 * block_stride, 64); _tile_dpbf16ps(2, 4, 5); }
        if (nb > 3) { _tile_loadd(5, wk + 3 * block_stride, 64); _tile_dpbf16ps(3, 4, 5); }
      }
      _tile_stored(0, out, 256);
      if (nb > 1) _tile_stored(1, out + 16, 256);
      if (nb > 2) _tile_stored(2, out + 32, 256);
      if (nb > 3) _tile_stored(3, out + 48, 256);
      for (int m = 0; m < rows; ++m)
        for (int j = 0; j < nb; ++j) {
          __m512 v = _mm512_load_ps(out + m * 64 + j * 16);
          if (scales) v = _mm512_mul_ps(v, _mm512_loadu_ps(scales + (b + j) * 16));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + (b + j) * 16),
                              (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  }
  _tile_release();
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous 2-d bf16 CPU tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, "K must be even");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.device().is_cpu() && w.size(1) * 2 == x.size(1) &&
              w.size(2) == 16 && w.size(3) == 2,
              "w must be packed [N/16, K/2, 16, 2] (see quickdraft.kernels.pack) with K matching x [M, K]");
}

// y = (x w^T) * scales (scales may be null) on AMX tiles, w bf16 packed; the caller checked K % 32 == 0 and
// amx_permitted().
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, const float* scales) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * 16;
  auto y = at::empty({M, N}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) { amx_rows(xp, M, K, wp, yp, N, begin, end, scales); });
  return y;
}

}  // namespace

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, bool use_amx) {
  check(x, w);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w must be bf16");
  if (use_amx && x.size(1) % 32 == 0 && amx_permitted()) return amx_linear(x, w, nullptr);
  return run(x, w.data_ptr<c10::BFloat16>(), w.size(0) * 16, nullptr);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check(x, w);
  TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0) * 16,
              "scales must be float32 [N]");
  if (x.size(0) >= kInt8AmxRows && x.size(1) % 32 == 0 && amx_permitted()) {
    // Many rows (a draft's prefill): widening int8 for every group of rows is compute-bound; widen the weight
    // once per call (int8 is exact in bf16) and multiply on AMX tiles, the scales applied to the float32
    // sums. Rows here are not bitwise those of the few-row path: int8 weights serve drafts, whose numerics
    // do not decide the output.
    return amx_linear(x, w.to(at::kBFloat16), scales.data_ptr<float>());
  }
  return run(x, w.data_ptr<int8_t>(), w.size(0) * 16, scales.data_ptr<float>());
}

bool amx_available() { return amx_permitted(); }
