// CUDA kernels against the CPU reference: bitwise equal for fp32 (the CUDA
// build uses no contraction and IEEE sqrt/division), bf16 model copies equal
// the reference's rounding, on many sizes including 0, 1, odd, chunk edges.
// Skips (reported as SKIPPED) when no GPU is present.
#include <cuda_runtime.h>

#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/kernels/cuda/cuda_kernels.h"
#include "server/kernels/reference_optimizer.h"

namespace shardopt {
namespace {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// Host and device copies of one slice's arrays.
struct Arrays {
  int64_t n;
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> model;
  float *dp = nullptr, *dg = nullptr, *dm = nullptr, *dv = nullptr;
  uint16_t* dmodel = nullptr;
  explicit Arrays(int64_t n, uint32_t seed) : n(n), p(n), g(n), m(n), v(n), model(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0, 1);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = d(rng);
      g[i] = 0.1f * d(rng);
    }
    const size_t b = std::max<int64_t>(n, 1) * 4;
    cudaMalloc(&dp, b);
    cudaMalloc(&dg, b);
    cudaMalloc(&dm, b);
    cudaMalloc(&dv, b);
    cudaMalloc(&dmodel, b / 2 + 2);
    cudaMemcpy(dp, p.data(), n * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dg, g.data(), n * 4, cudaMemcpyHostToDevice);
    cudaMemset(dm, 0, b);
    cudaMemset(dv, 0, b);
  }
  ~Arrays() {
    cudaFree(dp);
    cudaFree(dg);
    cudaFree(dm);
    cudaFree(dv);
    cudaFree(dmodel);
  }
  UpdateSlice Host() {
    UpdateSlice s;
    s.param = p.data();
    s.grad = g.data();
    s.state0 = m.data();
    s.state1 = v.data();
    s.param_bf16 = model.data();
    s.size = n;
    return s;
  }
  cuda::DeviceSlice Device() {
    cuda::DeviceSlice s;
    s.master = dp;
    s.grad = dg;
    s.state0 = dm;
    s.state1 = dv;
    s.model = dmodel;
    s.model_type = DType::kBFloat16;
    s.size = n;
    return s;
  }
};

TEST_F(GpuTest, AdamAdamWSgdBitwiseEqualToTheReference) {
  const std::vector<int64_t> sizes = {0, 1, 7, 8, 15, 16, 1023, 65535, 65536, 65537, 1 << 20};
  for (int variant = 0; variant < 4; ++variant) {
    std::vector<std::unique_ptr<Arrays>> a;
    std::vector<UpdateSlice> host;
    std::vector<cuda::DeviceSlice> dev;
    for (size_t i = 0; i < sizes.size(); ++i) {
      a.push_back(std::make_unique<Arrays>(sizes[i], 11 + i));
      host.push_back(a.back()->Host());
      dev.push_back(a.back()->Device());
    }
    AdamConfig adam = variant == 1 ? AdamWConfig() : AdamConfig();
    SgdConfig sgd;
    sgd.momentum = 0.9;
    sgd.nesterov = variant == 3;
    for (int step = 1; step <= 5; ++step) {
      if (variant < 2) {
        ASSERT_TRUE(ReferenceAdamStep(adam, step, host).ok());
        ASSERT_TRUE(cuda::AdamStep(MakeAdamScalars(adam, step), dev, nullptr).ok());
      } else {
        ASSERT_TRUE(ReferenceSgdStep(sgd, step, host).ok());
        ASSERT_TRUE(cuda::SgdStep(MakeSgdScalars(sgd, step), dev, nullptr).ok());
      }
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (auto& x : a) {
      std::vector<float> p(x->n);
      std::vector<uint16_t> model(x->n);
      cudaMemcpy(p.data(), x->dp, x->n * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(model.data(), x->dmodel, x->n * 2, cudaMemcpyDeviceToHost);
      EXPECT_EQ(std::memcmp(p.data(), x->p.data(), x->n * 4), 0)
          << "variant " << variant << " size " << x->n;
      EXPECT_EQ(model, x->model) << "variant " << variant << " size " << x->n;
    }
  }
}

TEST_F(GpuTest, NormAndOverflowStayOnTheDevice) {
  Arrays a(100003, 5);
  std::vector<cuda::DeviceSlice> dev = {a.Device()};
  double* norm;
  int* flag;
  cudaMalloc(&norm, sizeof(double));
  cudaMalloc(&flag, sizeof(int));
  ASSERT_TRUE(cuda::SquaredNorm(dev, norm, nullptr).ok());
  ASSERT_TRUE(cuda::CheckOverflow(dev, flag, nullptr).ok());
  double got = 0;
  int f = -1;
  cudaMemcpy(&got, norm, sizeof(double), cudaMemcpyDeviceToHost);
  cudaMemcpy(&f, flag, sizeof(int), cudaMemcpyDeviceToHost);
  double want = 0;
  for (float g : a.g) want += static_cast<double>(g) * g;
  EXPECT_NEAR(got, want, 1e-9 * want);
  EXPECT_EQ(f, 0);
  const float inf = INFINITY;
  cudaMemcpy(a.dg + 777, &inf, 4, cudaMemcpyHostToDevice);
  ASSERT_TRUE(cuda::CheckOverflow(dev, flag, nullptr).ok());
  cudaMemcpy(&f, flag, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(f, 1);
  cudaFree(norm);
  cudaFree(flag);
}

TEST(GpuAvailabilityTest, ReportsDevices) {
  // Runs everywhere: on machines without a GPU the kernels' tests above are
  // skipped, and this records why.
  const int n = cuda::DeviceCount();
  ::testing::Test::RecordProperty("cuda_devices", n);
  EXPECT_GE(n, 0);
  EXPECT_EQ(cuda::DeviceCount(), n) << "the count is stable (no sticky error after a failed query)";
  // Argument checks happen before anything touches a device, GPU or not.
  std::vector<cuda::DeviceSlice> bad(1);
  bad[0].size = -1;
  EXPECT_EQ(cuda::AdamStep(AdamScalars{}, bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad[0].size = 4;  // no parameter, no gradient
  EXPECT_EQ(cuda::SgdStep(SgdScalars{}, bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  if (n == 0) {
    std::cout << "no CUDA device: GPU kernel tests skipped\n";
    // Without a device a launch is a clear error, never a crash: an empty
    // batch either succeeds trivially or reports CUDA's reason.
    const absl::Status s = cuda::AdamStep(AdamScalars{}, {}, nullptr);
    EXPECT_TRUE(s.ok() || s.message().find("CUDA") != absl::string_view::npos) << s;
  }
}

}  // namespace
}  // namespace shardopt
