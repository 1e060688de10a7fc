// The teacher-forced logprob oracle (model/eval_logprobs.h, `moebius eval logprobs`) on the tiny
// Qwen3-MoE fixture.
//
// The reference tests/data/tiny-qwen3-moe/logprobs_ref.safetensors is HF transformers' output:
// tools/fixtures/make_logprob_ref.py --from-reference took the log-softmax (in double) of the
// fixture's stored fp32 transformers logits (reference.safetensors `logits`) at the next ids.
// Bounds: the CPU backend matches those logits to ~1e-6, so max |Δlogprob| <= 2 * 1e-5 is loose
// (measured 9.5e-7); a dump compared with itself is exactly 0; nvfp4 experts against the bf16 dump
// give a nonzero delta (measured max 0.18), bounded here by 1.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "model/eval_logprobs.h"
#include "test_util.h"

namespace moebius::model {
namespace {

const std::string kDir = moebius::testing::test_data_dir() + "/tiny-qwen3-moe";
const std::string kRef = kDir + "/logprobs_ref.safetensors";
constexpr int64_t kVocab = 512;
constexpr double kTransformersTol = 2e-5;

Qwen3MoeCpu load_cpu(std::optional<WeightFormat> experts = {}) {
  Qwen3MoeLoadOptions o;
  o.experts_format = experts;
  auto m = Qwen3MoeCpu::load(kDir, o);
  EXPECT_TRUE(m.ok()) << m.error().what();
  return std::move(m).value();
}

TEST(EvalLogprobs, LogSoftmaxAt) {
  const std::vector<float> row = {1.0f, 2.0f, 3.0f};
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0));
  EXPECT_NEAR(log_softmax_at(row, 0), 1.0 - lse, 1e-12);
  EXPECT_NEAR(log_softmax_at(row, 2), 3.0 - lse, 1e-12);
  // Large logits do not overflow (max-shifted).
  const std::vector<float> big = {1000.0f, 1000.0f};
  EXPECT_NEAR(log_softmax_at(big, 1), -std::log(2.0), 1e-12);
}

TEST(EvalLogprobs, CommittedRefIsTheLogSoftmaxOfTransformersLogits) {
  auto ref = read_logprob_dump(kRef);
  ASSERT_TRUE(ref.ok()) << ref.error().what();
  auto f = SafetensorsFile::open(kDir + "/reference.safetensors");
  ASSERT_TRUE(f.ok()) << f.error().what();
  auto ids = f->get("input_ids", DType::kI64, Shape{20});
  auto lg = f->get("logits", DType::kF32, Shape{20, kVocab});
  ASSERT_TRUE(ids.ok() && lg.ok());
  std::vector<int64_t> ids64(20);
  std::memcpy(ids64.data(), ids->data, 20 * sizeof(int64_t));
  std::vector<float> logits(static_cast<size_t>(20 * kVocab));
  std::memcpy(logits.data(), lg->data, logits.size() * sizeof(float));
  std::vector<int32_t> ids32(ids64.begin(), ids64.end());
  EXPECT_EQ(ref->input_ids, ids32);
  std::vector<float> want;
  append_next_token_logprobs(logits, kVocab, ids32, 0, want);
  ASSERT_EQ(want.size(), 19u);
  auto cmp = compare_logprobs(want, ref->logprobs);
  ASSERT_TRUE(cmp.ok());
  EXPECT_LE(cmp->max_abs_delta, 1e-6);  // python's double log-softmax vs ours, both rounded to fp32
  EXPECT_EQ(ref->metadata.at("format"), kLogprobDumpFormat);
}

TEST(EvalLogprobs, CpuBackendMatchesTransformers) {
  auto ref = read_logprob_dump(kRef);
  ASSERT_TRUE(ref.ok()) << ref.error().what();
  const Qwen3MoeCpu m = load_cpu();
  auto got = teacher_forced_logprobs(m, ref->input_ids);
  ASSERT_TRUE(got.ok()) << got.error().what();
  auto cmp = compare_logprobs(*got, ref->logprobs);
  ASSERT_TRUE(cmp.ok());
  std::printf("cpu vs transformers: mean |dlogprob| %.3g, max %.3g at %lld\n", cmp->mean_abs_delta,
              cmp->max_abs_delta, static_cast<long long>(cmp->max_index));
  EXPECT_LE(cmp->max_abs_delta, kTransformersTol);
  EXPECT_NEAR(cmp->mean_logprob, cmp->ref_mean_logprob, kTransformersTol);
  // Chunked prefill (the KV cache kept between chunks) gives the same logprobs.
  for (int chunk : {1, 7, 19}) {
    auto c = teacher_forced_logprobs(m, ref->input_ids, chunk);
    ASSERT_TRUE(c.ok()) << c.error().what();
    auto d = compare_logprobs(*c, *got);
    ASSERT_TRUE(d.ok());
    EXPECT_LE(d->max_abs_delta, 1e-6) << "chunk " << chunk;
  }
}

TEST(EvalLogprobs, DumpRoundTripIsExact) {
  auto ref = read_logprob_dump(kRef);
  ASSERT_TRUE(ref.ok());
  EvalLogprobsOptions o;
  o.model_dir = kDir;
  auto got = run_eval_logprobs(o, ref->input_ids);
  ASSERT_TRUE(got.ok()) << got.error().what();
  LogprobDump d{ref->input_ids, *got, {{"backend", "cpu"}}};
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("moebius_eval_roundtrip_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  ASSERT_TRUE(write_logprob_dump(d, path).ok());
  auto back = read_logprob_dump(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(back.ok()) << back.error().what();
  EXPECT_EQ(back->input_ids, d.input_ids);
  EXPECT_EQ(back->metadata.at("backend"), "cpu");
  EXPECT_EQ(back->metadata.at("format"), kLogprobDumpFormat);
  auto again = run_eval_logprobs(o, back->input_ids);
  ASSERT_TRUE(again.ok());
  auto cmp = compare_logprobs(*again, back->logprobs);
  ASSERT_TRUE(cmp.ok());
  EXPECT_EQ(cmp->max_abs_delta, 0.0);
  EXPECT_EQ(cmp->mean_abs_delta, 0.0);
}

TEST(EvalLogprobs, Nvfp4ExpertsAgainstTheBf16Dump) {
  auto ref = read_logprob_dump(kRef);
  ASSERT_TRUE(ref.ok());
  auto bf16 = teacher_forced_logprobs(load_cpu(WeightFormat::kBF16), ref->input_ids);
  auto fp4 = teacher_forced_logprobs(load_cpu(WeightFormat::kNvFp4), ref->input_ids);
  ASSERT_TRUE(bf16.ok() && fp4.ok());
  auto cmp = compare_logprobs(*fp4, *bf16);
  ASSERT_TRUE(cmp.ok());
  std::printf("nvfp4 vs bf16: mean |dlogprob| %.3g, max %.3g\n", cmp->mean_abs_delta, cmp->max_abs_delta);
  EXPECT_TRUE(std::isfinite(cmp->max_abs_delta));
  EXPECT_GT(cmp->max_abs_delta, 0.0);
  EXPECT_LT(cmp->max_abs_delta, 1.0);
}

// A dump with the given tensors, parsed in memory.
struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};
template <typename T>
Tensor tensor(std::string name, DType dtype, std::vector<T> values) {
  Tensor t{std::move(name), dtype, Shape{static_cast<int64_t>(values.size())}, {}};
  t.bytes.resize(values.size() * sizeof(T));
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

Result<LogprobDump> parse(const std::vector<Tensor>& tensors) {
  SafetensorsWriter w;
  for (const Tensor& t : tensors) EXPECT_TRUE(w.add(t.name, t.dtype, t.shape, t.bytes).ok());
  auto bytes = w.serialize();
  EXPECT_TRUE(bytes.ok());
  static std::vector<uint8_t> keep;  // parse() borrows the bytes
  keep = std::move(bytes).value();
  auto f = SafetensorsFile::parse(keep, "bad.safetensors");
  EXPECT_TRUE(f.ok()) << f.error().what();
  return parse_logprob_dump(*f);
}

void expect_error(const Result<LogprobDump>& r, const std::vector<std::string>& needles) {
  ASSERT_FALSE(r.ok());
  for (const std::string& n : needles) EXPECT_NE(r.error().what().find(n), std::string::npos) << r.error().what();
}

TEST(EvalLogprobs, MalformedDumpsAreErrorsNamingTheTensor) {
  const auto ids = tensor<int32_t>("input_ids", DType::kI32, {1, 2, 3});
  const auto lps = tensor<float>("logprobs", DType::kF32, {-1.0f, -2.0f});
  ASSERT_TRUE(parse({ids, lps}).ok());
  expect_error(parse({lps}), {"input_ids", "missing"});
  expect_error(parse({ids}), {"logprobs", "missing"});
  expect_error(parse({tensor<int64_t>("input_ids", DType::kI64, {1, 2, 3}), lps}), {"input_ids", "I64", "I32"});
  expect_error(parse({ids, tensor<double>("logprobs", DType::kF64, {-1.0, -2.0})}), {"logprobs", "F64"});
  expect_error(parse({ids, tensor<float>("logprobs", DType::kF32, {-1.0f, -2.0f, -3.0f})}), {"logprobs", "[2]"});
  expect_error(parse({tensor<int32_t>("input_ids", DType::kI32, {1}), tensor<float>("logprobs", DType::kF32, {})}),
               {"input_ids", "at least 2"});
  expect_error(parse({ids, tensor<float>("logprobs", DType::kF32, {-1.0f, NAN})}), {"logprobs[1]"});
  expect_error(parse({ids, tensor<float>("logprobs", DType::kF32, {0.5f, -1.0f})}), {"logprobs[0]"});
  Tensor ids2d = ids;
  ids2d.shape = Shape{1, 3};
  expect_error(parse({ids2d, lps}), {"input_ids", "rank 1"});
  // A missing file names the file.
  auto r = read_logprob_dump(kDir + "/no-such-dump.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().what().find("no-such-dump"), std::string::npos) << r.error().what();
}

TEST(EvalLogprobs, BadIdsAndOptionsAreErrors) {
  EvalLogprobsOptions o;
  o.model_dir = kDir;
  o.ids_field = "--prompt-ids";
  const auto fails_naming = [&](const EvalLogprobsOptions& opt, const std::vector<int32_t>& ids,
                                const std::vector<std::string>& needles) {
    auto r = run_eval_logprobs(opt, ids);
    ASSERT_FALSE(r.ok()) << needles[0];
    for (const std::string& n : needles) EXPECT_NE(r.error().what().find(n), std::string::npos) << r.error().what();
  };
  fails_naming(o, {1, 512}, {"--prompt-ids", "512", "vocabulary"});
  fails_naming(o, {-1, 2}, {"--prompt-ids", "-1"});
  fails_naming(o, {1}, {"--prompt-ids", "at least 2"});
  fails_naming(o, std::vector<int32_t>(257, 1), {"--prompt-ids", "257", "context is 256"});
  EvalLogprobsOptions b = o;
  b.backend = "tpu";
  fails_naming(b, {1, 2}, {"--backend"});
  b = o;
  b.experts = "fp3";
  fails_naming(b, {1, 2}, {"--experts"});
  b = o;
  b.chunk = 0;
  fails_naming(b, {1, 2}, {"--chunk"});
  // compare_logprobs refuses different lengths.
  const std::vector<float> a = {-1.0f, -2.0f}, c = {-1.0f};
  EXPECT_FALSE(compare_logprobs(a, c).ok());
}

// ---- the real binary -------------------------------------------------------------------------

using testing::CliRun;
CliRun run_moebius(const std::string& args) { return testing::run_shell(std::string(MOEBIUS_BIN) + " " + args); }

TEST(EvalLogprobsCli, EndToEndThroughTheBinary) {
  if (!std::filesystem::exists(MOEBIUS_BIN)) GTEST_SKIP() << MOEBIUS_BIN << " not built";
  const std::string model = " --model " + kDir;
  CliRun r = run_moebius("eval logprobs" + model + " --ref " + kRef + " --max-delta 2e-5");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("tokens:           20 (19 scored)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max |dlogprob|:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("perplexity:"), std::string::npos) << r.out;

  // bf16 dump -> nvfp4 against it: a nonzero delta; --max-delta 0 turns it into exit 1.
  const std::string dump = (std::filesystem::temp_directory_path() /
                            ("moebius_eval_cli_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  r = run_moebius("eval logprobs" + model + " --prompt-ids 1,17,301,5,99,42 --experts bf16 --dump " + dump);
  ASSERT_EQ(r.status, 0) << r.out;
  r = run_moebius("eval logprobs" + model + " --ref " + dump + " --experts bf16 --max-delta 0");
  EXPECT_EQ(r.status, 0) << r.out;  // the same configuration: exactly 0
  EXPECT_NE(r.out.find("max |dlogprob|:   0 at"), std::string::npos) << r.out;
  r = run_moebius("eval logprobs" + model + " --ref " + dump + " --experts nvfp4 --chunk 2");
  EXPECT_EQ(r.status, 0) << r.out;  // large deltas alone are not errors
  r = run_moebius("eval logprobs" + model + " --ref " + dump + " --experts nvfp4 --max-delta 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("exceeds --max-delta"), std::string::npos) << r.out;
  std::filesystem::remove(dump);

  // Errors: exit 2 with a message naming the problem.
  r = run_moebius("eval logprobs" + model + " --prompt-ids 1,600");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--prompt-ids"), std::string::npos) << r.out;
  r = run_moebius("eval logprobs" + model + " --ref " + kDir + "/reference.safetensors");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("tensor 'logprobs': missing"), std::string::npos) << r.out;  // logits, not a dump
  r = run_moebius("eval logprobs" + model + " --ref " + kRef + " --prompt-ids 1,2");
  EXPECT_EQ(r.status, 2) << r.out;
  r = run_moebius("eval logprobs" + model + " --prompt-ids 1,2 --max-delta 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--max-delta"), std::string::npos) << r.out;
  r = run_moebius("eval logprobs" + model + " --prompt hello");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("tokenizer"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moebius::model
