// The CUDA environment the CLI asks for (runtime/cuda_environment.h). [TAG_CUDA_CONNECTIONS]: the
// user's CUDA_DEVICE_MAX_CONNECTIONS wins, an unset one becomes 32, and the count the routed copies
// are allowed with reads values CUDA would not take as 8. [TAG_CUDA_EAGER_LOADING]: the same for
// CUDA_MODULE_LOADING. Host code only (no CUDA call), so it runs in CI.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "runtime/cuda_environment.h"

namespace moebius::runtime {
namespace {

// Restores a variable as the test found it.
template <const char* kName>
class SavedEnv : public ::testing::Test {
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
  static constexpr const char* kVar = kName;

 private:
  bool had_ = false;
  std::string saved_;
};

constexpr char kConnections[] = "CUDA_DEVICE_MAX_CONNECTIONS";
constexpr char kModuleLoading[] = "CUDA_MODULE_LOADING";
using ConnectionsEnv = SavedEnv<kConnections>;
using ModuleLoadingEnv = SavedEnv<kModuleLoading>;

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

TEST_F(ModuleLoadingEnv, UnsetBecomesEagerAndTheUsersValueWins) {
  unsetenv(kVar);
  EXPECT_FALSE(eager_module_loading());
  request_eager_module_loading();
  EXPECT_STREQ(std::getenv(kVar), "EAGER");
  EXPECT_TRUE(eager_module_loading());
  setenv(kVar, "LAZY", 1);
  request_eager_module_loading();
  EXPECT_STREQ(std::getenv(kVar), "LAZY");
  EXPECT_FALSE(eager_module_loading());
  for (const char* v : {"", "eager", "EAGER ", "LAZY"}) {
    setenv(kVar, v, 1);
    EXPECT_FALSE(eager_module_loading()) << "'" << v << "'";
  }
}

}  // namespace
}  // namespace moebius::runtime
