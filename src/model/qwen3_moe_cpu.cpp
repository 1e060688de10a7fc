#include "model/qwen3_moe_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "cpu/linear.h"
#include "formats/safetensors.h"

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

Result<std::vector<float>> load_f32(const SafetensorsCheckpoint& ck, const std::string& name, const Shape& shape) {
  MOEBIUS_ASSIGN_OR_RETURN(TensorView v, get_float_tensor(ck, name, shape));
  return to_f32(v);
}

// One expert projection [rows, cols] as a QuantMatrix (see the header for the format choice).
Result<QuantMatrix> load_expert_matrix(const std::shared_ptr<const SafetensorsCheckpoint>& ck, const std::string& name,
                                       int64_t rows, int64_t cols, const Qwen3MoeLoadOptions& opt) {
  MOEBIUS_ASSIGN_OR_RETURN(TensorView v, get_float_tensor(*ck, name, Shape{rows, cols}));
  const bool keep_bf16 = v.dtype == DType::kBF16 && (!opt.experts_format || *opt.experts_format == WeightFormat::kBF16);
  if (keep_bf16) {  // zero copy: the matrix points into the mmap, which `owner` keeps alive
    QuantMatrix m;
    m.format = WeightFormat::kBF16;
    m.rows = rows;
    m.cols = cols;
    m.weight = std::span<const uint8_t>(static_cast<const uint8_t*>(v.data), v.nbytes());
    m.owner = ck;
    MOEBIUS_TRY(m.validate());
    return m;
  }
  const WeightFormat f = opt.experts_format.value_or(WeightFormat::kF32);
  const int group = f == WeightFormat::kNvFp4 ? 16 : is_int_format(f) ? opt.experts_group_size : 0;
  const std::vector<float> w = to_f32(v);
  auto q = quantize(f, w.data(), rows, cols, group);
  if (!q.ok()) return std::move(q).error().in_tensor(name).in_file(ck->path());
  return q;
}

Result<Qwen3MoeLayerWeights> load_layer(const std::shared_ptr<const SafetensorsCheckpoint>& ck,
                                        const Qwen3MoeConfig& c, int layer, const Qwen3MoeLoadOptions& opt) {
  const SafetensorsCheckpoint& k = *ck;
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const int64_t H = c.hidden_size, hd = c.head_dim, q_dim = int64_t{c.num_attention_heads} * hd,
                kv_dim = int64_t{c.num_key_value_heads} * hd;
  Qwen3MoeLayerWeights w;
  MOEBIUS_ASSIGN_OR_RETURN(w.input_norm, load_f32(k, p + "input_layernorm.weight", Shape{H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.post_norm, load_f32(k, p + "post_attention_layernorm.weight", Shape{H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.q_proj, load_f32(k, p + "self_attn.q_proj.weight", Shape{q_dim, H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.k_proj, load_f32(k, p + "self_attn.k_proj.weight", Shape{kv_dim, H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.v_proj, load_f32(k, p + "self_attn.v_proj.weight", Shape{kv_dim, H}));
  MOEBIUS_ASSIGN_OR_RETURN(w.o_proj, load_f32(k, p + "self_attn.o_proj.weight", Shape{H, q_dim}));
  MOEBIUS_ASSIGN_OR_RETURN(w.q_norm, load_f32(k, p + "self_attn.q_norm.weight", Shape{hd}));
  MOEBIUS_ASSIGN_OR_RETURN(w.k_norm, load_f32(k, p + "self_attn.k_norm.weight", Shape{hd}));
  w.is_moe = c.is_moe_layer(layer);
  if (!w.is_moe) {
    const int64_t I = c.intermediate_size;
    MOEBIUS_ASSIGN_OR_RETURN(w.gate_proj, load_f32(k, p + "mlp.gate_proj.weight", Shape{I, H}));
    MOEBIUS_ASSIGN_OR_RETURN(w.up_proj, load_f32(k, p + "mlp.up_proj.weight", Shape{I, H}));
    MOEBIUS_ASSIGN_OR_RETURN(w.down_proj, load_f32(k, p + "mlp.down_proj.weight", Shape{H, I}));
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
  MOEBIUS_ASSIGN_OR_RETURN(m.router_weight, load_f32(k, p + "mlp.gate.weight", Shape{E, H}));
  m.experts.resize(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
    cpu::ExpertWeights& x = m.experts[static_cast<size_t>(e)];
    MOEBIUS_ASSIGN_OR_RETURN(x.gate, load_expert_matrix(ck, q + "gate_proj.weight", I, H, opt));
    MOEBIUS_ASSIGN_OR_RETURN(x.up, load_expert_matrix(ck, q + "up_proj.weight", I, H, opt));
    MOEBIUS_ASSIGN_OR_RETURN(x.down, load_expert_matrix(ck, q + "down_proj.weight", H, I, opt));
  }
  if (auto st = m.validate(); !st.ok()) return std::move(st).error().with_context("layer " + std::to_string(layer));
  return w;
}

// ---------------------------------------------------------------------------------------------
// fp32 ops
// ---------------------------------------------------------------------------------------------

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, for `rows` rows of n. In place is fine.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(n)) + eps);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = xr[i] * inv * w[i];
  }
}

// RoPE, neox layout, on x [T, heads, hd] at positions p0 + t: the pair (x[i], x[i + hd/2]) is
// rotated by angle p * inv_freq[i]. The angle is formed in fp32 as transformers does, so long
// positions round the same way; cos/sin of that angle are exact.
void rope(float* x, int64_t T, int heads, int hd, int64_t p0, const std::vector<float>& inv_freq) {
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float pos = static_cast<float>(p0 + t);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[static_cast<size_t>(i)];
      const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
      const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
      for (int h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * hd;
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Qwen3MoeCpu
// ---------------------------------------------------------------------------------------------

Result<Qwen3MoeCpu> Qwen3MoeCpu::load(const std::string& dir, const Qwen3MoeLoadOptions& options) {
  Qwen3MoeCpu m;
  MOEBIUS_ASSIGN_OR_RETURN(m.config_, load_qwen3_moe_config(dir));
  const Qwen3MoeConfig& c = m.config_;
  MOEBIUS_ASSIGN_OR_RETURN(SafetensorsCheckpoint opened, SafetensorsCheckpoint::open(dir));
  auto ck = std::make_shared<const SafetensorsCheckpoint>(std::move(opened));
  m.checkpoint_ = ck;
  const int64_t V = c.vocab_size, H = c.hidden_size;
  MOEBIUS_ASSIGN_OR_RETURN(m.embed_, load_f32(*ck, "model.embed_tokens.weight", Shape{V, H}));
  MOEBIUS_ASSIGN_OR_RETURN(m.norm_, load_f32(*ck, "model.norm.weight", Shape{H}));
  if (!c.tie_word_embeddings) {
    MOEBIUS_ASSIGN_OR_RETURN(m.lm_head_, load_f32(*ck, "lm_head.weight", Shape{V, H}));
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    MOEBIUS_ASSIGN_OR_RETURN(Qwen3MoeLayerWeights w, load_layer(ck, c, l, options));
    m.layers_.push_back(std::move(w));
  }
  // inv_freq[i] = theta^(-2i / hd), rounded to fp32 as transformers stores it.
  for (int i = 0; i < c.head_dim / 2; ++i)
    m.inv_freq_.push_back(static_cast<float>(std::pow(c.rope_theta, -2.0 * i / c.head_dim)));
  return m;
}

KvCache Qwen3MoeCpu::make_cache(int64_t max_tokens, int block_size) const {
  if (max_tokens <= 0) max_tokens = config_.max_position_embeddings;
  return KvCache(config_.num_hidden_layers, config_.num_key_value_heads, config_.head_dim, max_tokens, block_size);
}

Status Qwen3MoeCpu::attention(const Qwen3MoeLayerWeights& w, int layer, const float* h, int T, int64_t p0,
                              KvCache& cache, float* out) const {
  const Qwen3MoeConfig& c = config_;
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t H = c.hidden_size, q_dim = int64_t{nh} * hd, kv_dim = int64_t{nkv} * hd;
  std::vector<float> q(static_cast<size_t>(T * q_dim)), k(static_cast<size_t>(T * kv_dim)),
      v(static_cast<size_t>(T * kv_dim)), a(static_cast<size_t>(T * q_dim));
  cpu::linear_reference(h, w.q_proj.data(), T, q_dim, H, q.data());   // [T, nh, hd]
  cpu::linear_reference(h, w.k_proj.data(), T, kv_dim, H, k.data());  // [T, nkv, hd]
  cpu::linear_reference(h, w.v_proj.data(), T, kv_dim, H, v.data());  // [T, nkv, hd]
  // Qwen3's QK-norm: RMSNorm over each head's hd values, before RoPE.
  rms_norm(q.data(), w.q_norm.data(), int64_t{T} * nh, hd, c.rms_norm_eps, q.data());
  rms_norm(k.data(), w.k_norm.data(), int64_t{T} * nkv, hd, c.rms_norm_eps, k.data());
  rope(q.data(), T, nh, hd, p0, inv_freq_);
  rope(k.data(), T, nkv, hd, p0, inv_freq_);
  for (int t = 0; t < T; ++t) {  // rows [p0, p0 + T) were reserved by forward()
    std::copy_n(k.data() + t * kv_dim, kv_dim, cache.key(layer, p0 + t));
    std::copy_n(v.data() + t * kv_dim, kv_dim, cache.value(layer, p0 + t));
  }
  // Causal GQA: query head qh reads KV head qh / (nh / nkv); token t sees positions [0, p0 + t].
  const int group = nh / nkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const KvCache& kc = cache;
#pragma omp parallel for collapse(2) schedule(static)
  for (int t = 0; t < T; ++t)
    for (int qh = 0; qh < nh; ++qh) {
      const int64_t last = p0 + t;
      const int kvh = qh / group;
      const float* qv = q.data() + (int64_t{t} * nh + qh) * hd;
      std::vector<double> p(static_cast<size_t>(last + 1));
      double mx = -INFINITY;
      for (int64_t j = 0; j <= last; ++j) {
        const float* kv = kc.key(layer, j) + int64_t{kvh} * hd;
        double s = 0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(qv[d]) * kv[d];
        p[static_cast<size_t>(j)] = s * scale;
        mx = std::max(mx, s * scale);
      }
      double sum = 0;
      for (double& x : p) sum += (x = std::exp(x - mx));
      std::vector<double> acc(static_cast<size_t>(hd), 0.0);
      for (int64_t j = 0; j <= last; ++j) {
        const float* vv = kc.value(layer, j) + int64_t{kvh} * hd;
        const double pj = p[static_cast<size_t>(j)] / sum;
        for (int d = 0; d < hd; ++d) acc[static_cast<size_t>(d)] += pj * vv[d];
      }
      float* o = a.data() + (int64_t{t} * nh + qh) * hd;
      for (int d = 0; d < hd; ++d) o[d] = static_cast<float>(acc[static_cast<size_t>(d)]);
    }
  cpu::linear_reference(a.data(), w.o_proj.data(), T, H, q_dim, out);  // [T, H]
  return Ok{};
}

Status Qwen3MoeCpu::forward(const int32_t* ids, int T, KvCache& cache, float* logits) const {
  const Qwen3MoeConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  if (T <= 0) return Error::format("forward needs at least one token, got {}", T);
  if (cache.num_layers() != c.num_hidden_layers || cache.num_kv_heads() != c.num_key_value_heads ||
      cache.head_dim() != c.head_dim)
    return Error::format("KV cache is shaped for L={} nkv={} hd={}, the model has L={} nkv={} hd={}",
                         cache.num_layers(), cache.num_kv_heads(), cache.head_dim(), c.num_hidden_layers,
                         c.num_key_value_heads, c.head_dim);
  const int64_t p0 = cache.position();
  if (p0 + T > c.max_position_embeddings)
    return Error::format("positions up to {} exceed max_position_embeddings {}", p0 + T - 1, c.max_position_embeddings);
  for (int t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= V) return Error::format("token {} is id {}, outside the vocabulary [0, {})", t, ids[t], V);
  MOEBIUS_TRY(cache.reserve(p0 + T));

  const size_t n = static_cast<size_t>(T * H);
  std::vector<float> x(n), h(n), y(n);  // each [T, H]; x is the residual stream
  for (int t = 0; t < T; ++t) std::copy_n(embed_.data() + int64_t{ids[t]} * H, H, x.data() + t * H);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const Qwen3MoeLayerWeights& w = layers_[static_cast<size_t>(l)];
    rms_norm(x.data(), w.input_norm.data(), T, H, c.rms_norm_eps, h.data());
    MOEBIUS_TRY(attention(w, l, h.data(), T, p0, cache, y.data()));
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
    rms_norm(x.data(), w.post_norm.data(), T, H, c.rms_norm_eps, h.data());
    if (w.is_moe) {
      if (auto st = w.moe.forward(h.data(), T, y.data()); !st.ok())
        return std::move(st).error().with_context("layer " + std::to_string(l));
    } else {  // dense SwiGLU: down(silu(gate h) * up h)
      const int64_t I = c.intermediate_size;
      std::vector<float> g(static_cast<size_t>(T * I)), u(static_cast<size_t>(T * I));
      cpu::linear_reference(h.data(), w.gate_proj.data(), T, I, H, g.data());
      cpu::linear_reference(h.data(), w.up_proj.data(), T, I, H, u.data());
      for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
      cpu::linear_reference(g.data(), w.down_proj.data(), T, H, I, y.data());
    }
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
  }
  rms_norm(x.data(), norm_.data(), T, H, c.rms_norm_eps, h.data());
  cpu::linear_reference(h.data(), (lm_head_.empty() ? embed_ : lm_head_).data(), T, V, H, logits);  // [T, V]
  cache.advance(T);
  return Ok{};
}

}  // namespace moebius::model
