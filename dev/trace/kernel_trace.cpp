// Kernel timeline of a CUDA program through CUPTI's activity API, for the GPU machine, which has
// no Nsight Systems: LD_PRELOAD it into any moebius command, e.g.
//   LD_PRELOAD=./libmoebius_kernel_trace.so moebius bench generate --context 1024 ...
// At exit it prints, for the graph launches with the most kernels (the decode steps), where the
// step's time goes: each kernel's "marginal" time, end_i - max(end_j, j < i) in start order, is
// what that kernel added to the step's critical path; summed by kernel name over a step and
// averaged over the steps. Kernels that overlap their predecessor (PDL) add only their tail.
// MOEBIUS_TRACE_SKIP=N ignores the first N such launches (warm-up); MOEBIUS_TRACE_ROWS=N prints
// the N largest names (default 30). MOEBIUS_TRACE_TIMELINE=N also prints N kernels of the last such
// step in start order, from the MOEBIUS_TRACE_TIMELINE_FROM'th (default 0): start and end in us from
// the step's first kernel, so overlap between streams (a side stream's copy beside the main
// stream's kernels) can be read directly.
// CONCURRENT_KERNEL records do not serialize kernels; the per-kernel timestamps cost a little
// (compare the traced program's own timing with an untraced run).
#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct KernelRecord {
  uint64_t start, end;
  uint32_t correlation;
  std::string name;
};

std::mutex g_mu;
std::vector<KernelRecord>* g_records = nullptr;  // leaked on purpose: read from the exit handler

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    g_records->push_back({k->start, k->end, k->correlationId, k->name != nullptr ? k->name : "?"});
  }
  std::free(buffer);
}

// "void moebius::kernels::(anonymous namespace)::moe_gemm_rows_kernel<(Fmt)1, ...>(Args)" -> the
// function name with its template arguments, without namespaces and parameters, cut to 70
// characters for the table.
std::string short_name(const std::string& mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  int depth = 0;  // cut at the parameter list: the first '(' outside template brackets that does
  for (size_t i = 0; i < s.size(); ++i) {  // not open "(anonymous namespace)"
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0 && s.compare(i, 11, "(anonymous ") != 0) {
      s.resize(i);
      break;
    }
  }
  const size_t lt = s.find('<');
  const size_t ns = s.rfind("::", lt);
  if (ns != std::string::npos) s = s.substr(ns + 2);
  const size_t space = s.find(' ');  // a return type left in front ("void ")
  if (space != std::string::npos && space < s.find('<')) s = s.substr(space + 1);
  if (s.size() > 70) s.resize(70);
  return s;
}

struct Totals {
  double marginal = 0, duration = 0;
  int count = 0;
};

void report() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mu);
  std::map<uint32_t, std::vector<const KernelRecord*>> launches;  // correlation id -> its kernels
  for (const KernelRecord& r : *g_records) launches[r.correlation].push_back(&r);
  size_t most = 0;
  for (const auto& [id, ks] : launches) most = std::max(most, ks.size());
  if (most < 2) {
    std::fprintf(stderr, "kernel_trace: %zu kernels, no multi-kernel launch\n", g_records->size());
    return;
  }
  const char* skip_env = std::getenv("MOEBIUS_TRACE_SKIP");
  const char* rows_env = std::getenv("MOEBIUS_TRACE_ROWS");
  int skip = skip_env != nullptr ? std::atoi(skip_env) : 2;
  const int rows = rows_env != nullptr ? std::atoi(rows_env) : 30;
  std::map<std::string, Totals> by_name;
  double step_sum = 0;
  int steps = 0;
  const std::vector<const KernelRecord*>* last_step = nullptr;
  for (auto& [id, ks] : launches) {
    if (ks.size() != most) continue;  // the decode graph replays: the launches with the most kernels
    if (skip-- > 0) continue;
    std::sort(ks.begin(), ks.end(), [](const KernelRecord* a, const KernelRecord* b) { return a->start < b->start; });
    uint64_t frontier = ks.front()->start;
    for (const KernelRecord* k : ks) {
      Totals& t = by_name[short_name(k->name)];
      t.marginal += k->end > frontier ? static_cast<double>(k->end - frontier) : 0.0;
      t.duration += static_cast<double>(k->end - k->start);
      ++t.count;
      frontier = std::max(frontier, k->end);
    }
    step_sum += static_cast<double>(frontier - ks.front()->start);
    ++steps;
    last_step = &ks;
  }
  if (steps == 0) return;
  std::vector<std::pair<std::string, Totals>> sorted(by_name.begin(), by_name.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.marginal > b.second.marginal; });
  std::fprintf(stderr, "kernel_trace: %d launches of %zu kernels; step %.1f us (first kernel start to last end)\n",
               steps, most, step_sum / steps / 1000.0);
  std::fprintf(stderr, "%-70s %7s %12s %9s %12s\n", "kernel", "/step", "marginal us", "share", "mean dur us");
  for (int i = 0; i < static_cast<int>(sorted.size()) && i < rows; ++i) {
    const Totals& t = sorted[static_cast<size_t>(i)].second;
    std::fprintf(stderr, "%-70s %7.1f %12.1f %8.1f%% %12.2f\n", sorted[static_cast<size_t>(i)].first.c_str(),
                 static_cast<double>(t.count) / steps, t.marginal / steps / 1000.0, 100.0 * t.marginal / step_sum,
                 t.duration / t.count / 1000.0);
  }
  const char* timeline_env = std::getenv("MOEBIUS_TRACE_TIMELINE");
  const char* from_env = std::getenv("MOEBIUS_TRACE_TIMELINE_FROM");
  const int timeline = timeline_env != nullptr ? std::atoi(timeline_env) : 0;
  const int from = from_env != nullptr ? std::max(0, std::atoi(from_env)) : 0;
  if (timeline > 0 && last_step != nullptr) {
    const std::vector<const KernelRecord*>& ks = *last_step;
    const uint64_t t0 = ks.front()->start;
    std::fprintf(stderr, "timeline of the last step, kernels %d-%d (us from its first kernel)\n", from,
                 std::min<int>(from + timeline, static_cast<int>(ks.size())) - 1);
    std::fprintf(stderr, "%5s %10s %10s %9s  %s\n", "#", "start", "end", "dur", "kernel");
    for (int i = from; i < from + timeline && i < static_cast<int>(ks.size()); ++i) {
      const KernelRecord* k = ks[static_cast<size_t>(i)];
      std::fprintf(stderr, "%5d %10.2f %10.2f %9.2f  %s\n", i, static_cast<double>(k->start - t0) / 1000.0,
                   static_cast<double>(k->end - t0) / 1000.0, static_cast<double>(k->end - k->start) / 1000.0,
                   short_name(k->name).c_str());
    }
  }
}

struct Tracer {
  Tracer() {
    g_records = new std::vector<KernelRecord>();
    g_records->reserve(1 << 20);
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
      std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not start\n");
  }
  ~Tracer() { report(); }
};
Tracer g_tracer;

}  // namespace
