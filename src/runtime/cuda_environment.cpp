// The CUDA environment the process asks for (cuda_environment.h): [TAG_CUDA_CONNECTIONS],
// [TAG_CUDA_EAGER_LOADING].
#include "runtime/cuda_environment.h"

#include <cstdlib>
#include <cstring>
#include <string>

namespace moebius::runtime {

void request_cuda_connections() {
  const std::string value = std::to_string(kCudaConnectionsWanted);
  (void)setenv("CUDA_DEVICE_MAX_CONNECTIONS", value.c_str(), /*overwrite=*/0);
}

int cuda_connections() {
  constexpr int kCudaDefault = 8;
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (v == nullptr || *v == '\0') return kCudaDefault;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > 32) return kCudaDefault;
  return static_cast<int>(n);
}

void request_eager_module_loading() { (void)setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0); }

bool eager_module_loading() {
  const char* v = std::getenv("CUDA_MODULE_LOADING");
  return v != nullptr && std::strcmp(v, "EAGER") == 0;
}

}  // namespace moebius::runtime
