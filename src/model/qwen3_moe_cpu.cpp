#include "model/qwen3_moe_cpu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/dtype.h"
#include "cpu/attention.h"
#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/rope.h"
#include "model/rope_frequencies.h"
#include "core/log.h"
#include "cpu/swiglu.h"
#include "formats/gptq.h"
#include "formats/nvfp4.h"
#include "formats/safetensors.h"
#include "parallel/ep_step.h"

namespace moebius::model {
namespace {

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

// The checkpoint's tensor `name`, which must exist with exactly `shape` and a float dtype we can
// upcast (BF16, F16, F32). Errors name the tensor and the checkpoint.
Result<TensorView> get_float_tensor(const SafetensorsCheckpoint& ck, const std::string& name, const Shape& shape) {
  const TensorInfo* info = ck.find(name);
  if (info == nullptr) return Error("missing from the checkpoint").in_tensor(name).in_file(ck.path());
  if (info->dtype != DType::kBF16 && info->dtype != DType::kF16 && info->dtype != DType::kF32)
    return Error::format("dtype {} is not supported (expected BF16, F16 or F32)", dtype_name(info->dtype))
        .in_tensor(name)
        .in_file(ck.path());
  return ck.get(name, info->dtype, shape);  // checks the shape, naming the tensor
}

// Upcasts a float view to fp32. Elements are read with memcpy: safetensors does not promise
// aligned offsets ([TAG_SAFETENSORS_ALIGNMENT]).
std::vector<float> to_f32(const TensorView& v) {
  const int64_t n = v.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const auto* p = static_cast<const uint8_t*>(v.data);
  if (v.dtype == DType::kF32) {
    std::memcpy(out.data(), p, static_cast<size_t>(n) * 4);
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + i * 2, 2);
    out[static_cast<size_t>(i)] = v.dtype == DType::kBF16 ? bf16_bits_to_float(bits) : fp16_bits_to_float(bits);
  }
  return out;
}

// [TAG_FINITE_WEIGHTS] The error for element `i` of a tensor of `shape` that is not finite.
Error non_finite_error(const Shape& shape, int64_t i, float value) {
  std::string at = std::to_string(i);
  if (shape.rank == 2) at = std::to_string(i / shape[1]) + ", " + std::to_string(i % shape[1]);
  return Error::format("value [{}] is not finite ({}): the checkpoint is damaged", at, value);
}

}  // namespace

Result<std::vector<float>> load_float_tensor(const SafetensorsCheckpoint& ck, const std::string& name, const Shape& shape) {
  MOEBIUS_ASSIGN_OR_RETURN(TensorView v, get_float_tensor(ck, name, shape));
  std::vector<float> out = to_f32(v);
  if (const int64_t i = first_non_finite(out.data(), static_cast<int64_t>(out.size())); i >= 0)
    return non_finite_error(shape, i, out[static_cast<size_t>(i)]).in_tensor(name).in_file(ck.path());
  return out;
}

namespace {

// True when the checkpoint stores `module` in the quantized layout `lq` describes (GPTQ: a
// qweight; NVFP4: a weight_scale next to the weight).
bool has_quantized_tensors(const SafetensorsCheckpoint& ck, const LayerQuant& lq, const std::string& module) {
  if (lq.format == WeightFormat::kNvFp4) return ck.find(module_tensor_name(module, "weight_scale")) != nullptr;
  return ck.find(module_tensor_name(module, "qweight")) != nullptr;
}

// A tensor of a quantized module, which must be present.
Result<TensorView> get_quant_tensor(const SafetensorsCheckpoint& ck, const std::string& module,
                                    std::string_view suffix, const LayerQuant& lq) {
  const std::string name = module_tensor_name(module, suffix);
  if (ck.find(name) == nullptr)
    return Error::format("missing from the checkpoint (the quantization config makes {} {} with group size {})",
                         module, weight_format_name(lq.format), lq.group_size)
        .in_tensor(name)
        .in_file(ck.path());
  return ck.view(name);
}

std::string shape_str(std::initializer_list<int64_t> dims) { return Shape(dims).str(); }

// The quantized module `module` [rows, cols] straight from its checkpoint tensors (zero copy; the
// matrix keeps `owner` alive). The packed weight's shape is checked against [rows, cols] from
// config.json before the format module looks at the rest.
Result<QuantMatrix> load_quantized_matrix(const SafetensorsCheckpoint& ck, std::shared_ptr<const void> owner,
                                          const LayerQuant& lq, const std::string& module, int64_t rows,
                                          int64_t cols) {
  Result<QuantMatrix> m = Error("unreachable");
  if (lq.format == WeightFormat::kNvFp4) {
    nvfp4::CheckpointTensors t;
    MOEBIUS_ASSIGN_OR_RETURN(t.weight, get_quant_tensor(ck, module, "weight", lq));
    if (!(t.weight.shape == Shape{rows, cols / 2}))
      return Error::format("has shape {}, expected {} (NVFP4 codes of a [{}, {}] weight from config.json)",
                           t.weight.shape.str(), shape_str({rows, cols / 2}), rows, cols)
          .in_tensor(module_tensor_name(module, "weight"))
          .in_file(ck.path());
    MOEBIUS_ASSIGN_OR_RETURN(t.weight_scale, get_quant_tensor(ck, module, "weight_scale", lq));
    MOEBIUS_ASSIGN_OR_RETURN(t.weight_scale_2, get_quant_tensor(ck, module, "weight_scale_2", lq));
    if (ck.find(module_tensor_name(module, "input_scale")) != nullptr) {
      MOEBIUS_ASSIGN_OR_RETURN(t.input_scale, ck.view(module_tensor_name(module, "input_scale")));
    }
    m = nvfp4::from_checkpoint(t, module, std::move(owner));
  } else {
    const int P = gptq::pack_factor(lq.bits);
    gptq::CheckpointTensors t;
    MOEBIUS_ASSIGN_OR_RETURN(t.qweight, get_quant_tensor(ck, module, "qweight", lq));
    if (cols % P != 0 || !(t.qweight.shape == Shape{cols / P, rows}))
      return Error::format("has shape {}, expected {} ({}-bit GPTQ packing of a [{}, {}] weight from config.json)",
                           t.qweight.shape.str(), shape_str({cols / P, rows}), lq.bits, rows, cols)
          .in_tensor(module_tensor_name(module, "qweight"))
          .in_file(ck.path());
    MOEBIUS_ASSIGN_OR_RETURN(t.qzeros, get_quant_tensor(ck, module, "qzeros", lq));
    MOEBIUS_ASSIGN_OR_RETURN(t.scales, get_quant_tensor(ck, module, "scales", lq));
    if (ck.find(module_tensor_name(module, "g_idx")) != nullptr) {
      MOEBIUS_ASSIGN_OR_RETURN(t.g_idx, ck.view(module_tensor_name(module, "g_idx")));
    }
    const gptq::Layout layout{lq.bits, lq.group_size, lq.zeros};
    m = gptq::from_checkpoint(t, layout, module, std::move(owner));
  }
  if (!m.ok()) return std::move(m).error().in_tensor(module).in_file(ck.path());
  if (m->rows != rows || m->cols != cols)  // defensive: the packed weight's shape was checked
    return Error::format("holds a [{}, {}] matrix, config.json gives [{}, {}]", m->rows, m->cols, rows, cols)
        .in_tensor(module)
        .in_file(ck.path());
  return m;
}

// An unquantized expert projection [rows, cols] (see the header for the format choice).
// `convert`: experts_format applies (false for modules a pre-quantized checkpoint excludes).
Result<QuantMatrix> load_float_expert(const std::shared_ptr<const SafetensorsCheckpoint>& ck, const std::string& name,
                                      int64_t rows, int64_t cols, const Qwen3MoeLoadOptions& opt, bool convert) {
  MOEBIUS_ASSIGN_OR_RETURN(TensorView v, get_float_tensor(*ck, name, Shape{rows, cols}));
  std::optional<WeightFormat> target = convert ? opt.experts_format : std::nullopt;
  if (!target && opt.unquantized_experts_bf16) target = WeightFormat::kBF16;
  const bool keep_bf16 = v.dtype == DType::kBF16 && (!target || *target == WeightFormat::kBF16);
  if (keep_bf16) {  // zero copy: the matrix points into the mmap, which `owner` keeps alive
    const auto* bytes = static_cast<const uint8_t*>(v.data);
    if (const int64_t i = first_non_finite_bf16(bytes, rows * cols); i >= 0) {
      uint16_t bits;
      std::memcpy(&bits, bytes + 2 * i, 2);
      return non_finite_error(Shape{rows, cols}, i, bf16_bits_to_float(bits)).in_tensor(name).in_file(ck->path());
    }
    QuantMatrix m;
    m.format = WeightFormat::kBF16;
    m.rows = rows;
    m.cols = cols;
    m.weight = std::span<const uint8_t>(static_cast<const uint8_t*>(v.data), v.nbytes());
    m.owner = ck;
    MOEBIUS_TRY(m.validate());
    return m;
  }
  const WeightFormat f = target.value_or(WeightFormat::kF32);
  const int group = f == WeightFormat::kNvFp4 ? 16 : is_int_format(f) ? opt.experts_group_size : 0;
  const std::vector<float> w = to_f32(v);
  auto q = quantize(f, w.data(), rows, cols, group);
  if (!q.ok()) return std::move(q).error().in_tensor(name).in_file(ck->path());
  return q;
}

// One expert projection `module` [rows, cols]. `*kept_float` is set when a pre-quantized
// checkpoint excludes it.
Result<QuantMatrix> load_expert_matrix(const std::shared_ptr<const SafetensorsCheckpoint>& ck, const QuantConfig& qc,
                                       const std::string& module, int64_t rows, int64_t cols,
                                       const Qwen3MoeLoadOptions& opt, bool* kept_float) {
  const LayerQuant lq = qc.layer(module);
  if (!lq.quantized) {
    *kept_float = qc.is_quantized();
    return load_float_expert(ck, module + ".weight", rows, cols, opt, !qc.is_quantized());
  }
  if (opt.experts_format && *opt.experts_format != lq.format)
    return Error::format("the checkpoint stores this expert as {} ({} quantization config); --experts {} would "
                         "re-quantize already-quantized weights, which moebius refuses. Omit --experts (or pass "
                         "--experts {}), or start from the unquantized checkpoint",
                         weight_format_name(lq.format), quant_method_name(qc.method),
                         weight_format_name(*opt.experts_format), weight_format_name(lq.format))
        .in_tensor(module)
        .in_file(ck->path());
  return load_quantized_matrix(*ck, ck, lq, module, rows, cols);
}

}  // namespace

Result<std::vector<float>> load_linear_weight(const SafetensorsCheckpoint& ck, const QuantConfig& qc,
                                              const std::string& module, int64_t rows, int64_t cols) {
  const LayerQuant lq = qc.layer(module);
  if (!lq.quantized || !has_quantized_tensors(ck, lq, module))
    return load_float_tensor(ck, module_tensor_name(module, "weight"), Shape{rows, cols});
  MOEBIUS_ASSIGN_OR_RETURN(QuantMatrix m, load_quantized_matrix(ck, nullptr, lq, module, rows, cols));
  std::vector<float> out(static_cast<size_t>(rows * cols));
  dequantize_rows(m, 0, rows, out.data());
  return out;
}

std::optional<WeightFormat> quantized_experts_format(const Qwen3MoeConfig& c, const QuantConfig& qc) {
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    const LayerQuant lq = qc.layer("model.layers." + std::to_string(l) + ".mlp.experts.0.gate_proj");
    if (lq.quantized) return lq.format;
    return std::nullopt;
  }
  return std::nullopt;
}

Result<Qwen3MoeLayerWeights> load_qwen3_moe_layer(const std::shared_ptr<const SafetensorsCheckpoint>& ck,
                                                  const Qwen3MoeConfig& c, const QuantConfig& qc, int layer,
                                                  const Qwen3MoeLoadOptions& opt) {
  const SafetensorsCheckpoint& k = *ck;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t H = c.hidden_size, hd = c.head_dim, q_dim = int64_t{c.num_attention_heads} * hd,
                kv_dim = int64_t{c.num_key_value_heads} * hd;
  Qwen3MoeLayerWeights w;
  MOEBIUS_ASSIGN_OR_RETURN(w.input_norm, load_float_tensor(k, p + "input_layernorm.weight", Shape{H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.post_norm, load_float_tensor(k, p + "post_attention_layernorm.weight", Shape{H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.q_proj, load_linear_weight(k, qc, p + "self_attn.q_proj", q_dim, H));
  MOEBIUS_ASSIGN_OR_RETURN(w.k_proj, load_linear_weight(k, qc, p + "self_attn.k_proj", kv_dim, H));
  MOEBIUS_ASSIGN_OR_RETURN(w.v_proj, load_linear_weight(k, qc, p + "self_attn.v_proj", kv_dim, H));
  MOEBIUS_ASSIGN_OR_RETURN(w.o_proj, load_linear_weight(k, qc, p + "self_attn.o_proj", H, q_dim));
  MOEBIUS_ASSIGN_OR_RETURN(w.q_norm, load_float_tensor(k, p + "self_attn.q_norm.weight", Shape{hd}));
  MOEBIUS_ASSIGN_OR_RETURN(w.k_norm, load_float_tensor(k, p + "self_attn.k_norm.weight", Shape{hd}));
  // [TAG_ROPE_ATTENTION_FACTOR] YaRN's attention factor, folded into the norms right before RoPE
  // (model/rope_frequencies.h); 1 otherwise, and the weights stay as read.
  if (const float af = rope_attention_factor(c); af != 1.0f)
    for (std::vector<float>* norm : {&w.q_norm, &w.k_norm})
      for (float& x : *norm) x *= af;
  w.is_moe = c.is_moe_layer(layer);
  if (!w.is_moe) {
    const int64_t I = c.intermediate_size;
    MOEBIUS_ASSIGN_OR_RETURN(w.gate_proj, load_linear_weight(k, qc, p + "mlp.gate_proj", I, H));
    MOEBIUS_ASSIGN_OR_RETURN(w.up_proj, load_linear_weight(k, qc, p + "mlp.up_proj", I, H));
    MOEBIUS_ASSIGN_OR_RETURN(w.down_proj, load_linear_weight(k, qc, p + "mlp.down_proj", H, I));
    return w;
  }
  const int64_t I = c.moe_intermediate_size;
  const int E = c.num_experts;
  cpu::MoeLayerReference& m = w.moe;
  m.shape = cpu::MoeShape{H, I, E, c.num_experts_per_tok};
  m.router.num_experts = E;
  m.router.top_k = c.num_experts_per_tok;
  m.router.scoring = cpu::RouterScoring::kSoftmax;
  m.router.renormalize = c.norm_topk_prob;
  m.options.activation.kind = cpu::Activation::kSiLU;
  m.options.round_intermediate_to_bf16 = opt.round_intermediate_to_bf16;
  MOEBIUS_ASSIGN_OR_RETURN(m.router_weight, load_linear_weight(k, qc, p + "mlp.gate", E, H));
  // Expert parallelism: only this rank's experts [TAG_EP_EXPERT_OWNER].
  const int ep_size = opt.ep_comm ? opt.ep_comm->size() : 1;
  if (opt.ep_comm) MOEBIUS_TRY(parallel::check_expert_split(E, ep_size));
  const parallel::ExpertRange owned =
      opt.ep_comm ? parallel::expert_range(E, ep_size, opt.ep_comm->rank()) : parallel::ExpertRange{0, E};
  m.experts.resize(static_cast<size_t>(owned.count()));
  int kept_float = 0;  // expert projections a pre-quantized checkpoint excludes
  for (int e = owned.begin; e < owned.end; ++e) {
    const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
    cpu::ExpertWeights& x = m.experts[static_cast<size_t>(e - owned.begin)];
    bool kf[3] = {false, false, false};
    MOEBIUS_ASSIGN_OR_RETURN(x.gate, load_expert_matrix(ck, qc, q + "gate_proj", I, H, opt, &kf[0]));
    MOEBIUS_ASSIGN_OR_RETURN(x.up, load_expert_matrix(ck, qc, q + "up_proj", I, H, opt, &kf[1]));
    MOEBIUS_ASSIGN_OR_RETURN(x.down, load_expert_matrix(ck, qc, q + "down_proj", H, I, opt, &kf[2]));
    kept_float += int{kf[0]} + int{kf[1]} + int{kf[2]};
  }
  if (kept_float > 0 && kept_float < 3 * owned.count())
    log_warn("layer {}: {} of {} expert projections are excluded from the checkpoint's {} quantization and keep "
             "their source precision; the others are quantized",
             layer, kept_float, 3 * owned.count(), quant_method_name(qc.method));
  else if (kept_float > 0 && opt.experts_format && *opt.experts_format != WeightFormat::kBF16)
    log_warn("layer {}: the checkpoint's {} quantization excludes these experts; they keep their source "
             "precision instead of --experts {}",
             layer, quant_method_name(qc.method), weight_format_name(*opt.experts_format));
  Status valid = opt.ep_comm ? moe::validate_ep_layer(m, ep_size) : m.validate();
  if (!valid.ok()) return std::move(valid).error().with_context("layer " + std::to_string(layer));
  return w;
}

// ---------------------------------------------------------------------------------------------
// Qwen3MoeCpu
// ---------------------------------------------------------------------------------------------

Result<Qwen3MoeCpu> Qwen3MoeCpu::load(const std::string& dir, const Qwen3MoeLoadOptions& options) {
  Qwen3MoeCpu m;
  m.options_ = options;
  MOEBIUS_ASSIGN_OR_RETURN(m.config_, load_qwen3_moe_config(dir));
  MOEBIUS_ASSIGN_OR_RETURN(m.quant_, load_quant_config(dir));
  const Qwen3MoeConfig& c = m.config_;
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsCheckpoint opened, SafetensorsCheckpoint::open(dir));
  auto ck = std::make_shared<const SafetensorsCheckpoint>(std::move(opened));
  m.checkpoint_ = ck;
  const int64_t V = c.vocab_size, H = c.hidden_size;
  MOEBIUS_ASSIGN_OR_RETURN(m.embed_, load_float_tensor(*ck, "model.embed_tokens.weight", Shape{V, H}));
  MOEBIUS_ASSIGN_OR_RETURN(m.norm_, load_float_tensor(*ck, "model.norm.weight", Shape{H}));
  if (!c.tie_word_embeddings) {
    MOEBIUS_ASSIGN_OR_RETURN(m.lm_head_, load_linear_weight(*ck, m.quant_, "lm_head", V, H));
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeLayerWeights w, load_qwen3_moe_layer(ck, c, m.quant_, l, options));
    m.layers_.push_back(std::move(w));
  }
  m.inv_freq_ = rope_frequencies(c).inv_freq;
  return m;
}

namespace {

std::string matrix_layout(const QuantMatrix& m) {
  std::string s = fmt::format("{} [{}, {}]", weight_format_name(m.format), m.rows, m.cols);
  if (m.group_size > 0) s += fmt::format(" group size {}", m.group_size);
  return s;
}

}  // namespace

Result<Qwen3MoeCpu> Qwen3MoeCpu::stage_reload(const std::string& dir) const {
  // The config first: a checkpoint of another geometry is named as such, not by its first
  // misshapen tensor.
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeConfig incoming, load_qwen3_moe_config(dir));
  if (auto st = check_same_config(config_, incoming); !st.ok())
    return std::move(st).error().in_file((std::filesystem::path(dir) / "config.json").string());
  MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeCpu next, load(dir, options_));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Qwen3MoeLayerWeights& a = layers_[l];
    const Qwen3MoeLayerWeights& b = next.layers_[l];
    if (!a.is_moe) continue;  // dense weights are fp32 of the config's shapes either way
    for (size_t e = 0; e < a.moe.experts.size(); ++e) {
      const cpu::ExpertWeights& x = a.moe.experts[e];
      const cpu::ExpertWeights& y = b.moe.experts[e];
      const std::pair<const QuantMatrix*, const QuantMatrix*> pairs[] = {{&x.gate, &y.gate}, {&x.up, &y.up},
                                                                         {&x.down, &y.down}};
      const char* names[] = {"gate_proj", "up_proj", "down_proj"};
      for (int i = 0; i < 3; ++i) {
        const QuantMatrix& m = *pairs[i].first;
        const QuantMatrix& n = *pairs[i].second;
        if (m.format != n.format || m.rows != n.rows || m.cols != n.cols || m.group_size != n.group_size)
          return Error::format("loads as {}, the serving model has {}; a weight update keeps the expert format",
                               matrix_layout(n), matrix_layout(m))
              .in_tensor(fmt::format("model.layers.{}.mlp.experts.{}.{}", l, e, names[i]))
              .in_file(dir);
      }
    }
  }
  return next;
}

void Qwen3MoeCpu::commit_reload(Qwen3MoeCpu&& staged) {
  MOEBIUS_ASSERT(check_same_config(config_, staged.config_).ok(), "commit_reload of an unchecked model");
  *this = std::move(staged);
}

KvCache Qwen3MoeCpu::make_cache(int64_t max_tokens, int block_size) const {
  if (max_tokens <= 0) max_tokens = config_.max_position_embeddings;
  return KvCache(config_.num_hidden_layers, config_.num_key_value_heads, config_.head_dim, max_tokens, block_size);
}

void Qwen3MoeCpu::attention(const Qwen3MoeLayerWeights& w, int layer, const float* h, std::span<const BatchSeq> seqs,
                            const std::vector<int64_t>& positions, float* out) const {
  const Qwen3MoeConfig& c = config_;
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t N = static_cast<int64_t>(positions.size());
  const int64_t H = c.hidden_size, q_dim = int64_t{nh} * hd, kv_dim = int64_t{nkv} * hd;
  std::vector<float> q(static_cast<size_t>(N * q_dim)), k(static_cast<size_t>(N * kv_dim)),
      v(static_cast<size_t>(N * kv_dim)), a(static_cast<size_t>(N * q_dim));
  cpu::linear_reference(h, w.q_proj.data(), N, q_dim, H, q.data());   // [N, nh, hd]
  cpu::linear_reference(h, w.k_proj.data(), N, kv_dim, H, k.data());  // [N, nkv, hd]
  cpu::linear_reference(h, w.v_proj.data(), N, kv_dim, H, v.data());  // [N, nkv, hd]
  // Qwen3's QK-norm: RMSNorm over each head's hd values, before RoPE.
  cpu::rms_norm_reference(q.data(), w.q_norm.data(), N * nh, hd, c.rms_norm_eps, q.data());
  cpu::rms_norm_reference(k.data(), w.k_norm.data(), N * nkv, hd, c.rms_norm_eps, k.data());
  cpu::rope_neox_reference(q.data(), N, nh, hd, positions.data(), inv_freq_.data());
  cpu::rope_neox_reference(k.data(), N, nkv, hd, positions.data(), inv_freq_.data());
  int64_t row = 0;  // the sequence's first token in the batch
  for (const BatchSeq& s : seqs) {
    KvCache& cache = *s.cache;
    const int64_t T = static_cast<int64_t>(s.ids.size()), p0 = cache.position();
    for (int64_t t = 0; t < T; ++t) {  // rows [p0, p0 + T) were reserved by run()
      std::copy_n(k.data() + (row + t) * kv_dim, kv_dim, cache.key(layer, p0 + t));
      std::copy_n(v.data() + (row + t) * kv_dim, kv_dim, cache.value(layer, p0 + t));
    }
    // Causal GQA over the cache rows [0, p0 + T), by row pointers into the paged cache.
    const KvCache& kc = cache;
    std::vector<const float*> k_rows(static_cast<size_t>(p0 + T)), v_rows(static_cast<size_t>(p0 + T));
    for (int64_t j = 0; j < p0 + T; ++j) {
      k_rows[static_cast<size_t>(j)] = kc.key(layer, j);
      v_rows[static_cast<size_t>(j)] = kc.value(layer, j);
    }
    cpu::attention_reference(q.data() + row * q_dim, T, nh, nkv, hd, p0, k_rows.data(), v_rows.data(),
                             a.data() + row * q_dim);
    row += T;
  }
  cpu::linear_reference(a.data(), w.o_proj.data(), N, H, q_dim, out);  // [N, H]
}

Status Qwen3MoeCpu::ep_step_header(int32_t mine, bool* all_done) const {
  parallel::Communicator& comm = *options_.ep_comm;
  std::vector<int32_t> states(static_cast<size_t>(comm.size()));
  MOEBIUS_TRY(comm.all_gather(&mine, states.data(), sizeof(int32_t)));
  *all_done = parallel::summarize_ep_step(states).all_done;
  return Ok{};
}

Status Qwen3MoeCpu::ep_empty_step() const {
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Qwen3MoeLayerWeights& w = layers_[l];
    if (!w.is_moe) continue;
    if (auto st = moe::ep_moe_layer_cpu(*options_.ep_comm, w.moe, options_.ep_payload, nullptr, 0, nullptr); !st.ok())
      return std::move(st).error().with_context("layer " + std::to_string(l));
  }
  return Ok{};
}

Status Qwen3MoeCpu::ep_idle_until_all_done() const {
  if (!options_.ep_comm) return Ok{};
  for (;;) {
    bool all_done = false;
    MOEBIUS_TRY(ep_step_header(parallel::kEpRankDone, &all_done));
    if (all_done) return Ok{};
    MOEBIUS_TRY(ep_empty_step());
  }
}

Status Qwen3MoeCpu::forward(const int32_t* ids, int T, KvCache& cache, float* logits) const {
  if (T <= 0) return Error::format("forward needs at least one token, got {}", T);
  const BatchSeq seq{std::span<const int32_t>(ids, static_cast<size_t>(T)), &cache, true};
  return run(std::span<const BatchSeq>(&seq, 1), /*all_rows=*/true, logits);
}

Status Qwen3MoeCpu::forward_batch(std::span<const BatchSeq> seqs, float* logits) const {
  return run(seqs, /*all_rows=*/false, logits);
}

Status Qwen3MoeCpu::check_batch(std::span<const BatchSeq> seqs) const {
  const Qwen3MoeConfig& c = config_;
  const int64_t V = c.vocab_size;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const BatchSeq& s = seqs[i];
    MOEBIUS_ASSERT(s.cache != nullptr);
    for (size_t j = 0; j < i; ++j) MOEBIUS_ASSERT(seqs[j].cache != s.cache, "two sequences share a KV cache");
    const KvCache& cache = *s.cache;
    const int64_t T = static_cast<int64_t>(s.ids.size());
    if (T <= 0) return Error::format("forward needs at least one token, got {}", T);
    if (cache.num_layers() != c.num_hidden_layers || cache.num_kv_heads() != c.num_key_value_heads ||
        cache.head_dim() != c.head_dim)
      return Error::format("KV cache is shaped for L={} nkv={} hd={}, the model has L={} nkv={} hd={}",
                           cache.num_layers(), cache.num_kv_heads(), cache.head_dim(), c.num_hidden_layers,
                           c.num_key_value_heads, c.head_dim);
    const int64_t p0 = cache.position();
    if (p0 + T > c.context_limit())
      return Error::format("positions up to {} exceed the model's {} positions", p0 + T - 1, c.context_limit());
    if (p0 + T > cache.max_tokens())
      return Error::format("KV cache holds at most {} tokens, {} requested", cache.max_tokens(), p0 + T);
    for (int64_t t = 0; t < T; ++t)
      if (s.ids[static_cast<size_t>(t)] < 0 || s.ids[static_cast<size_t>(t)] >= V)
        return Error::format("token {} is id {}, outside the vocabulary [0, {})", t, s.ids[static_cast<size_t>(t)], V);
  }
  return Ok{};
}

Status Qwen3MoeCpu::run(std::span<const BatchSeq> seqs, bool all_rows, float* logits) const {
  const Qwen3MoeConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  MOEBIUS_ASSERT(!all_rows || seqs.size() == 1);
  parallel::Communicator* ep = options_.ep_comm.get();
  if (seqs.empty() && ep == nullptr) return Error("forward needs at least one sequence");
  // Everything that can fail is checked before any cache changes.
  MOEBIUS_TRY(check_batch(seqs));
  int64_t N = 0;
  for (const BatchSeq& s : seqs) N += static_cast<int64_t>(s.ids.size());
  if (ep != nullptr) {  // every rank learns who runs this step (and that it is one)
    bool all_done = false;
    MOEBIUS_TRY(ep_step_header(static_cast<int32_t>(N), &all_done));
  }
  std::vector<int64_t> positions;  // [N]
  positions.reserve(static_cast<size_t>(N));
  for (const BatchSeq& s : seqs) {
    const int64_t p0 = s.cache->position(), T = static_cast<int64_t>(s.ids.size());
    MOEBIUS_TRY(s.cache->reserve(p0 + T));  // checked above: cannot fail
    for (int64_t t = 0; t < T; ++t) positions.push_back(p0 + t);
  }

  const size_t n = static_cast<size_t>(N * H);
  std::vector<float> x(n), h(n), y(n);  // each [N, H]; x is the residual stream
  {
    int64_t row = 0;
    for (const BatchSeq& s : seqs)
      for (int32_t id : s.ids) std::copy_n(embed_.data() + int64_t{id} * H, H, x.data() + (row++) * H);
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Qwen3MoeLayerWeights& w = layers_[static_cast<size_t>(l)];
    if (N == 0) break;  // an EP rank with no tokens this step: it only serves its experts
    cpu::rms_norm_reference(x.data(), w.input_norm.data(), N, H, c.rms_norm_eps, h.data());
    attention(w, l, h.data(), seqs, positions, y.data());
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
    cpu::rms_norm_reference(x.data(), w.post_norm.data(), N, H, c.rms_norm_eps, h.data());
    if (w.is_moe && ep != nullptr) {
      if (auto st = moe::ep_moe_layer_cpu(*ep, w.moe, options_.ep_payload, h.data(), N, y.data()); !st.ok())
        return std::move(st).error().with_context("layer " + std::to_string(l));
    } else if (w.is_moe) {
      std::vector<int32_t> route_ids;
      std::vector<float> route_w;
      if (routing_observer_) {
        route_ids.resize(static_cast<size_t>(N * w.moe.shape.top_k));
        route_w.resize(route_ids.size());
      }
      if (auto st = w.moe.forward(h.data(), N, y.data(), routing_observer_ ? route_ids.data() : nullptr,
                                  routing_observer_ ? route_w.data() : nullptr);
          !st.ok())
        return std::move(st).error().with_context("layer " + std::to_string(l));
      if (routing_observer_) routing_observer_(l, route_ids.data(), route_w.data(), N);
    } else {  // dense SwiGLU: down(silu(gate h) * up h)
      const int64_t I = c.intermediate_size;
      std::vector<float> g(static_cast<size_t>(N * I)), u(static_cast<size_t>(N * I));
      cpu::linear_reference(h.data(), w.gate_proj.data(), N, I, H, g.data());
      cpu::linear_reference(h.data(), w.up_proj.data(), N, I, H, u.data());
      cpu::swiglu_reference(g.data(), I, u.data(), I, N, I, g.data());
      cpu::linear_reference(g.data(), w.down_proj.data(), N, H, I, y.data());
    }
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
  }
  if (N == 0) {
    MOEBIUS_TRY(ep_empty_step());
    return Ok{};
  }
  cpu::rms_norm_reference(x.data(), norm_.data(), N, H, c.rms_norm_eps, h.data());
  const float* head = (lm_head_.empty() ? embed_ : lm_head_).data();
  if (all_rows) {
    cpu::linear_reference(h.data(), head, N, V, H, logits);  // [N, V]
  } else {  // every row of a sequence with all_logits, the last of one with want_logits: [R, V]
    std::vector<float> last;
    int64_t end = 0;
    for (const BatchSeq& s : seqs) {
      const int64_t begin = end;
      end += static_cast<int64_t>(s.ids.size());
      if (s.all_logits) last.insert(last.end(), h.begin() + begin * H, h.begin() + end * H);
      else if (s.want_logits) last.insert(last.end(), h.begin() + (end - 1) * H, h.begin() + end * H);
    }
    const int64_t R = static_cast<int64_t>(last.size()) / H;
    if (R > 0) cpu::linear_reference(last.data(), head, R, V, H, logits);
  }
  for (const BatchSeq& s : seqs) s.cache->advance(static_cast<int64_t>(s.ids.size()));
  return Ok{};
}

Result<uint64_t> Qwen3MoeCpu::move_cold_experts(const std::vector<int>& moe_layers,
                                                const std::vector<std::vector<uint8_t>>& resident) {
  if (moe_layers.size() != resident.size()) return Error("a placement needs one resident mask per MoE layer");
  std::vector<int> model_moe;
  for (int l = 0; l < config_.num_hidden_layers; ++l)
    if (layers_[static_cast<size_t>(l)].is_moe) model_moe.push_back(l);
  if (moe_layers != model_moe)
    return Error::format("the placement lists {} MoE layers, the model has {}", moe_layers.size(), model_moe.size());
  const size_t E = static_cast<size_t>(config_.num_experts);
  for (const std::vector<uint8_t>& m : resident)
    if (m.size() != E) return Error::format("a resident mask of {} experts for E={}", m.size(), E);
  // Two passes: size the store, allocate it once, then copy and re-point.
  auto parts = [](cpu::ExpertWeights& x) { return std::array<QuantMatrix*, 3>{&x.gate, &x.up, &x.down}; };
  uint64_t bytes = 0;
  auto align = [](uint64_t n) { return (n + 255) / 256 * 256; };  // 256-byte pieces, like the device's
  for (size_t i = 0; i < moe_layers.size(); ++i)
    for (size_t e = 0; e < E; ++e)
      if (!resident[i][e])
        for (QuantMatrix* m : parts(layers_[static_cast<size_t>(moe_layers[i])].moe.experts[e]))
          bytes += align(m->weight.size()) + align(m->scales.size());
  auto store = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(bytes));
  uint64_t off = 0;
  auto copy = [&](std::span<const uint8_t> src) {
    uint8_t* dst = store->data() + off;
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
    off += align(src.size());
    return std::span<const uint8_t>(dst, src.size());
  };
  for (size_t i = 0; i < moe_layers.size(); ++i)
    for (size_t e = 0; e < E; ++e)
      if (!resident[i][e])
        for (QuantMatrix* m : parts(layers_[static_cast<size_t>(moe_layers[i])].moe.experts[e])) {
          m->weight = copy(m->weight);
          m->scales = copy(m->scales);
          m->owner = store;
        }
  MOEBIUS_ASSERT(off == bytes);
  cold_store_ = std::move(store);
  return bytes;
}

}  // namespace moebius::model
