// The bf16-y MoE combine (kernels/moe_combine.cuh, [TAG_MOE_BF16_Y]) against a CPU reference: each
// token's k bf16 expert rows widened to fp32, weighted and summed in slot order with one fused
// multiply-add per step, rounded once to bf16. Bit-exact (the same operations in the same order),
// for output rows at an even and at an odd element offset (pair stores and scalar stores), live
// token counts below the capacity (the rows past it stay poisoned), k = 1, 2 and 8.
#include "gpu/gpu_test_util.h"  // first: see the fmt note there

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/moe_combine.cuh"

namespace moebius {
namespace {

TEST(MoeCombineGpu, Bf16RowsMatchTheCpuSumAtAnyOutputOffset) {
  MOEBIUS_REQUIRE_GPU();
  std::mt19937 rng(20261206);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int top_k : {1, 2, 8}) {
    for (int out_offset : {0, 1}) {
      const int capacity = 37, live = 29, hidden = 264;  // 264 = 33 threads' 8 columns: a partial block
      const int y_stride = hidden, out_stride = hidden + 2;
      std::vector<uint16_t> y(static_cast<size_t>(capacity) * top_k * y_stride);
      for (auto& v : y) v = float_to_bf16_bits(u(rng));
      std::vector<float> w(static_cast<size_t>(capacity) * top_k);
      for (auto& v : w) v = u(rng) * 0.5f;
      testing::DeviceBuffer<uint16_t> dy(y.size());
      testing::DeviceBuffer<float> dw(w.size());
      testing::DeviceBuffer<int32_t> dlive(1);
      testing::DeviceBuffer<uint16_t> dout(static_cast<size_t>(capacity) * out_stride + 2);
      dy.upload(y);
      dw.upload(w);
      dlive.upload(std::vector<int32_t>{live});
      dout.poison(0xFF);
      kernels::launch_moe_combine(reinterpret_cast<const __nv_bfloat16*>(dy.data()), y_stride, dw.data(), dlive.data(),
                                  capacity, top_k, hidden,
                                  reinterpret_cast<__nv_bfloat16*>(dout.data() + out_offset), out_stride, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> got = dout.download();
      EXPECT_TRUE(dout.guards_intact());
      size_t bad = 0, unpoisoned = 0;
      for (int t = 0; t < capacity; ++t) {
        for (int c = 0; c < hidden; ++c) {
          const uint16_t g = got[static_cast<size_t>(t) * out_stride + out_offset + c];
          if (t >= live) {
            unpoisoned += g != 0xFFFF;
            continue;
          }
          float s = 0.0f;
          for (int j = 0; j < top_k; ++j)
            s = std::fma(w[static_cast<size_t>(t) * top_k + j],
                         bf16_bits_to_float(y[(static_cast<size_t>(t) * top_k + j) * y_stride + c]), s);
          bad += g != float_to_bf16_bits(s);
        }
      }
      EXPECT_EQ(bad, 0u) << "k " << top_k << " out offset " << out_offset;
      EXPECT_EQ(unpoisoned, 0u) << "rows past the live count were written (k " << top_k << ")";
    }
  }
}

}  // namespace
}  // namespace moebius
