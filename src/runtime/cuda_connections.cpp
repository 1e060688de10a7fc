// CUDA_DEVICE_MAX_CONNECTIONS [TAG_CUDA_CONNECTIONS] (cuda_connections.h).
#include "runtime/cuda_connections.h"

#include <cstdlib>
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

}  // namespace moebius::runtime
