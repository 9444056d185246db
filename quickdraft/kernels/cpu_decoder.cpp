// A whole decoder stack (Llama family, Gemma 3) in one call from Python, on quickdraft's CPU kernels.
//
// Why: a layer is a dozen kernels of a few microseconds to a few hundred each; called one by one from
// Python they cost as much again in interpreter and dispatch time, for every one of a model's layers and
// every forward. Here the loop over layers runs in C++; the kernels and their numerics are exactly those
// of the single-kernel entry points below (so the Python loop over them, kept for tests and for other
// devices, computes the same bits).

#include <torch/extension.h>

#include <optional>
#include <tuple>
#include <vector>

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, bool use_amx);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor linear_quant(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                           const std::vector<int64_t>& types, bool float_output, const std::string& kernel_name);
std::tuple<torch::Tensor, bool> linear_quant_argmax(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                                    const std::vector<int64_t>& types, const std::string& kernel_name,
                                                    int64_t valid_columns);
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t type, const torch::Tensor& rows, int64_t K);
std::string get_quant_kernel(const std::string& model_kernel);
std::string set_quant_kernel(const std::string& name);
bool get_quant_amx();
bool set_quant_amx(bool on);
int64_t set_quant_amx_rows(int64_t rows);
torch::Tensor attention(const torch::Tensor& q, int64_t num_q_heads, const torch::Tensor& keys,
                        const torch::Tensor& values, int64_t start, int64_t window, double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool llama_style,
                       bool float_output);
torch::Tensor rope_and_cache(const torch::Tensor& qkv, int64_t num_q_heads, const torch::Tensor& qk_norm,
                             double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                             torch::Tensor& keys, torch::Tensor& values, int64_t start);
torch::Tensor gated_activation(const torch::Tensor& gate_up, bool gelu_tanh);
torch::Tensor attention_segments(const torch::Tensor& q, int64_t num_q_heads, const std::vector<torch::Tensor>& keys,
                                 const std::vector<torch::Tensor>& values, int64_t layer,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t window,
                                 double scale, const std::vector<int64_t>& tree_bases,
                                 const std::vector<torch::Tensor>& tree_parents);
torch::Tensor rope_and_cache_segments(const torch::Tensor& qkv, int64_t num_q_heads, const torch::Tensor& qk_norm,
                                      double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                                      const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                      int64_t layer, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& rows, const std::vector<int64_t>& tree_bases,
                                      const std::vector<torch::Tensor>& tree_parents);

namespace {

using OptionalTensor = std::optional<torch::Tensor>;
// A linear layer as Python's quickdraft.models.native.Linear holds it: packed weight, int8 scales or none,
// bias or none, the number of real outputs (the packed weight is padded to a multiple of 16), and for
// GGUF-quantized layers the packed parts, their types and the model's quantized kernel ("" for none) instead of
// the weight.
using LinearSpec = std::tuple<torch::Tensor, OptionalTensor, OptionalTensor, int64_t, std::vector<torch::Tensor>,
                              std::vector<int64_t>, std::string>;

struct Linear {
  torch::Tensor weight, scales, bias;
  int64_t out = 0;
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> types;
  std::string kernel;

  explicit Linear(const LinearSpec& spec)
      : weight(std::get<0>(spec)), scales(std::get<1>(spec).value_or(torch::Tensor())),
        bias(std::get<2>(spec).value_or(torch::Tensor())), out(std::get<3>(spec)), parts(std::get<4>(spec)),
        types(std::get<5>(spec)), kernel(std::get<6>(spec)) {}

  // float_output: float32 y where the weight is GGUF blocks (their kernels sum in float32), for a float32
  // residual stream; other weights read bf16 rows and return bf16 (a float32 stream widens it as it adds).
  torch::Tensor operator()(const torch::Tensor& x, bool float_output = false) const {
    if (parts.empty() && x.scalar_type() != at::kBFloat16) return (*this)(x.to(at::kBFloat16), float_output);
    torch::Tensor y = !parts.empty()    ? linear_quant(x, parts, types, float_output, kernel)
                      : scales.defined() ? linear_int8(x, weight, scales)
                                         : linear_bf16(x, weight, true);
    if (y.size(1) != out) y = y.narrow(1, 0, out).contiguous();
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  torch::Tensor input_norm, pre_mlp_norm, post_attn_norm, post_mlp_norm, qk_norm;
  int64_t window, rope;
};

class Decoder {
 public:
  Decoder(int64_t num_q_heads, double eps, double scale, bool gemma, bool gelu_tanh)
      : num_q_heads_(num_q_heads), eps_(eps), scale_(scale), gemma_(gemma), gelu_tanh_(gelu_tanh) {}

  // window 0: full attention; rope: index of the cos/sin pair forward receives for this layer.
  void add_layer(const LinearSpec& qkv, const LinearSpec& o, const LinearSpec& gate_up, const LinearSpec& down,
                 const torch::Tensor& input_norm, const torch::Tensor& pre_mlp_norm, const OptionalTensor& post_attn_norm,
                 const OptionalTensor& post_mlp_norm, const OptionalTensor& qk_norm, int64_t window, int64_t rope) {
    layers_.push_back(Layer{Linear(qkv), Linear(o), Linear(gate_up), Linear(down), input_norm, pre_mlp_norm,
                            post_attn_norm.value_or(torch::Tensor()), post_mlp_norm.value_or(torch::Tensor()),
                            qk_norm.value_or(torch::Tensor()), window, rope});
  }

  // x: [n, hidden] hidden states of the new tokens, bf16 or float32 (the residual stream's dtype; updated in
  // place and returned); keys [layers, Hkv, cap/16, d/2, 16, 2] and values [layers, Hkv, cap, d] of the sequence; the new tokens sit at start...;
  // cos[r], sin[r]: the rotary rows of those positions for rope kind r.
  torch::Tensor forward(torch::Tensor x, torch::Tensor keys, torch::Tensor values, int64_t start,
                        const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin) const {
    TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "Decoder.forward: contiguous [n, hidden] x");
    TORCH_CHECK(keys.size(0) == static_cast<int64_t>(layers_.size()) && values.size(0) == keys.size(0),
                "Decoder.forward: one cache slice per layer");
    check_ropes("Decoder.forward", cos, sin);
    return run(x, [&](size_t index, const Layer& layer, const torch::Tensor& qkv) {
      torch::Tensor layer_keys = keys.select(0, index), layer_values = values.select(0, index);
      torch::Tensor q = rope_and_cache(qkv, num_q_heads_, layer.qk_norm, eps_, cos[layer.rope], sin[layer.rope],
                                       layer_keys, layer_values, start);
      return attention(q, num_q_heads_, layer_keys, layer_values, start, layer.window, scale_);
    });
  }

  // One forward over several sequences (continuous batching): x [n, hidden] holds rows[s] new tokens of
  // sequence s after those of sequences < s (updated in place and returned); keys[s] [layers, Hkv, cap/16,
  // d/2, 16, 2] and values[s] [layers, Hkv, cap, d] are sequence s's caches, its tokens at starts[s]...;
  // cos[r], sin[r]: whole rotary tables of rope kind r, indexed by position (rows up to every sequence's end).
  // Linear layers, norms and the activation take all n rows in one call (the weights are read once per
  // layer for the whole batch); rotary embedding, the cache write and attention run on each row in its own
  // sequence. Every kernel computes a row alike whatever the other rows, so row for row the result is
  // bitwise that of `forward` for each sequence alone (int8 linear layers: below 32 rows in all, see
  // cpu_linear.cpp). tree_bases / tree_parents: empty, or per sequence a token tree's base slot (0: none) and
  // the parent slot of each of its slots (see cpu_attention.cpp's cache_segments).
  torch::Tensor forward_batch(torch::Tensor x, const std::vector<torch::Tensor>& keys,
                              const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                              const std::vector<int64_t>& rows, const std::vector<torch::Tensor>& cos,
                              const std::vector<torch::Tensor>& sin, const std::vector<int64_t>& tree_bases,
                              const std::vector<torch::Tensor>& tree_parents) const {
    TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "Decoder.forward_batch: contiguous [n, hidden] x");
    for (size_t s = 0; s < keys.size(); ++s)
      TORCH_CHECK(keys[s].size(0) == static_cast<int64_t>(layers_.size()) && values.size() == keys.size() &&
                  values[s].size(0) == keys[s].size(0), "Decoder.forward_batch: one cache slice per layer");
    check_ropes("Decoder.forward_batch", cos, sin);
    return run(x, [&](size_t index, const Layer& layer, const torch::Tensor& qkv) {
      const int64_t i = static_cast<int64_t>(index);
      torch::Tensor q = rope_and_cache_segments(qkv, num_q_heads_, layer.qk_norm, eps_, cos[layer.rope],
                                                sin[layer.rope], keys, values, i, starts, rows, tree_bases,
                                                tree_parents);
      return attention_segments(q, num_q_heads_, keys, values, i, starts, rows, layer.window, scale_, tree_bases,
                                tree_parents);
    });
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // The layer loop; attend(index, layer, qkv) writes the layer's keys and values and returns the attention
  // output [n, Hq d] that the output projection takes.
  template <typename Attend>
  torch::Tensor run(torch::Tensor x, const Attend& attend) const {
    const bool llama_norm = !gemma_;
    // A float32 x is a float32 residual stream (GGUF blocks, as llama.cpp keeps it): the output and down
    // projections add to it unrounded, and the norms hand a layer on GGUF blocks float32 rows (its kernel
    // quantizes them as they are), other layers bf16 ones. Its caches hold float16 keys: q, k and v leave their
    // projection in float32, and attention hands the output projection float32 rows (see cpu_attention.cpp).
    const bool wide = x.scalar_type() == at::kFloat;
    for (size_t index = 0; index < layers_.size(); ++index) {
      const Layer& layer = layers_[index];
      torch::Tensor qkv = layer.qkv(rms_norm(x, layer.input_norm, eps_, llama_norm, wide && !layer.qkv.parts.empty()),
                                    wide);
      if (wide && qkv.scalar_type() != at::kFloat) qkv = qkv.to(at::kFloat);  // a dense q|k|v: bf16 out
      torch::Tensor attn = layer.o(attend(index, layer, qkv), wide);
      if (layer.post_attn_norm.defined()) attn = rms_norm(attn, layer.post_attn_norm, eps_, false, wide);
      x.add_(attn);  // the residual sum, rounded to x's dtype as the model's `x + attn` is
      torch::Tensor mlp = layer.down(
          gated_activation(layer.gate_up(rms_norm(x, layer.pre_mlp_norm, eps_, llama_norm,
                                                  wide && !layer.gate_up.parts.empty())), gelu_tanh_), wide);
      if (layer.post_mlp_norm.defined()) mlp = rms_norm(mlp, layer.post_mlp_norm, eps_, false, wide);
      x.add_(mlp);
    }
    return x;
  }

  void check_ropes(const char* what, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin) const {
    for (const Layer& layer : layers_)
      TORCH_CHECK(layer.rope >= 0 && layer.rope < static_cast<int64_t>(cos.size()) && cos.size() == sin.size(), what,
                  ": one cos/sin pair per rope kind");
  }

  int64_t num_q_heads_;
  double eps_, scale_;
  bool gemma_, gelu_tanh_;
  std::vector<Layer> layers_;
};

}  // namespace

bool amx_available();  // cpu_linear.cpp
std::tuple<torch::Tensor, bool> rows_argmax(torch::Tensor x);  // cpu_rows.cpp
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, bool> rows_top_k(torch::Tensor x, int64_t k, bool with_logsumexp);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "causal (optionally sliding-window) attention of a decoding step, packed keys");
  m.def("rms_norm", &rms_norm, "RMSNorm, Llama or Gemma rounding, of bf16 or float32 x; bf16 out, or float32 (unrounded) "
        "if float_output", py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("llama_style"),
        py::arg("float_output") = false);
  m.def("rope_and_cache", &rope_and_cache, "per-head norm, rotary embedding, and the KV cache write of a layer");
  m.def("attention_segments", &attention_segments, "attention of one layer over the rows of several sequences "
        "(token trees: tree_bases and tree_parents per sequence)", py::arg("q"), py::arg("num_q_heads"),
        py::arg("keys"), py::arg("values"), py::arg("layer"), py::arg("starts"), py::arg("rows"), py::arg("window"),
        py::arg("scale"), py::arg("tree_bases") = std::vector<int64_t>(),
        py::arg("tree_parents") = std::vector<torch::Tensor>());
  m.def("rope_and_cache_segments", &rope_and_cache_segments,
        "rope_and_cache of one layer over the rows of several sequences, each into its own cache (token trees: "
        "tree_bases and tree_parents per sequence)", py::arg("qkv"), py::arg("num_q_heads"), py::arg("qk_norm"),
        py::arg("eps"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("layer"),
        py::arg("starts"), py::arg("rows"), py::arg("tree_bases") = std::vector<int64_t>(),
        py::arg("tree_parents") = std::vector<torch::Tensor>());
  m.def("gated_activation", &gated_activation, "act(gate) * up (SiLU or tanh GELU)");
  m.def("linear_bf16", &linear_bf16, "y = x w^T, bf16, batch-invariant (AMX tiles when use_amx and K % 32 == 0)");
  m.def("amx_available", &amx_available, "whether this process may use AMX tiles");
  m.def("linear_int8", &linear_int8, "y = (x w^T) * scales, int8 weights, batch-invariant below 32 rows (AMX from there)");
  m.def("linear_quant", &linear_quant, "y = x [W_0; W_1; ...]^T on GGUF-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K) packed by quickdraft.kernels.quant, batch-invariant; bf16, or float32 if float_output",
        py::arg("x"), py::arg("weights"), py::arg("types"), py::arg("float_output") = false,
        py::arg("kernel") = "");
  m.def("linear_quant_argmax", &linear_quant_argmax, "each row's first index of its maximum over the first "
        "valid_columns outputs of linear_quant(x, weights, types, True, kernel), bitwise, without writing the [M, N] "
        "logits; and whether some row holds a NaN (then the indices mean nothing)", py::arg("x"), py::arg("weights"),
        py::arg("types"), py::arg("kernel"), py::arg("valid_columns"));
  m.def("quant_kernel", &get_quant_kernel, "the quantized linear kernel a call runs for a model that chose `kernel` "
        "(\"\": none): bf16, int8, int8x32 or int16 (integer digits an activation, AVX512-VNNI)",
        py::arg("kernel") = "");
  m.def("set_quant_kernel", &set_quant_kernel, "override every model's quantized linear kernel (bf16, int8, int8x32, "
        "int16; \"\" removes the override); returns the override before (\"\" for none)");
  m.def("quant_amx", &get_quant_amx, "whether the integer quantized kernels run calls of many rows on AMX-INT8 tiles");
  m.def("set_quant_amx", &set_quant_amx, "AMX-INT8 tiles for calls of many rows on (where the CPU has them) or off; "
        "returns the setting before");
  m.def("set_quant_amx_rows", &set_quant_amx_rows, "from how many rows the integer kernels use AMX-INT8 tiles "
        "(0: the measured default); returns the setting before");
  m.def("rows_argmax", &rows_argmax, "each float32 row's first index of its maximum, and whether a row holds a NaN");
  m.def("rows_top_k", &rows_top_k, "each float32 row's k largest values and their indices (ties in index order), its "
        "logsumexp if asked, and whether every row was computed (no NaN; no +inf for logsumexp)",
        py::arg("x"), py::arg("k"), py::arg("with_logsumexp") = false);
  m.def("dequantize_rows", &dequantize_rows, "rows of a packed quantized weight as float32 (the embedding lookup)");
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, double, double, bool, bool>())
      .def("add_layer", &Decoder::add_layer)
      .def("forward", &Decoder::forward)
      .def("forward_batch", &Decoder::forward_batch, py::arg("x"), py::arg("keys"), py::arg("values"),
           py::arg("starts"), py::arg("rows"), py::arg("cos"), py::arg("sin"),
           py::arg("tree_bases") = std::vector<int64_t>(), py::arg("tree_parents") = std::vector<torch::Tensor>())
      .def_property_readonly("num_layers", &Decoder::num_layers);
}
