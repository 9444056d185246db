// The packed chunk layout of quickdraft's GGUF-quantized weights (cpu_quant.cpp describes it), read one weight at a
// time in plain C++: the embedding lookup, dense views of a weight, and the reference the tests hold the layout to.
// No vector instructions, so that every kernel file includes it whatever instruction set it is compiled for
// (cpu_quant.cpp and cpu_quant_vnni.cpp for AVX-512, cpu_quant_avx2.cpp for AVX2). Internal linkage, as
// cpu_quant.h says why.

#pragma once

#include <ATen/ATen.h>  // not torch/extension.h (3x the compile time): only the Python bindings need it
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace {

// GGML's type ids.
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

constexpr const char* kSupported = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K";

// Per type: inputs per chunk (a packed super-block), the chunk's bytes, whether it has mins.
struct PackedType {
  int64_t sb, chunk;
  bool mins;
};

inline PackedType packed_type(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 288, false};
    case kQ4_1: return {32, 320, true};
    case kQ5_0: return {32, 352, false};
    case kQ5_1: return {32, 384, true};
    case kQ8_0: return {32, 544, false};
    case kQ4_K: return {256, 2368, true};
    case kQ5_K: return {256, 2880, true};
    case kQ6_K: return {256, 3360, false};
    default: TORCH_CHECK(false, "unsupported quantization type ", type, " (supported: ", kSupported, ")");
  }
  return {32, 288, false};  // not reached
}

inline void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  const PackedType t = packed_type(type);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight must be a contiguous uint8 CPU tensor [N/16, K/SB, chunk]");
  TORCH_CHECK(K % t.sb == 0 && w.size(1) == K / t.sb && w.size(2) == t.chunk, "quantized weight of type ", type,
              " must be [N/16, ", K / t.sb, ", ", t.chunk, "] for K = ", K, " (K a multiple of ", t.sb, "), got ",
              w.sizes());
}

// Calls f(T{}) with the struct of a GGML type among a kernel's eight (kSupported's, in that order): the one place a
// type id becomes its code.
template <class T4_0, class T4_1, class T5_0, class T5_1, class T8_0, class T4_K, class T5_K, class T6_K, class F>
decltype(auto) dispatch_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: return f(T4_0{});
    case kQ4_1: return f(T4_1{});
    case kQ5_0: return f(T5_0{});
    case kQ5_1: return f(T5_1{});
    case kQ8_0: return f(T8_0{});
    case kQ4_K: return f(T4_K{});
    case kQ5_K: return f(T5_K{});
    case kQ6_K: return f(T6_K{});
    default: TORCH_CHECK(false, "unsupported quantization type ", type, " (supported: ", kSupported, ")");
  }
  return f(T4_0{});  // not reached
}


// --- one weight of output n (0..15 of the chunk's group), input k (within the chunk) ---------------------------

inline float f16(const uint8_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*reinterpret_cast<const uint16_t*>(p)); }
inline int lane(int n, int k) { return 2 * n + (k & 1); }
inline int nibble_at(const uint8_t* plane, int n, int k) {  // k within the planes' steps (k / 2 = step)
  const int p = k >> 1;
  const uint16_t word = reinterpret_cast<const uint16_t*>(plane)[(p >> 2) * 32 + lane(n, k)];
  return (word >> (4 * (p & 3))) & 15;
}
// Where the high bits of a code sit (Q5_0's, Q5_1's and Q5_K's 5th bit, Q6_K's 5th and 6th). Step p of a 32-input run
// covers inputs 2p, 2p+1 (16-bit lane 2n + e of output n); the nibble of step p = 4g + s is in nibble vector g. Its
// high bits are at bit `high_bit_position(p)` (times the bit width) of the 16-bit lane, in a plane vector per
// 32 inputs (Q5_0, Q5_1, Q5_K: 1 bit, p taken within the 32) or per 16 (Q6_K, 2 bits, p taken within the 16). This order puts the high bits of
// the four bytes an integer dot product reads together at one bit position of each byte (cpu_quant_vnni.cpp).
constexpr int q5_high_bit(int p) { return 8 * ((p & 3) >> 1) + 2 * (p >> 2) + (p & 1); }
constexpr int q6_high_bits(int p) { return 8 * ((p & 3) >> 1) + 2 * (2 * ((p >> 2) & 1) + (p & 1)); }

inline float weight_value(int64_t type, const uint8_t* c, int n, int k) {
  switch (type) {
    case kQ4_0: return f16(c + 256 + 2 * n) * static_cast<float>(nibble_at(c, n, k) - 8);
    case kQ4_1: return f16(c + 256 + 2 * n) * static_cast<float>(nibble_at(c, n, k)) + f16(c + 288 + 2 * n);
    case kQ5_0: {
      const int high = (reinterpret_cast<const uint16_t*>(c + 256)[lane(n, k)] >> q5_high_bit(k >> 1)) & 1;
      return f16(c + 320 + 2 * n) * static_cast<float>((nibble_at(c, n, k) | high << 4) - 16);
    }
    case kQ5_1: {
      const int high = (reinterpret_cast<const uint16_t*>(c + 256)[lane(n, k)] >> q5_high_bit(k >> 1)) & 1;
      return f16(c + 320 + 2 * n) * static_cast<float>(nibble_at(c, n, k) | high << 4) + f16(c + 352 + 2 * n);
    }
    case kQ8_0:
      return f16(c + 512 + 2 * n) * static_cast<float>(reinterpret_cast<const int8_t*>(c)[(k >> 1) * 32 + lane(n, k)]);
    case kQ4_K: {
      const int j = k / 32;
      const float d = f16(c + 2048 + 2 * n) * static_cast<float>(c[2112 + 16 * j + n]);
      const float m = f16(c + 2080 + 2 * n) * static_cast<float>(c[2240 + 16 * j + n]);
      return d * static_cast<float>(nibble_at(c, n, k)) - m;
    }
    case kQ5_K: {
      const int j = k / 32, p = k >> 1;
      const int high = (reinterpret_cast<const uint16_t*>(c + 2048 + 64 * j)[lane(n, k)] >> q5_high_bit(p & 15)) & 1;
      const float d = f16(c + 2560 + 2 * n) * static_cast<float>(c[2624 + 16 * j + n]);
      const float m = f16(c + 2592 + 2 * n) * static_cast<float>(c[2752 + 16 * j + n]);
      return d * static_cast<float>(nibble_at(c, n, k) | high << 4) - m;
    }
    case kQ6_K: {
      const int j = k / 16, p = k >> 1;
      const int high = (reinterpret_cast<const uint16_t*>(c + 2048)[(p >> 3) * 32 + lane(n, k)] >> q6_high_bits(p & 7)) & 3;
      const float d = f16(c + 3072 + 2 * n) * static_cast<float>(reinterpret_cast<const int8_t*>(c)[3104 + 16 * j + n]);
      return d * static_cast<float>((nibble_at(c, n, k) | high << 4) - 32);
    }
    default: TORCH_CHECK(false, "unsupported quantization type ", type);
  }
  return 0.0f;  // not reached
}

// Rows `rows` of a packed weight as float32 [len(rows), K].
inline at::Tensor dequantize_packed_rows(const at::Tensor& w, int64_t type, const at::Tensor& rows, int64_t K) {
  check_weight(w, type, K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a 1-d int64 tensor");
  const auto r = rows.contiguous();
  const int64_t n = r.size(0), N = w.size(0) * 16;
  auto out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  const auto* rp = r.data_ptr<int64_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "row ", rp[i], " out of range for a weight of ", N, " rows");
  const PackedType t = packed_type(type);
  const int64_t super_blocks = K / t.sb;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = rp[i], g = row / 16;
      const int nn = static_cast<int>(row % 16);
      for (int64_t b = 0; b < super_blocks; ++b) {
        const uint8_t* c = wp + (g * super_blocks + b) * t.chunk;
        float* o = op + i * K + b * t.sb;
        for (int k = 0; k < t.sb; ++k) o[k] = weight_value(type, c, nn, k);
      }
    }
  });
  return out;
}

}  // namespace
