// `moebius bench serve --url http://127.0.0.1:8000 --dataset random --input-len 1024 --output-len 128
//                      --num-prompts 200 [--shared-prefix-len N] [--request-rate inf] [--max-concurrency N]
//                      [--output-file F]`
//
// A load client for an OpenAI-compatible server (ours or any other), printing the metrics SGLang's
// bench_serving prints. Each request is a streamed /v1/completions with a prompt of input-len
// random token ids (so the length is exact whatever the tokenizer) and max_tokens output-len with
// ignore_eos (so is the output). With --shared-prefix-len N every prompt starts with the same N
// random ids (a shared system prompt, as SGLang's generated-shared-prefix dataset), which a server
// with prefix caching computes once; the cached prompt tokens the server reports
// (usage.prompt_tokens_details.cached_tokens) are summed. Requests arrive as a Poisson process of --request-rate per
// second (inf: all at once), at most --max-concurrency in flight.
//   TTFT: send to the first SSE event that carries text; ITL: between such events; TPOT:
//   (E2E - TTFT) / (output tokens - 1); E2E: send to the end of the stream. Output tokens come
//   from the usage chunk (stream_options.include_usage).
// Results are printed as a table and, with --output-file, written as JSON.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "server/http_client.h"

namespace moebius::cli {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct BenchServeOptions {
  std::string url = "http://127.0.0.1:8000";
  std::string model;  // the served model name (required)
  std::string dataset = "random";
  int input_len = 1024;
  int shared_prefix_len = 0;  // leading prompt ids common to every request
  int output_len = 128;
  int num_prompts = 200;
  double request_rate = INFINITY;
  int max_concurrency = 0;  // 0: unbounded
  int vocab_size = 10000;   // random ids are drawn from [0, vocab_size)
  uint64_t seed = 1;
  std::string api_key;
  std::string output_file;
  // Sampling of every request (vLLM's bench serve flags): greedy by default; the filters are sent
  // only when given, so the server's defaults (generation_config.json) apply otherwise.
  double temperature = 0.0;
  std::optional<int> top_k;  // -1: off
  std::optional<double> top_p;
};

struct RequestResult {
  bool ok = false;
  std::string error;
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  int64_t cached_tokens = 0;  // usage.prompt_tokens_details.cached_tokens, when the server sends it
  double ttft = 0, e2e = 0;
  std::vector<double> itl;
  double start = 0, end = 0;  // seconds since the benchmark began
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);  // numpy's linear interpolation
  const size_t lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  return v[lo] + (v[hi] - v[lo]) * (rank - static_cast<double>(lo));
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

RequestResult run_one(const server::HttpUrl& url, const std::string& base, const BenchServeOptions& o,
                      const std::vector<int32_t>& prompt, const std::vector<std::string>& headers, Clock::time_point t0) {
  RequestResult r;
  r.input_tokens = static_cast<int64_t>(prompt.size());
  json body = {{"model", o.model},           {"prompt", prompt}, {"max_tokens", o.output_len},
               {"temperature", o.temperature}, {"stream", true},   {"ignore_eos", true},
               {"stream_options", {{"include_usage", true}}}};
  if (o.top_k) body["top_k"] = *o.top_k;
  if (o.top_p) body["top_p"] = *o.top_p;
  const auto start = Clock::now();
  r.start = std::chrono::duration<double>(start - t0).count();
  auto last = start;
  bool first = true;
  std::string pending;
  auto res = server::http_post(url, base + "/v1/completions", body.dump(), headers, [&](std::string_view data) {
    pending.append(data);
    size_t sep;
    while ((sep = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, sep);
      pending.erase(0, sep + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        r.ok = r.error.empty();
        return true;
      }
      const json j = json::parse(payload, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        r.error = j["error"].value("message", "error event");
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const json& u = j["usage"];
        r.output_tokens = u.value("completion_tokens", 0);
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object())
          r.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", 0);
      }
      if (!j.contains("choices") || j["choices"].empty()) continue;
      const std::string text = j["choices"][0].value("text", "");
      if (text.empty()) continue;
      const auto now = Clock::now();
      if (first) r.ttft = std::chrono::duration<double>(now - start).count();
      else r.itl.push_back(std::chrono::duration<double>(now - last).count());
      first = false;
      last = now;
    }
    return true;
  });
  const auto end = Clock::now();
  r.end = std::chrono::duration<double>(end - t0).count();
  r.e2e = std::chrono::duration<double>(end - start).count();
  if (!res.ok()) {
    r.ok = false;
    r.error = res.error().what();
  } else if (res->status != 200) {
    r.ok = false;
    r.error = fmt::format("HTTP {}: {}", res->status, res->body.substr(0, 200));
  }
  return r;
}

Status run(const BenchServeOptions& o) {
  if (o.dataset != "random") return Error::format("unknown dataset '{}'; expected random", o.dataset).in_field("--dataset");
  if (o.input_len < 1 || o.output_len < 1 || o.num_prompts < 1)
    return Error("--input-len, --output-len and --num-prompts must be >= 1");
  if (!(o.request_rate > 0)) return Error("must be > 0 (inf: all at once)").in_field("--request-rate");
  if (o.shared_prefix_len < 0 || o.shared_prefix_len > o.input_len)
    return Error::format("must be in [0, --input-len {}], got {}", o.input_len, o.shared_prefix_len)
        .in_field("--shared-prefix-len");
  MOEBIUS_ASSIGN_OR_RETURN(server::HttpUrl url, server::parse_http_url(o.url));
  std::vector<std::string> headers;
  if (!o.api_key.empty()) headers.push_back("Authorization: Bearer " + o.api_key);

  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int32_t> tok(0, o.vocab_size - 1);
  std::vector<int32_t> shared;
  for (int i = 0; i < o.shared_prefix_len; ++i) shared.push_back(tok(rng));
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(o.num_prompts));
  for (auto& p : prompts) {
    p = shared;
    for (int i = o.shared_prefix_len; i < o.input_len; ++i) p.push_back(tok(rng));
  }
  std::exponential_distribution<double> gap(std::isinf(o.request_rate) ? 1.0 : o.request_rate);

  std::vector<RequestResult> results(prompts.size());
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0, peak = 0;
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  auto next = t0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (!std::isinf(o.request_rate)) {
      next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
      std::this_thread::sleep_until(next);
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return o.max_concurrency <= 0 || in_flight < o.max_concurrency; });
      peak = std::max(peak, ++in_flight);
    }
    threads.emplace_back([&, i] {
      results[i] = run_one(url, url.path, o, prompts[i], headers, t0);
      std::lock_guard<std::mutex> lock(mu);
      --in_flight;
      cv.notify_all();
    });
  }
  for (std::thread& t : threads) t.join();
  const double duration = std::chrono::duration<double>(Clock::now() - t0).count();

  std::vector<double> ttft, tpot, itl, e2e;
  int64_t in_tok = 0, out_tok = 0, cached_tok = 0;
  int ok = 0;
  std::string first_error;
  for (const RequestResult& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++ok;
    in_tok += r.input_tokens;
    out_tok += r.output_tokens;
    cached_tok += r.cached_tokens;
    ttft.push_back(r.ttft * 1e3);
    e2e.push_back(r.e2e * 1e3);
    for (double x : r.itl) itl.push_back(x * 1e3);
    if (r.output_tokens > 1) tpot.push_back((r.e2e - r.ttft) * 1e3 / static_cast<double>(r.output_tokens - 1));
  }
  // Concurrency as SGLang reports it: the sum of request latencies over the duration.
  double latency_sum = 0;
  for (double x : e2e) latency_sum += x / 1e3;

  std::string out;
  const auto row = [&](const std::string& k, const std::string& v) { out += fmt::format("{:<41}{}\n", k, v); };
  const auto num = [&](const std::string& k, double v) { row(k, fmt::format("{:.2f}", v)); };
  out += "============ Serving Benchmark Result ============\n";
  row("Backend:", "moebius");
  row("Traffic request rate:", std::isinf(o.request_rate) ? "inf" : fmt::format("{}", o.request_rate));
  row("Max request concurrency:", o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "not set");
  row("Sampling:", fmt::format("{}, top_k {}, top_p {}",
                               o.temperature == 0.0 ? std::string("greedy") : fmt::format("temperature {}", o.temperature),
                               o.top_k ? std::to_string(*o.top_k) : "server default",
                               o.top_p ? fmt::format("{}", *o.top_p) : "server default"));
  row("Successful requests:", std::to_string(ok));
  num("Benchmark duration (s):", duration);
  row("Total input tokens:", std::to_string(in_tok));
  row("Total generated tokens:", std::to_string(out_tok));
  row("Total cached input tokens:", std::to_string(cached_tok));
  num("Request throughput (req/s):", ok / duration);
  num("Input token throughput (tok/s):", static_cast<double>(in_tok) / duration);
  num("Output token throughput (tok/s):", static_cast<double>(out_tok) / duration);
  num("Total token throughput (tok/s):", static_cast<double>(in_tok + out_tok) / duration);
  num("Concurrency:", latency_sum / duration);
  row("Peak concurrency:", std::to_string(peak));
  const auto section = [&](const char* title, const char* name, const std::vector<double>& v) {
    out += fmt::format("{:-^50}\n", title);
    num(fmt::format("Mean {} (ms):", name), mean(v));
    num(fmt::format("Median {} (ms):", name), percentile(v, 50));
    num(fmt::format("P90 {} (ms):", name), percentile(v, 90));
    num(fmt::format("P99 {} (ms):", name), percentile(v, 99));
  };
  section("End-to-End Latency", "E2E Latency", e2e);
  section("Time to First Token", "TTFT", ttft);
  section("Time per Output Token (excl. 1st token)", "TPOT", tpot);
  section("Inter-Token Latency", "ITL", itl);
  out += "==================================================\n";
  std::fputs(out.c_str(), stdout);
  if (ok < o.num_prompts)
    std::fprintf(stderr, "%d of %d requests failed; the first: %s\n", o.num_prompts - ok, o.num_prompts,
                 first_error.c_str());

  if (!o.output_file.empty()) {
    json j = {{"backend", "moebius"},
              {"dataset_name", o.dataset},
              {"request_rate", std::isinf(o.request_rate) ? json("inf") : json(o.request_rate)},
              {"max_concurrency", o.max_concurrency > 0 ? json(o.max_concurrency) : json(nullptr)},
              {"random_input_len", o.input_len},
              {"shared_prefix_len", o.shared_prefix_len},
              {"total_cached_input_tokens", cached_tok},
              {"random_output_len", o.output_len},
              {"num_prompts", o.num_prompts},
              {"completed", ok},
              {"duration", duration},
              {"total_input_tokens", in_tok},
              {"total_output_tokens", out_tok},
              {"request_throughput", ok / duration},
              {"input_throughput", static_cast<double>(in_tok) / duration},
              {"output_throughput", static_cast<double>(out_tok) / duration},
              {"concurrency", latency_sum / duration},
              {"peak_concurrency", peak}};
    const std::pair<const char*, const std::vector<double>*> series[] = {
        {"e2e_latency", &e2e}, {"ttft", &ttft}, {"tpot", &tpot}, {"itl", &itl}};
    for (const auto& [name, v] : series) {
      j[fmt::format("mean_{}_ms", name)] = mean(*v);
      j[fmt::format("median_{}_ms", name)] = percentile(*v, 50);
      j[fmt::format("p90_{}_ms", name)] = percentile(*v, 90);
      j[fmt::format("p99_{}_ms", name)] = percentile(*v, 99);
    }
    std::ofstream f(o.output_file);
    if (!f) return Error("cannot write the file").in_file(o.output_file);
    f << j.dump(2) << "\n";
  }
  return Ok{};
}

}  // namespace

void register_bench_serve(CLI::App& bench) {
  auto o = std::make_shared<BenchServeOptions>();
  CLI::App* cmd = bench.add_subcommand("serve", "load-test an OpenAI-compatible server (SGLang bench_serving metrics)");
  cmd->add_option("--url", o->url, "server base URL")->capture_default_str();
  cmd->add_option("--model", o->model, "the served model name")->required();
  cmd->add_option("--dataset", o->dataset, "random (random token ids)")->capture_default_str();
  cmd->add_option("--input-len", o->input_len, "prompt tokens per request")->capture_default_str();
  cmd->add_option("--shared-prefix-len", o->shared_prefix_len,
                  "leading prompt tokens every request shares (a system prompt for prefix caching)")
      ->capture_default_str();
  cmd->add_option("--output-len", o->output_len, "generated tokens per request (ignore_eos)")->capture_default_str();
  cmd->add_option("--num-prompts", o->num_prompts, "requests")->capture_default_str();
  cmd->add_option("--request-rate", o->request_rate, "Poisson arrivals per second; inf: all at once");
  cmd->add_option("--max-concurrency", o->max_concurrency, "requests in flight at most; 0: unbounded")
      ->capture_default_str();
  cmd->add_option("--vocab-size", o->vocab_size, "random prompt ids are drawn from [0, N)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "prompt RNG seed")->capture_default_str();
  cmd->add_option("--api-key", o->api_key, "sent as 'Authorization: Bearer KEY'");
  cmd->add_option("--output-file", o->output_file, "write the results as JSON");
  cmd->add_option("--temperature", o->temperature, "sampling temperature of every request; 0: greedy")
      ->check(CLI::Range(0.0, 2.0))
      ->capture_default_str();
  cmd->add_option("--top-k", o->top_k, "top_k of every request (-1: off); not sent unless given")
      ->check(CLI::Range(-1, 1 << 30));
  cmd->add_option("--top-p", o->top_p, "top_p of every request, in (0, 1]; not sent unless given")
      ->check(CLI::Range(1e-9, 1.0));
  cmd->final_callback([o] {
    Status s = run(*o);
    if (!s.ok()) {
      std::fprintf(stderr, "moebius bench serve: error: %s\n", s.error().what().c_str());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace moebius::cli
