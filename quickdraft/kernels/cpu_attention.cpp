// Decoding-step attention and RMSNorm for x86 CPUs with AVX512-BF16, bf16 in and out, float32 inside.
//
// Why: a decoding step attends a handful of queries to the cache; torch's batched matmuls cost tens of
// microseconds each in setup there, twice per layer. Here every query row is computed on its own, over
// exactly the keys it may see (causal, and a sliding window where the layer has one), in a fixed order:
// its result does not depend on how many queries share the call, so verification of K+1 tokens gives the
// same numbers as K+1 single-token steps. Scores and probabilities stay in float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> 16 float32 (exact)
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16_from_pbh(__m256bh v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

inline float dot(const c10::BFloat16* a, const c10::BFloat16* b, int64_t d) {  // d % 16 == 0
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(load16(a + i), load16(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

// q: [n, >=Hq, d] (row stride q_stride elements, head stride d); keys/values: [Hkv, capacity, d].
// Query i sits at position start + i and sees keys j in (start + i - window, start + i] (window 0: all).
torch::Tensor attention(const torch::Tensor& q, int64_t num_q_heads, const torch::Tensor& keys,
                        const torch::Tensor& values, int64_t start, int64_t window, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16, "attention: bf16 tensors expected");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "attention: q must be [n, H, d] with d contiguous");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 3, "attention: contiguous [Hkv, cap, d] caches");
  const int64_t n = q.size(0), d = q.size(2), h_kv = keys.size(0), cap = keys.size(1);
  TORCH_CHECK(d % 16 == 0 && keys.size(2) == d, "attention: head_dim must be a multiple of 16");
  TORCH_CHECK(num_q_heads % h_kv == 0 && start + n <= cap, "attention: bad heads or positions");
  const int64_t group = num_q_heads / h_kv, q_stride = q.stride(0);
  auto out = torch::empty({n, num_q_heads * d}, q.options());
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = keys.data_ptr<c10::BFloat16>();
  const auto* vp = values.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, n * num_q_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_q_heads, h = task % num_q_heads, kv = h / group;
      const int64_t pos = start + i;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const c10::BFloat16* qrow = qp + i * q_stride + h * d;
      const c10::BFloat16* kbase = kp + kv * cap * d;
      const c10::BFloat16* vbase = vp + kv * cap * d;
      scores.resize(pos - lo + 1);
      float top = -INFINITY;
      for (int64_t j = lo; j <= pos; ++j) {
        const float v = dot(qrow, kbase + j * d, d) * s;
        scores[j - lo] = v;
        top = std::max(top, v);
      }
      float total = 0.f;
      for (auto& v : scores) { v = std::exp(v - top); total += v; }
      const float inv = 1.f / total;
      for (int64_t c = 0; c < d; c += 16) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t j = lo; j <= pos; ++j)
          a = _mm512_fmadd_ps(_mm512_set1_ps(scores[j - lo]), load16(vbase + j * d + c), a);
        a = _mm512_mul_ps(a, _mm512_set1_ps(inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + i * num_q_heads * d + h * d + c),
                            (__m256i)_mm512_cvtneps_pbh(a));
      }
    }
  });
  return out;
}

// RMSNorm of each row of x [rows, H] (contiguous), bf16 out. weight: [R, H] (row r of x uses weight row
// r % R). llama_style: round the normalised row to bf16 before multiplying by a bf16 weight (Llama);
// otherwise multiply by a float32 weight, then round (Gemma, whose weight is stored as 1 + w).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool llama_style) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "rms_norm: contiguous bf16 x");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && weight.is_contiguous() && weight.size(-1) == H, "rms_norm: bad shapes");
  TORCH_CHECK(weight.scalar_type() == (llama_style ? at::kBFloat16 : at::kFloat), "rms_norm: weight dtype");
  const int64_t R = weight.numel() / H;
  auto y = torch::empty_like(x);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const void* wp = weight.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* row = xp + r * H;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) { __m512 v = load16(row + i); acc = _mm512_fmadd_ps(v, v, acc); }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / H + static_cast<float>(eps));
      const __m512 scale = _mm512_set1_ps(inv);
      const int64_t wr = (r % R) * H;
      for (int64_t i = 0; i < H; i += 16) {
        __m512 v = _mm512_mul_ps(load16(row + i), scale);
        if (llama_style) {
          // bf16(bf16(v) * w): round, widen, multiply by the bf16 weight, round again.
          __m512 rounded = load16_from_pbh(_mm512_cvtneps_pbh(v));
          v = _mm512_mul_ps(rounded, load16(static_cast<const c10::BFloat16*>(wp) + wr + i));
        } else {
          v = _mm512_mul_ps(v, _mm512_loadu_ps(static_cast<const float*>(wp) + wr + i));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + r * H + i), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return y;
}

// One layer's queries and keys after their projection: optional per-head RMSNorm (Gemma 3, Qwen3; weight
// float32 [Hq + Hkv, d]), rotary embedding (cos, sin [n, d] bf16, sin's first half negated so that
// rotate_half(x) * sin == roll(x, d/2) * sin), keys and values written to the caches at start .. start+n-1.
// qkv: [n, (Hq + 2 Hkv) d] contiguous. Returns the roped queries [n, Hq, d].
torch::Tensor rope_and_cache(const torch::Tensor& qkv, int64_t num_q_heads, const torch::Tensor& qk_norm,
                             double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                             torch::Tensor& keys, torch::Tensor& values, int64_t start) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kBFloat16, "rope_and_cache: contiguous bf16 qkv");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "rope_and_cache: contiguous caches");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rope_and_cache: contiguous cos/sin");
  const int64_t n = qkv.size(0), h_kv = keys.size(0), cap = keys.size(1), d = keys.size(2);
  const int64_t heads = num_q_heads + h_kv, half = d / 2;
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * h_kv) * d && d % 2 == 0 && start + n <= cap,
              "rope_and_cache: bad shapes");
  const bool norm = qk_norm.defined() && qk_norm.numel() > 0;
  auto q = torch::empty({n, num_q_heads, d}, qkv.options());
  const auto* src = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  const float* wp = norm ? qk_norm.data_ptr<float>() : nullptr;
  auto* qp = q.data_ptr<c10::BFloat16>();
  auto* kp = keys.data_ptr<c10::BFloat16>();
  auto* vp = values.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * (heads + h_kv), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (heads + h_kv), h = task % (heads + h_kv);
      const c10::BFloat16* row = src + i * (heads + h_kv) * d + h * d;
      if (h >= heads) {  // a value head: copied to the cache as is
        std::memcpy(vp + ((h - heads) * cap + start + i) * d, row, d * sizeof(c10::BFloat16));
        continue;
      }
      for (int64_t c = 0; c < d; ++c) x[c] = static_cast<float>(row[c]);
      if (norm) {
        float ss = 0.f;
        for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
        const float inv = 1.f / std::sqrt(ss / d + static_cast<float>(eps));
        // Rounded to bf16 after the weight, as the model's norm does before rope.
        for (int64_t c = 0; c < d; ++c) x[c] = static_cast<float>(c10::BFloat16(x[c] * inv * wp[h * d + c]));
      }
      c10::BFloat16* dst = h < num_q_heads ? qp + (i * num_q_heads + h) * d
                                           : kp + ((h - num_q_heads) * cap + start + i) * d;
      const c10::BFloat16* cr = cp + i * d;
      const c10::BFloat16* sr = sp + i * d;
      for (int64_t c = 0; c < d; ++c) {
        const float rotated = x[c < half ? c + half : c - half];
        dst[c] = c10::BFloat16(x[c] * static_cast<float>(cr[c]) + rotated * static_cast<float>(sr[c]));
      }
    }
  });
  return q;
}

// act(gate) * up for gate_up [n, 2F] (gate first): SiLU (Llama) or tanh-approximated GELU (Gemma).
torch::Tensor gated_activation(const torch::Tensor& gate_up, bool gelu_tanh) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.scalar_type() == at::kBFloat16, "gated_activation: contiguous bf16");
  const int64_t n = gate_up.size(0), f = gate_up.size(1) / 2;
  auto out = torch::empty({n, f}, gate_up.options());
  const auto* src = gate_up.data_ptr<c10::BFloat16>();
  auto* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * f, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t i = idx / f, c = idx % f;
      const float g = static_cast<float>(src[i * 2 * f + c]), u = static_cast<float>(src[i * 2 * f + f + c]);
      float a;
      if (gelu_tanh) {
        a = 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
      } else {
        a = g / (1.f + std::exp(-g));
      }
      // act(gate) is rounded to bf16 before the product, as the model computes it.
      dst[idx] = c10::BFloat16(static_cast<float>(c10::BFloat16(a)) * u);
    }
  });
  return out;
}
