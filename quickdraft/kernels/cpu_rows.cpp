// Reductions over the rows of logits [R, V] (float32, V up to the Qwen pair's 151,936 tokens): each row's argmax,
// and its top k with the row's logsumexp, in one or two vectorized passes a row.
//
// Why: torch's CPU argmax, topk and logsumexp over one 151,936-token row took 0.09, 0.19 and 0.15 ms here (AMD
// EPYC Zen 5, torch 2.13; amax alone 0.012 ms), and a 12-node tree's step runs them over 13-17 rows several
// times: ~6.5 ms of its step at T = 0 (benchmarks/RESULTS.md, session 31).
//
// Exactly torch's results where they are defined alike: argmax is the first index of the row's maximum; top k
// are the k largest values, most first, equal values in index order (torch leaves their order unspecified), and
// a row with fewer than k values above -inf completes its k with -inf entries of the lowest indices not taken.
// A row holding a NaN (or +inf, for logsumexp) is reported and the caller falls back to torch for the call.

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_quant.h"  // argmax_by_blocks

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The row's maximum (NaN-free rows; has_nan set otherwise).
float row_max(const float* x, int64_t n, bool& has_nan) {
  __m512 best = _mm512_set1_ps(kNegInf);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  float m = _mm512_reduce_max_ps(best);
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = 1;
    m = std::max(m, x[i]);
  }
  has_nan = nan != 0;
  return m;
}

int64_t first_equal(const float* x, int64_t n, float value) {
  const __m512 target = _mm512_set1_ps(value);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == value) return i;
  return 0;  // not reached for a value taken from the row
}

// exp(x) for x <= 0 (x - max of a row), relative error ~2e-7; -inf and x < -104 give 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p 2^n, 0 where it underflows
}

// log(sum(exp(x - m))) + m for a row whose maximum m is finite.
float row_logsumexp(const float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) sum = _mm512_add_ps(sum, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  if (i < n) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), rest, x + i);
    sum = _mm512_add_ps(sum, exp_nonpositive(_mm512_sub_ps(v, mv)));
  }
  return m + std::log(_mm512_reduce_add_ps(sum));
}

// The row's k largest (k <= n), most first, ties in index order: the buffer starts as the first k elements
// sorted, and a later element enters only when strictly above the buffer's last (16 lanes compared at once).
void row_top_k(const float* x, int64_t n, int64_t k, float* values, int64_t* indices) {
  for (int64_t j = 0; j < k; ++j) {  // insertion sort of the first k, stable
    int64_t at = j;
    while (at > 0 && values[at - 1] < x[j]) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = x[j];
    indices[at] = j;
  }
  auto insert = [&](int64_t i) {
    const float v = x[i];
    if (!(v > values[k - 1])) return;
    int64_t at = k - 1;
    while (at > 0 && values[at - 1] < v) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
      --at;
    }
    values[at] = v;
    indices[at] = i;
  };
  int64_t i = k;
  for (; i + 16 <= n; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(values[k - 1]), _CMP_GT_OQ);
    while (above) {  // in index order; the threshold rises as they enter
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      insert(i + lane);
    }
  }
  for (; i < n; ++i) insert(i);
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              ": float32 CPU rows [R, V], contiguous");
  TORCH_CHECK(x.size(1) > 0, what, ": rows of at least one value");
}

}  // namespace

// [R, V] -> ([R] int64 first index of each row's maximum, whether some row holds a NaN: then use torch).
std::tuple<at::Tensor, bool> rows_argmax(at::Tensor x) {
  check_rows(x, "rows_argmax");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, at::kLong);
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  std::vector<char> nan(rows, 0);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      bool has_nan = false;
      const float m = row_max(data + r * n, n, has_nan);
      nan[r] = has_nan;
      index[r] = has_nan ? 0 : first_equal(data + r * n, n, m);
    }
  });
  bool any_nan = false;
  for (char c : nan) any_nan |= c != 0;
  return {out, any_nan};
}

// quickdraft's quantized output layers give each row's argmax without writing their logits (cpu_quant.cpp's
// linear_quant_argmax): at 64 rows SmolLM2's [64, 49,152] float32 logits are 12.6 MB, and the head streams ~16 MB of
// weights past them, so an argmax after it read them back from memory (0.35 ms of the step, 0.10 with them in
// cache). Here each thread computes a block of columns at a time into a scratch of kScratchBytes, which stays in L2
// while the weights stream past, and keeps per row the largest value and its first index; a block replaces the
// row's best only when strictly above it, and the threads' ranges merge the same way in column order, so the index
// is the first of the row's maximum: rows_argmax's over the whole row. Measured on SmolLM2's head (576 -> 49,152,
// Q8_0, int16 digits; one thread on a 2-core AMD EPYC shared with another job; medians of 200 interleaved calls),
// the logits and rows_argmax -> this: 16 rows 6.10 -> 5.38 ms, 64 rows 23.3 -> 20.1 ms (the logits' writes saved
// too); a scratch of 32 KB to 2 MB made no difference above the noise.
constexpr int64_t kScratchBytes = 128 * 1024;

std::tuple<at::Tensor, bool> argmax_by_blocks(int64_t M, int64_t total_groups, int64_t valid_columns,
                                              const GroupsToFloat& compute) {
  TORCH_CHECK(valid_columns >= 1 && valid_columns <= 16 * total_groups, "valid_columns must be in 1..",
              16 * total_groups, " (the outputs, padded to groups of 16), got ", valid_columns);
  at::Tensor out = at::zeros({M}, at::kLong);
  if (M == 0) return {out, false};
  const int64_t groups = (valid_columns + 15) / 16;  // the groups past these hold only padding: not computed
  // Groups a block: a multiple of 4 (the few-row kernels' tile), 4 to 64 (so that 2 threads' ranges of blocks
  // stay even for few rows).
  const int64_t block = std::clamp<int64_t>(kScratchBytes / (M * 16 * 4), 4, 64) / 4 * 4;
  const int64_t blocks = (groups + block - 1) / block;
  // A thread's range of blocks [b0, b1) keeps its rows' best values and their first indices at b0.
  std::vector<float> best(blocks * M);
  std::vector<int64_t> where(blocks * M);
  std::vector<char> range_at(blocks, 0), nan(blocks, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(M * block * 16);
    float* range_best = best.data() + b0 * M;
    int64_t* range_where = where.data() + b0 * M;
    bool any_nan = false;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t g0 = b * block, g1 = std::min(groups, g0 + block), column = g0 * 16;
      const int64_t width = (g1 - g0) * 16, valid = std::min(width, valid_columns - column);
      compute(g0, g1, scratch.data(), width);
      for (int64_t m = 0; m < M; ++m) {
        const float* row = scratch.data() + m * width;
        bool has_nan = false;
        const float value = row_max(row, valid, has_nan);
        any_nan |= has_nan;
        if (b == b0 || value > range_best[m])
          range_best[m] = value, range_where[m] = column + first_equal(row, valid, value);
      }
    }
    range_at[b0] = 1;
    nan[b0] = any_nan;
  });
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b) {
    if (!range_at[b]) continue;
    if (nan[b]) return {out, true};
    for (int64_t m = 0; m < M; ++m)
      if (b == 0 || best[b * M + m] > best[m]) best[m] = best[b * M + m], index[m] = where[b * M + m];
  }
  return {out, false};
}

// [R, V], k in 1..V -> (values [R, k] float32, indices [R, k] int64, logsumexp [R] float32 (empty unless asked),
// whether every row was computed: no NaN, and for logsumexp no +inf; else use torch).
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> rows_top_k(at::Tensor x, int64_t k,
                                                                         bool with_logsumexp) {
  check_rows(x, "rows_top_k");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "rows_top_k: k must be in 1..", n, ", got ", k);
  at::Tensor values = at::empty({rows, k}, at::kFloat);
  at::Tensor indices = at::empty({rows, k}, at::kLong);
  at::Tensor lse = at::empty({with_logsumexp ? rows : 0}, at::kFloat);
  const float* data = x.data_ptr<float>();
  std::vector<char> failed(rows, 0);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = data + r * n;
      bool has_nan = false;
      const float m = row_max(row, n, has_nan);
      if (has_nan || (with_logsumexp && m == std::numeric_limits<float>::infinity())) {
        failed[r] = 1;
        continue;
      }
      row_top_k(row, n, k, values.data_ptr<float>() + r * k, indices.data_ptr<int64_t>() + r * k);
      if (with_logsumexp) lse.data_ptr<float>()[r] = m == kNegInf ? kNegInf : row_logsumexp(row, n, m);
    }
  });
  bool ok = true;
  for (char c : failed) ok &= c == 0;
  return {values, indices, lse, ok};
}
