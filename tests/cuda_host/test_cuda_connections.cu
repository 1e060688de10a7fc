// [TAG_CUDA_CONNECTIONS] The hardware queue count the CLI asks for (runtime/cuda_connections.h):
// the user's CUDA_DEVICE_MAX_CONNECTIONS wins, an unset one becomes 32, and the count the routed
// copies are allowed with reads values CUDA would not take as 8. Host code only (no CUDA call), so
// it runs in CI.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "runtime/cuda_connections.h"

namespace moebius::runtime {
namespace {

// Restores the variable as the test found it.
class ConnectionsEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* v = std::getenv(kVar);
    had_ = v != nullptr;
    if (had_) saved_ = v;
  }
  void TearDown() override {
    if (had_) setenv(kVar, saved_.c_str(), 1);
    else unsetenv(kVar);
  }
  static constexpr const char* kVar = "CUDA_DEVICE_MAX_CONNECTIONS";

 private:
  bool had_ = false;
  std::string saved_;
};

TEST_F(ConnectionsEnv, UnsetBecomesThirtyTwo) {
  unsetenv(kVar);
  EXPECT_EQ(cuda_connections(), 8);
  request_cuda_connections();
  ASSERT_NE(std::getenv(kVar), nullptr);
  EXPECT_STREQ(std::getenv(kVar), "32");
  EXPECT_EQ(cuda_connections(), kCudaConnectionsWanted);
}

TEST_F(ConnectionsEnv, TheUsersValueWins) {
  setenv(kVar, "4", 1);
  request_cuda_connections();
  EXPECT_STREQ(std::getenv(kVar), "4");
  EXPECT_EQ(cuda_connections(), 4);
}

TEST_F(ConnectionsEnv, UnreadableValuesCountAsTheDefault) {
  for (const char* v : {"", "0", "-3", "33", "16x", "x", "99999999999999999999"}) {
    setenv(kVar, v, 1);
    EXPECT_EQ(cuda_connections(), 8) << "'" << v << "'";
  }
  for (const char* v : {"1", "16", "32"}) {
    setenv(kVar, v, 1);
    EXPECT_EQ(cuda_connections(), std::atoi(v)) << v;
  }
}

}  // namespace
}  // namespace moebius::runtime
