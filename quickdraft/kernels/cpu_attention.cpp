// Decoding-step attention, RMSNorm, rotary embedding and gated activation for x86 CPUs with AVX512-BF16,
// bf16 in and out, float32 inside (a GGUF model's float32 stream: float16 keys, float32 q/k/v in and attention out).
//
// Why: a decoding step attends a handful of queries to the cache; torch's batched matmuls cost tens of
// microseconds each in setup there, twice per layer. Here each token's queries are computed on their own,
// over exactly the keys they may see (causal, and a sliding window where the layer has one), in a fixed
// order: the result does not depend on how many tokens share the call, so verification of K+1 tokens gives
// the same numbers as K+1 single-token steps. Scores and probabilities stay in float32.
//
// The key cache of a head is packed like a weight of quickdraft.kernels.pack ([cap/16, d/2, 16, 2]: for 16
// consecutive positions, the pairs of each pair of dimensions): the scores of 16 keys are then 16 lanes of
// one register, accumulated pair by pair with the BF16 dot-product instruction, without horizontal sums.

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> 16 float32 (exact)
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16_from_pbh(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

// exp of 16 floats (Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial; ~1 ulp).
// Every lane is computed alike whatever its neighbours hold.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.972084045410f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// Scores of MR query rows (bf16, row stride ldq) against key blocks [b0, b1) of one head's packed keys,
// times scale, into s[m * lds + 16 * (b - b0) + lane].
template <int MR, int NB>
inline void score_tile(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* keys, int64_t half_d, int64_t b,
                       float scale, float* s, int64_t lds, int64_t b0) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int32_t* qp = reinterpret_cast<const int32_t*>(q);
  const c10::BFloat16* kp = keys + b * half_d * 32;
  for (int64_t p = 0; p < half_d; ++p) {
    __m512bh kv[NB];
    for (int j = 0; j < NB; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kp + j * half_d * 32 + p * 32);
    for (int m = 0; m < MR; ++m) {
      __m512bh qv = (__m512bh)_mm512_set1_epi32(qp[m * (ldq / 2) + p]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], qv, kv[j]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(s + m * lds + 16 * (b + j - b0), _mm512_mul_ps(acc[m][j], sc));
}

template <int MR>
void score_rows(const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* keys, int64_t half_d, int64_t b0,
                int64_t b1, float scale, float* s, int64_t lds) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4) score_tile<MR, 4>(q, ldq, keys, half_d, b, scale, s, lds, b0);
  switch (b1 - b) {
    case 3: return score_tile<MR, 3>(q, ldq, keys, half_d, b, scale, s, lds, b0);
    case 2: return score_tile<MR, 2>(q, ldq, keys, half_d, b, scale, s, lds, b0);
    case 1: return score_tile<MR, 1>(q, ldq, keys, half_d, b, scale, s, lds, b0);
    default: return;
  }
}

void scores(int64_t mr, const c10::BFloat16* q, int64_t ldq, const c10::BFloat16* keys, int64_t half_d, int64_t b0,
            int64_t b1, float scale, float* s, int64_t lds) {
  switch (mr) {
    case 1: return score_rows<1>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    case 2: return score_rows<2>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    case 3: return score_rows<3>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    default: return score_rows<4>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
  }
}

// The same scores from float32 queries and float16 keys (a GGUF model's float32 stream: llama.cpp's f16 key
// cache, and queries unrounded). The packed layout is the bf16 one: a 64-byte step holds dimensions 2p, 2p + 1 of
// 16 positions, which widen to two registers of 8 positions x 2 dimensions each; a row's accumulators take one
// multiply-add a step each, and the two dimensions' lanes are added once at the end (per position: the sum over
// even dimensions plus the sum over odd ones, in the same order for every row and call).
template <int MR, int NB>
inline void score_tile_f16(const float* q, int64_t ldq, const c10::Half* keys, int64_t half_d, int64_t b,
                           float scale, float* s, int64_t lds, int64_t b0) {
  __m512 lo[MR][NB], hi[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) lo[m][j] = hi[m][j] = _mm512_setzero_ps();
  const c10::Half* kp = keys + b * half_d * 32;
  for (int64_t p = 0; p < half_d; ++p) {
    __m512 klo[NB], khi[NB];
    for (int j = 0; j < NB; ++j) {
      const __m512i raw = _mm512_loadu_si512(kp + j * half_d * 32 + p * 32);
      klo[j] = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
      khi[j] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
    }
    for (int m = 0; m < MR; ++m) {
      double pair;  // q[2p], q[2p + 1] in every 64-bit lane
      std::memcpy(&pair, q + m * ldq + 2 * p, sizeof(pair));
      const __m512 qv = _mm512_castpd_ps(_mm512_set1_pd(pair));
      for (int j = 0; j < NB; ++j) {
        lo[m][j] = _mm512_fmadd_ps(klo[j], qv, lo[m][j]);
        hi[m][j] = _mm512_fmadd_ps(khi[j], qv, hi[m][j]);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) {
      const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(lo[m][j], even, hi[m][j]),
                                       _mm512_permutex2var_ps(lo[m][j], odd, hi[m][j]));
      _mm512_storeu_ps(s + m * lds + 16 * (b + j - b0), _mm512_mul_ps(sum, sc));
    }
}

template <int MR>
void score_rows_f16(const float* q, int64_t ldq, const c10::Half* keys, int64_t half_d, int64_t b0, int64_t b1,
                    float scale, float* s, int64_t lds) {
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) score_tile_f16<MR, 2>(q, ldq, keys, half_d, b, scale, s, lds, b0);
  if (b < b1) score_tile_f16<MR, 1>(q, ldq, keys, half_d, b, scale, s, lds, b0);
}

void scores(int64_t mr, const float* q, int64_t ldq, const c10::Half* keys, int64_t half_d, int64_t b0, int64_t b1,
            float scale, float* s, int64_t lds) {
  switch (mr) {
    case 1: return score_rows_f16<1>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    case 2: return score_rows_f16<2>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    case 3: return score_rows_f16<3>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
    default: return score_rows_f16<4>(q, ldq, keys, half_d, b0, b1, scale, s, lds);
  }
}

// out[m, c0 .. c0 + 16 NC) = sum over keys j in [lo, hi] of p[m][j] v[j] (p already divided by its total), for
// MR rows that see the same keys.
// A token tree's row sees its keys j < base at slot j and j >= base at slot path[j - base] (its ancestors and
// itself, by position): the same sum over the same values in the same order as the path's tokens in a line.
template <int MR, int NC, typename Out>
inline void weighted_values(const float* p, int64_t ldp, const c10::BFloat16* v, int64_t d, int64_t lo, int64_t hi,
                            int64_t c0, Out* out, int64_t ldo, int64_t base, const int64_t* path) {
  __m512 acc[MR][NC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t j = lo; j <= hi; ++j) {
    const int64_t slot = j < base ? j : path[j - base];
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(v + slot * d + c0 + 16 * c);
    for (int m = 0; m < MR; ++m) {
      const __m512 w = _mm512_set1_ps(p[m * ldp + j]);
      for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_fmadd_ps(w, vv[c], acc[m][c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) {
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(out + m * ldo + c0 + 16 * c, acc[m][c]);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + c0 + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(acc[m][c]));
    }
}

template <int MR, typename Out>
void weighted_values_rows(const float* p, int64_t ldp, const c10::BFloat16* v, int64_t d, int64_t lo, int64_t hi,
                          Out* out, int64_t ldo, int64_t base, const int64_t* path) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64) weighted_values<MR, 4>(p, ldp, v, d, lo, hi, c0, out, ldo, base, path);
  switch ((d - c0) / 16) {
    case 3: return weighted_values<MR, 3>(p, ldp, v, d, lo, hi, c0, out, ldo, base, path);
    case 2: return weighted_values<MR, 2>(p, ldp, v, d, lo, hi, c0, out, ldo, base, path);
    case 1: return weighted_values<MR, 1>(p, ldp, v, d, lo, hi, c0, out, ldo, base, path);
    default: return;
  }
}

// out: bf16, or float32 where the attention output feeds a float32 stream's projection.
template <typename Out>
void weighted(int64_t mr, const float* p, int64_t ldp, const c10::BFloat16* v, int64_t d, int64_t lo, int64_t hi,
              Out* out, int64_t ldo, int64_t base, const int64_t* path) {
  switch (mr) {
    case 1: return weighted_values_rows<1>(p, ldp, v, d, lo, hi, out, ldo, base, path);
    case 2: return weighted_values_rows<2>(p, ldp, v, d, lo, hi, out, ldo, base, path);
    case 3: return weighted_values_rows<3>(p, ldp, v, d, lo, hi, out, ldo, base, path);
    default: return weighted_values_rows<4>(p, ldp, v, d, lo, hi, out, ldo, base, path);
  }
}

// A run of consecutive rows of a call that belong to one sequence: `rows` tokens from row `offset`, at
// positions start.., over that sequence's caches of one layer (keys packed [Hkv, cap/16, d/2, 16, 2], values
// [Hkv, cap, d]); their rotary rows are rows rope_row.. of cos and sin.
//
// A segment whose rows form a token tree (models.base.TreeAttention) has tree_base > 0: its row r (slot
// start + r) sits at position position[r] and, from tree_base on, sees the slots path[path_at[r] ..
// path_at[r + 1]) (its ancestors in the tree and itself, by depth) after the prefix [0, tree_base).
struct Segment {
  void* keys;  // bf16, or float16 (wide: see `attention`)
  c10::BFloat16* values;
  int64_t cap, start, rows, offset, rope_row;
  int64_t tree_base = 0;
  const int64_t* position = nullptr;  // [rows]
  const int64_t* path_at = nullptr;  // [rows + 1]
  const int64_t* path = nullptr;

  int64_t position_of(int64_t r) const { return position ? position[r] : start + r; }
  bool in_tree(int64_t r) const { return position && start + r >= tree_base; }
};

// The positions and paths of a tree segment's rows, kept alive beside the segments that point into them.
struct TreeRows {
  std::vector<int64_t> position, path_at, path;
};

// Fill `tree` for segment `seg` from the parent slot of every tree slot [base, start + rows) (parents [end -
// base], base - 1 for a child of the root), checked, and point the segment at it.
void tree_rows(const char* what, Segment& seg, int64_t base, const at::Tensor& parents, TreeRows& tree) {
  const int64_t end = seg.start + seg.rows;
  TORCH_CHECK(parents.scalar_type() == at::kLong && parents.is_contiguous() && parents.dim() == 1 &&
              parents.device().is_cpu(), what, ": tree parents must be a contiguous int64 CPU tensor");
  TORCH_CHECK(1 <= base && base <= end && parents.numel() == end - base, what, ": a tree from slot ", base,
              " to the call's end ", end, " needs ", end - base, " parents, got ", parents.numel());
  const int64_t* parent = parents.data_ptr<int64_t>();
  for (int64_t i = 0; i < end - base; ++i)
    TORCH_CHECK(parent[i] == base - 1 || (base <= parent[i] && parent[i] < base + i), what, ": tree slot ", base + i,
                " has parent ", parent[i], "; it must be ", base - 1, " or an earlier tree slot");
  tree.position.resize(seg.rows);
  tree.path_at.assign(1, 0);
  for (int64_t r = 0; r < seg.rows; ++r) {
    const int64_t slot = seg.start + r;
    const size_t first = tree.path.size();
    for (int64_t x = slot; x >= base; x = parent[x - base]) tree.path.push_back(x);
    std::reverse(tree.path.begin() + first, tree.path.end());  // root's child first
    tree.position[r] = slot < base ? slot : base + static_cast<int64_t>(tree.path.size() - first) - 1;
    tree.path_at.push_back(static_cast<int64_t>(tree.path.size()));
  }
  seg.tree_base = base;
  seg.position = tree.position.data();
  seg.path_at = tree.path_at.data();
  seg.path = tree.path.data();
}

// The segment of each row of a call of n rows (segments cover the rows in order).
std::vector<int64_t> segment_of_rows(const std::vector<Segment>& segments, int64_t n) {
  std::vector<int64_t> owner(n);
  for (size_t s = 0; s < segments.size(); ++s)
    for (int64_t r = 0; r < segments[s].rows; ++r) owner[segments[s].offset + r] = static_cast<int64_t>(s);
  return owner;
}

// The segments of a call over several sequences (see attention_segments), checked.
// tree_bases / tree_parents: empty (no trees), or one per sequence: 0 and an empty tensor for causal rows, or
// a tree's base slot and the parent slot of each of its slots (see tree_rows), whose rows go to `trees`.
std::vector<Segment> cache_segments(const char* what, const std::vector<at::Tensor>& keys,
                                    const std::vector<at::Tensor>& values, int64_t layer,
                                    const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t n,
                                    int64_t d, int64_t* h_kv, const std::vector<int64_t>& tree_bases,
                                    const std::vector<at::Tensor>& tree_parents, std::vector<TreeRows>& trees,
                                    bool* wide) {
  const size_t count = starts.size();
  TORCH_CHECK(keys.size() == count && values.size() == count && rows.size() == count && count > 0, what,
              ": one cache pair, start and row count per sequence");
  std::vector<Segment> segments;
  segments.reserve(count);
  int64_t offset = 0;
  for (size_t s = 0; s < count; ++s) {
    const at::Tensor& k = keys[s];
    const at::Tensor& v = values[s];
    if (s == 0) *wide = k.scalar_type() == at::kHalf;
    TORCH_CHECK(k.scalar_type() == (*wide ? at::kHalf : at::kBFloat16) && v.scalar_type() == at::kBFloat16 &&
                k.is_contiguous() && v.is_contiguous() && k.dim() == 6 && v.dim() == 4, what,
                ": contiguous caches, keys [layers, Hkv, cap/16, d/2, 16, 2] (bf16, or float16 for every sequence) "
                "and bf16 values [layers, Hkv, cap, d]");
    const int64_t cap = v.size(2);
    if (s == 0) *h_kv = v.size(1);
    TORCH_CHECK(0 <= layer && layer < v.size(0) && k.size(0) == v.size(0) && k.size(1) == *h_kv &&
                v.size(1) == *h_kv && k.size(2) * 16 == cap && k.size(3) * 2 == d && v.size(3) == d, what,
                ": caches of sequence ", s, " do not fit the layer, heads or head_dim");
    TORCH_CHECK(starts[s] >= 0 && rows[s] >= 0 && starts[s] + rows[s] <= cap, what, ": sequence ", s,
                " writes or reads past its cache's capacity");
    const int64_t layer_size = *h_kv * cap * d;
    segments.push_back(Segment{static_cast<char*>(k.data_ptr()) + 2 * layer * layer_size,
                               v.data_ptr<c10::BFloat16>() + layer * layer_size, cap, starts[s], rows[s], offset,
                               starts[s]});
    offset += rows[s];
  }
  TORCH_CHECK(offset == n, what, ": the row counts add up to ", offset, ", not to the ", n, " rows given");
  TORCH_CHECK(tree_bases.size() == tree_parents.size() && (tree_bases.empty() || tree_bases.size() == count), what,
              ": tree bases and parents for every sequence, or for none");
  trees.resize(tree_bases.size());  // sized once: the segments point into its vectors
  for (size_t s = 0; s < tree_bases.size(); ++s)
    if (tree_bases[s] > 0) tree_rows(what, segments[s], tree_bases[s], tree_parents[s], trees[s]);
  return segments;
}

// One token's queries of one kv head (q_row + h d for the group's heads h) at position pos, over the keys j
// in (pos - window, pos] (window 0: all) of that head; the result goes to out_row + h d. The only code path
// of attention, whatever the call: a token's result depends on nothing else in it.
//
// A token tree's row (path non-null: its tree slots by depth, the last its own) sees the slots j < base, then
// path[t] at position base + t: its scores are computed at their slots and moved to their positions, so the
// softmax and the weighted sum run over the same numbers in the same lanes and order as for the path's tokens
// in a line (a key's score does not depend on its lane).
// Q, K, Out: bf16, bf16, bf16 (a bf16 model), or float, float16, float (a float32 stream; see `attention`).
template <typename Q, typename K, typename Out>
void attend(const Q* q_row, int64_t group, int64_t kv, const K* keys,
            const c10::BFloat16* values, int64_t cap, int64_t d, int64_t pos, int64_t window, float s,
            Out* out_row, std::vector<float>& buffer, int64_t base = 0, const int64_t* path = nullptr) {
  const int64_t half_d = d / 2;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t depth = path ? pos - base + 1 : 0;  // path length
  // Blocks of keys scored: up to the position's block (a line), or to the row's own slot's (a tree).
  const int64_t b0 = lo / 16, b1 = (path ? std::max(pos, path[depth - 1]) : pos) / 16 + 1, width = (b1 - b0) * 16;
  const K* kbase = keys + kv * cap * d;
  const c10::BFloat16* vbase = values + kv * cap * d;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t rows = std::min<int64_t>(4, group - g0);
    const int64_t h0 = kv * group + g0;
    buffer.resize(rows * width);
    float* sc = buffer.data();
    scores(rows, q_row + h0 * d, d, kbase, half_d, b0, b1, s, sc, width);
    if (path) {  // slot path[t] -> position base + t; path[t] >= base + t, so ascending t reads before it writes
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t t = std::max<int64_t>(0, lo - base); t < depth; ++t)
          sc[m * width + base + t - b0 * 16] = sc[m * width + path[t] - b0 * 16];
    }
    // Softmax over [lo, pos] of each row: 16 lanes at a time from lo, in the same order for any n.
    const int64_t first = lo - b0 * 16, count = pos - lo + 1;
    for (int64_t m = 0; m < rows; ++m) {
      float* row = sc + m * width + first;
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < count; j += 16)
        top = _mm512_mask_max_ps(top, tail_mask(count - j), top, _mm512_loadu_ps(row + j));
      const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 mask = tail_mask(count - j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), peak));
        total = _mm512_mask_add_ps(total, mask, total, e);
        _mm512_mask_storeu_ps(row + j, mask, e);
      }
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
      for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 mask = tail_mask(count - j);
        _mm512_mask_storeu_ps(row + j, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + j), inv));
      }
    }
    // Probabilities are indexed from b0 * 16; the keys they weight are [lo, pos].
    weighted(rows, sc - b0 * 16, width, vbase, d, lo, pos, out_row + h0 * d, d, path ? base : pos + 1, path);
  }
}

// The attention of every row of q [n, >=Hq, d] (d contiguous, head stride d) in its segment, [n, Hq d] out.
template <typename Q, typename K>
at::Tensor attention_rows(const at::Tensor& q, int64_t num_q_heads, int64_t h_kv,
                             const std::vector<Segment>& segments, int64_t window, double scale) {
  const int64_t n = q.size(0), d = q.size(2), group = num_q_heads / h_kv, q_stride = q.stride(0);
  auto out = at::empty({n, num_q_heads * d}, q.options());  // Out = Q
  const std::vector<int64_t> owner = segment_of_rows(segments, n);
  const auto* qp = q.data_ptr<Q>();
  auto* op = out.data_ptr<Q>();
  const float s = static_cast<float>(scale);
  // A task is one token's queries of one kv head: they see the same keys, and their scores share each load.
  at::parallel_for(0, n * h_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / h_kv, kv = task % h_kv;
      const Segment& seg = segments[owner[i]];
      const int64_t r = i - seg.offset;
      const bool tree = seg.in_tree(r);
      attend(qp + i * q_stride, group, kv, static_cast<const K*>(seg.keys), seg.values, seg.cap, d,
             seg.position_of(r), window, s,
             op + i * num_q_heads * d, buffer, tree ? seg.tree_base : 0, tree ? seg.path + seg.path_at[r] : nullptr);
    }
  });
  return out;
}

// attention_rows on the caches' key type: bf16 q and out over bf16 keys, or float32 q and out over float16 keys.
at::Tensor attention_rows(const char* what, const at::Tensor& q, int64_t num_q_heads, int64_t h_kv,
                             const std::vector<Segment>& segments, int64_t window, double scale, bool wide) {
  TORCH_CHECK(q.scalar_type() == (wide ? at::kFloat : at::kBFloat16), what,
              wide ? ": float16 keys take float32 q" : ": bf16 keys take bf16 q");
  return wide ? attention_rows<float, c10::Half>(q, num_q_heads, h_kv, segments, window, scale)
              : attention_rows<c10::BFloat16, c10::BFloat16>(q, num_q_heads, h_kv, segments, window, scale);
}

}  // namespace

// q: [n, >=Hq, d] (row stride q_stride elements, head stride d); keys: [Hkv, cap/16, d/2, 16, 2] (packed, see
// above); values: [Hkv, cap, d]. Query i sits at position start + i and sees keys j in
// (start + i - window, start + i] (window 0: all).
// bf16 keys: bf16 q and bf16 out. float16 keys (a GGUF model's float32 residual stream, as llama.cpp keeps its f16
// key cache): float32 q and float32 out, which the output projection's integer kernel quantizes as it is; the
// values stay bf16. Why: with one int8 digit an activation, bf16 keys and outputs doubled the KL of Qwen 0.5B's
// logits (benchmarks/RESULTS.md, session 22).
at::Tensor attention(const at::Tensor& q, int64_t num_q_heads, const at::Tensor& keys,
                        const at::Tensor& values, int64_t start, int64_t window, double scale) {
  const bool wide = keys.scalar_type() == at::kHalf;
  TORCH_CHECK((wide || keys.scalar_type() == at::kBFloat16) && values.scalar_type() == at::kBFloat16,
              "attention: bf16 or float16 keys and bf16 values expected");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "attention: q must be [n, H, d] with d contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 5 && values.dim() == 3,
              "attention: contiguous packed keys [Hkv, cap/16, d/2, 16, 2] and values [Hkv, cap, d]");
  const int64_t n = q.size(0), d = q.size(2), h_kv = keys.size(0), cap = values.size(1);
  TORCH_CHECK(d % 16 == 0 && keys.size(2) * 2 == d && keys.size(1) * 16 == cap && values.size(2) == d,
              "attention: head_dim must be a multiple of 16, keys and values of the same capacity");
  TORCH_CHECK(num_q_heads % h_kv == 0 && start >= 0 && start + n <= cap, "attention: bad heads or positions");
  return attention_rows("attention", q, num_q_heads, h_kv,
                        {Segment{keys.data_ptr(), values.data_ptr<c10::BFloat16>(), cap, start, n, 0, 0}},
                        window, scale, wide);
}

// The attention of one layer for a call over several sequences: q [n, >=Hq, d] holds rows[s] queries of
// sequence s after those of sequences < s, at positions starts[s].., over keys[s] [layers, Hkv, cap/16, d/2,
// 16, 2] and values[s] [layers, Hkv, cap, d] at `layer`. Each row is computed exactly as `attention` computes
// it for its sequence alone (the same code per token), in one parallel loop over all rows. tree_bases and
// tree_parents (empty, or one per sequence; see cache_segments) make a sequence's rows a token tree.
at::Tensor attention_segments(const at::Tensor& q, int64_t num_q_heads, const std::vector<at::Tensor>& keys,
                                 const std::vector<at::Tensor>& values, int64_t layer,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t window,
                                 double scale, const std::vector<int64_t>& tree_bases,
                                 const std::vector<at::Tensor>& tree_parents) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "attention_segments: q must be [n, H, d] with d contiguous");
  const int64_t d = q.size(2);
  int64_t h_kv = 0;
  std::vector<TreeRows> trees;
  bool wide = false;
  const std::vector<Segment> segments = cache_segments("attention_segments", keys, values, layer, starts, rows,
                                                       q.size(0), d, &h_kv, tree_bases, tree_parents, trees, &wide);
  TORCH_CHECK(d % 16 == 0 && h_kv > 0 && num_q_heads % h_kv == 0, "attention_segments: bad heads or head_dim");
  return attention_rows("attention_segments", q, num_q_heads, h_kv, segments, window, scale, wide);
}

// RMSNorm of each row of x [rows, H] (contiguous; bf16, or float32 for a float32 residual stream). weight: [R, H]
// (row r of x uses weight row r % R). llama_style: round the normalised row to bf16 before multiplying by a bf16
// weight (Llama); otherwise multiply by a float32 weight (Gemma, whose weight is stored as 1 + w). bf16 out, rounded
// so; or float32 out if float_output, with no bf16 rounding anywhere (llama.cpp's way: a Gemma post-norm joining a
// float32 stream, or a norm feeding a GGUF layer's integer kernel).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool llama_style,
                       bool float_output) {
  const bool x_float = x.scalar_type() == at::kFloat;
  TORCH_CHECK((x_float || x.scalar_type() == at::kBFloat16) && x.is_contiguous(), "rms_norm: contiguous bf16 or float32 x");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && weight.is_contiguous() && weight.size(-1) == H, "rms_norm: bad shapes");
  TORCH_CHECK(weight.scalar_type() == (llama_style ? at::kBFloat16 : at::kFloat), "rms_norm: weight dtype");
  const int64_t R = weight.numel() / H;
  auto y = at::empty(x.sizes(), x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  const void* xp = x.data_ptr();
  void* yp = y.data_ptr();
  const void* wp = weight.data_ptr();
  auto load = [&](int64_t offset) {
    return x_float ? _mm512_loadu_ps(static_cast<const float*>(xp) + offset)
                   : load16(static_cast<const c10::BFloat16*>(xp) + offset);
  };
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) { __m512 v = load(r * H + i); acc = _mm512_fmadd_ps(v, v, acc); }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / H + static_cast<float>(eps));
      const __m512 scale = _mm512_set1_ps(inv);
      const int64_t wr = (r % R) * H;
      for (int64_t i = 0; i < H; i += 16) {
        __m512 v = _mm512_mul_ps(load(r * H + i), scale);
        if (llama_style) {
          // bf16(bf16(v) * w): round, widen, multiply by the bf16 weight, round again (float32: v * w).
          __m512 rounded = float_output ? v : load16_from_pbh(_mm512_cvtneps_pbh(v));
          v = _mm512_mul_ps(rounded, load16(static_cast<const c10::BFloat16*>(wp) + wr + i));
        } else {
          v = _mm512_mul_ps(v, _mm512_loadu_ps(static_cast<const float*>(wp) + wr + i));
        }
        if (float_output)
          _mm512_storeu_ps(static_cast<float*>(yp) + r * H + i, v);
        else
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(yp) + r * H + i),
                              (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return y;
}

namespace {

// rope_and_cache of every row of qkv [n, (Hq + 2 Hkv) d] in its segment: row i of the call is token
// i - offset of its segment, at position start + i - offset, with rotary rows rope_row + i - offset.
// T: bf16 (qkv, cos, sin, q and keys bf16) or float (a float32 stream: qkv, cos, sin and q float32, keys
// float16, values rounded to bf16; no bf16 rounding after a per-head norm either).
template <typename T>
at::Tensor rope_rows(const at::Tensor& qkv, int64_t num_q_heads, int64_t h_kv, int64_t d,
                        const at::Tensor& qk_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        const std::vector<Segment>& segments) {
  constexpr bool wide = std::is_same_v<T, float>;
  using Key = std::conditional_t<wide, c10::Half, c10::BFloat16>;
  const int64_t n = qkv.size(0), heads = num_q_heads + h_kv, half = d / 2;
  const bool norm = qk_norm.defined() && qk_norm.numel() > 0;
  auto q = at::empty({n, num_q_heads, d}, qkv.options());
  const std::vector<int64_t> owner = segment_of_rows(segments, n);
  const auto* src = qkv.data_ptr<T>();
  const auto* cp = cos.data_ptr<T>();
  const auto* sp = sin.data_ptr<T>();
  const float* wp = norm ? qk_norm.data_ptr<float>() : nullptr;
  auto* qp = q.data_ptr<T>();
  at::parallel_for(0, n * (heads + h_kv), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d);
    std::vector<T> roped(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (heads + h_kv), h = task % (heads + h_kv);
      const Segment& seg = segments[owner[i]];
      const int64_t p = seg.start + i - seg.offset;  // the token's slot in the cache
      const int64_t rope = seg.position ? seg.position[i - seg.offset] : seg.rope_row + i - seg.offset;
      const int64_t cap = seg.cap;
      const T* row = src + i * (heads + h_kv) * d + h * d;
      if (h >= heads) {  // a value head: copied to the cache as is (rounded to bf16 from float32)
        c10::BFloat16* value = seg.values + ((h - heads) * cap + p) * d;
        if constexpr (wide)
          for (int64_t c = 0; c < d; ++c) value[c] = c10::BFloat16(row[c]);
        else
          std::memcpy(value, row, d * sizeof(c10::BFloat16));
        continue;
      }
      for (int64_t c = 0; c < d; ++c) x[c] = static_cast<float>(row[c]);
      if (norm) {
        float ss = 0.f;
        for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
        const float inv = 1.f / std::sqrt(ss / d + static_cast<float>(eps));
        // Rounded to bf16 after the weight, as the model's norm does before rope (a float32 stream: not).
        for (int64_t c = 0; c < d; ++c)
          x[c] = wide ? x[c] * inv * wp[h * d + c] : static_cast<float>(c10::BFloat16(x[c] * inv * wp[h * d + c]));
      }
      const T* cr = cp + rope * d;  // the rotary rows of its position
      const T* sr = sp + rope * d;
      T* dst = h < num_q_heads ? qp + (i * num_q_heads + h) * d : roped.data();
      for (int64_t c = 0; c < d; ++c) {
        const float rotated = x[c < half ? c + half : c - half];
        dst[c] = T(x[c] * static_cast<float>(cr[c]) + rotated * static_cast<float>(sr[c]));
      }
      if (h >= num_q_heads) {  // a key: element c of position p at ((p / 16) * d/2 + c / 2) * 32 + (p % 16) * 2 + c % 2
        Key* block = static_cast<Key*>(seg.keys) + (h - num_q_heads) * cap * d + (p / 16) * half * 32 + (p % 16) * 2;
        // float16 saturates rather than overflow to inf (a key past 65504 would make its scores inf or NaN)
        auto key = [&](float v) { return Key(wide ? std::clamp(v, -65504.f, 65504.f) : v); };
        for (int64_t c = 0; c < d; c += 2) {
          block[(c / 2) * 32] = key(static_cast<float>(roped[c]));
          block[(c / 2) * 32 + 1] = key(static_cast<float>(roped[c + 1]));
        }
      }
    }
  });
  return q;
}

// wide: float16 keys, which take float32 qkv, cos and sin; else all bf16.
void check_rope_inputs(const char* what, const at::Tensor& qkv, const at::Tensor& qk_norm,
                       const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads, int64_t h_kv,
                       int64_t d, bool wide) {
  const auto dtype = wide ? at::kFloat : at::kBFloat16;
  const char* name = wide ? "float32 (the key cache is float16)" : "bf16 (the key cache is bf16)";
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == dtype && qkv.dim() == 2, what,
              ": contiguous qkv [n, (Hq + 2 Hkv) d], ", name);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dtype &&
              sin.scalar_type() == dtype && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == d,
              what, ": contiguous cos/sin [rows, d], ", name);
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * h_kv) * d && d % 2 == 0, what, ": bad shapes");
  TORCH_CHECK(!(qk_norm.defined() && qk_norm.numel() > 0) ||
              (qk_norm.scalar_type() == at::kFloat && qk_norm.is_contiguous() &&
               qk_norm.numel() == (num_q_heads + h_kv) * d), what, ": qk_norm must be float32 [Hq + Hkv, d]");
}

}  // namespace

// One layer's queries and keys after their projection: optional per-head RMSNorm (Gemma 3, Qwen3; weight
// float32 [Hq + Hkv, d]), rotary embedding (cos, sin [n, d] bf16, sin's first half negated so that
// rotate_half(x) * sin == roll(x, d/2) * sin), keys and values written to the caches at start .. start+n-1
// (keys packed [Hkv, cap/16, d/2, 16, 2], values [Hkv, cap, d]).
// qkv: [n, (Hq + 2 Hkv) d] contiguous. Returns the roped queries [n, Hq, d].
at::Tensor rope_and_cache(const at::Tensor& qkv, int64_t num_q_heads, const at::Tensor& qk_norm,
                             double eps, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& keys, at::Tensor& values, int64_t start) {
  const bool wide = keys.scalar_type() == at::kHalf;
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 5 && values.dim() == 3 &&
              (wide || keys.scalar_type() == at::kBFloat16) && values.scalar_type() == at::kBFloat16,
              "rope_and_cache: contiguous caches, keys packed [Hkv, cap/16, d/2, 16, 2] (bf16 or float16), bf16 "
              "values [Hkv, cap, d]");
  const int64_t n = qkv.size(0), h_kv = values.size(0), cap = values.size(1), d = values.size(2);
  check_rope_inputs("rope_and_cache", qkv, qk_norm, cos, sin, num_q_heads, h_kv, d, wide);
  TORCH_CHECK(start >= 0 && start + n <= cap && keys.size(0) == h_kv && keys.size(1) * 16 == cap &&
              keys.size(2) * 2 == d && cos.size(0) >= n, "rope_and_cache: bad shapes");
  const std::vector<Segment> segments{Segment{keys.data_ptr(), values.data_ptr<c10::BFloat16>(), cap, start, n, 0, 0}};
  return wide ? rope_rows<float>(qkv, num_q_heads, h_kv, d, qk_norm, eps, cos, sin, segments)
              : rope_rows<c10::BFloat16>(qkv, num_q_heads, h_kv, d, qk_norm, eps, cos, sin, segments);
}

// rope_and_cache of one layer for a call over several sequences: qkv holds rows[s] tokens of sequence s after
// those of sequences < s, at positions starts[s].., written to keys[s] [layers, Hkv, cap/16, d/2, 16, 2] and
// values[s] [layers, Hkv, cap, d] at `layer`. cos and sin are whole tables [>= every end, d], indexed by
// position. Each row is computed exactly as rope_and_cache computes it for its sequence alone. With trees
// (see cache_segments) a tree row is written at its slot and roped at its position (base + depth - 1).
at::Tensor rope_and_cache_segments(const at::Tensor& qkv, int64_t num_q_heads, const at::Tensor& qk_norm,
                                      double eps, const at::Tensor& cos, const at::Tensor& sin,
                                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                      int64_t layer, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& rows, const std::vector<int64_t>& tree_bases,
                                      const std::vector<at::Tensor>& tree_parents) {
  TORCH_CHECK(!values.empty() && values[0].dim() == 4, "rope_and_cache_segments: values [layers, Hkv, cap, d]");
  const int64_t d = values[0].size(3);
  int64_t h_kv = 0;
  std::vector<TreeRows> trees;
  bool wide = false;
  const std::vector<Segment> segments = cache_segments("rope_and_cache_segments", keys, values, layer, starts, rows,
                                                       qkv.size(0), d, &h_kv, tree_bases, tree_parents, trees, &wide);
  check_rope_inputs("rope_and_cache_segments", qkv, qk_norm, cos, sin, num_q_heads, h_kv, d, wide);
  for (const Segment& seg : segments)
    TORCH_CHECK(seg.rope_row + seg.rows <= cos.size(0), "rope_and_cache_segments: cos/sin tables end at ",
                cos.size(0), ", before position ", seg.rope_row + seg.rows);
  return wide ? rope_rows<float>(qkv, num_q_heads, h_kv, d, qk_norm, eps, cos, sin, segments)
              : rope_rows<c10::BFloat16>(qkv, num_q_heads, h_kv, d, qk_norm, eps, cos, sin, segments);
}

// act(gate) * up for gate_up [n, 2F] (gate first): SiLU (Llama) or tanh-approximated GELU (Gemma), 16 lanes
// at a time (the last chunk of a row masked), each lane computed alike.
at::Tensor gated_activation(const at::Tensor& gate_up, bool gelu_tanh) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2,
              "gated_activation: contiguous 2-d bf16");
  const int64_t n = gate_up.size(0), f = gate_up.size(1) / 2, chunks = (f + 15) / 16;
  auto out = at::empty({n, f}, gate_up.options());
  const auto* src = gate_up.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * chunks, 64, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t i = idx / chunks, c = (idx % chunks) * 16;
      const __mmask16 mask = tail_mask(f - c);
      const __m512 g = load16_from_pbh((__m256bh)_mm256_maskz_loadu_epi16(mask, src + i * 2 * f + c));
      const __m512 u = load16_from_pbh((__m256bh)_mm256_maskz_loadu_epi16(mask, src + i * 2 * f + f + c));
      // SiLU: g / (1 + exp(-g)). tanh GELU: 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)), y = sqrt(2/pi)(g + 0.044715 g^3).
      __m512 t = g;
      if (gelu_tanh) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        t = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), cube, g));
      }
      const __m512 a = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), t))));
      // act(gate) is rounded to bf16 before the product, as the model computes it.
      const __m512 prod = _mm512_mul_ps(load16_from_pbh(_mm512_cvtneps_pbh(a)), u);
      _mm256_mask_storeu_epi16(dst + i * f + c, mask, (__m256i)_mm512_cvtneps_pbh(prod));
    }
  });
  return out;
}
