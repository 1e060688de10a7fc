// moebius: an inference engine for Mixture-of-Experts models with low-bit experts.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>

#include "cli/commands.h"
#include "core/error.h"
#ifdef MOEBIUS_HAS_CUDA
#include "runtime/cuda_environment.h"
#endif

int main(int argc, char** argv) {
#ifdef MOEBIUS_HAS_CUDA
  moebius::runtime::request_cuda_connections();  // before any CUDA call [TAG_CUDA_CONNECTIONS]
  // [TAG_CUDA_EAGER_LOADING] The routed copies asked for by the environment (--expert-dma asks
  // while the flags are parsed).
  if (const char* slots = std::getenv("MOEBIUS_EXPERT_DMA_SLOTS"); slots != nullptr && std::atoi(slots) > 0)
    moebius::runtime::request_eager_module_loading();
#endif
  CLI::App app{"moebius: fast inference for Mixture-of-Experts models with low-bit experts"};
  app.set_version_flag("--version", std::string("moebius ") + MOEBIUS_VERSION);
  app.require_subcommand(1);

  CLI::App* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  moebius::cli::register_bench_moe(*bench);
  moebius::cli::register_bench_attention(*bench);
  moebius::cli::register_bench_gemv(*bench);
  moebius::cli::register_bench_generate(*bench);
  moebius::cli::register_bench_serve(*bench);
  moebius::cli::register_bench_engine(*bench);
  moebius::cli::register_bench_ep(*bench);
  moebius::cli::register_bench_ceilings(*bench);
  moebius::cli::register_generate(app);
  moebius::cli::register_eval(app);
  moebius::cli::register_serve(app);
  moebius::cli::register_tune(app);
  moebius::cli::register_profile_experts(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);  // prints a clear message naming the flag; non-zero on errors
  } catch (const std::bad_alloc&) {
    // Commands size their buffers from checked inputs; an allocation can still fail when the host
    // is short of memory for what was asked (a model, a context, a batch). Say so and exit
    // non-zero instead of aborting.
    std::fprintf(stderr, "moebius: error: out of host memory (an allocation failed); ask for less (a smaller "
                         "context, batch or chunk) or free memory\n");
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moebius: error: %s\n", e.what());
    return 3;
  }
  return 0;
}
