// The fused CPU kernels against the scalar reference: bitwise equal for every
// instruction set, thread count, size and optimizer variant, over 10 steps.
#include "server/kernels/cpu/cpu_kernels.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/kernels/reference_optimizer.h"

namespace shardopt {
namespace {

constexpr int64_t kChunk = 4096;  // small chunks so chunk edges are cheap to hit

// One slice's arrays; grads are refreshed every step from the same stream.
struct Buffers {
  std::vector<float> p, g, s0, s1;
  std::vector<uint16_t> g16, p16;
  explicit Buffers(int64_t n, uint32_t seed) : p(n), g(n), s0(n), s1(n), g16(n), p16(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& x : p) x = d(rng);
  }
  void NewGrads(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.1f);
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = d(rng);
      g16[i] = FloatToBf16(g[i]);
    }
  }
  UpdateSlice Slice(bool bf16) {
    UpdateSlice s;
    s.param = p.data();
    if (bf16) {
      s.grad_bf16 = g16.data();
      s.param_bf16 = p16.data();
    } else {
      s.grad = g.data();
    }
    s.state0 = s0.data();
    s.state1 = s1.data();
    s.size = static_cast<int64_t>(p.size());
    return s;
  }
};

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b, std::string* where) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      *where = absl::StrCat("element ", i, ": ", a[i], " vs ", b[i]);
      return false;
    }
  }
  return true;
}

struct Variant {
  std::string name;
  bool adam;
  AdamConfig adam_config;
  SgdConfig sgd_config;
};

std::vector<Variant> Variants() {
  std::vector<Variant> v;
  v.push_back({"adam", true, AdamConfig(), {}});
  AdamConfig l2;
  l2.weight_decay = 0.05;
  l2.lr = 3e-3;
  v.push_back({"adam_l2", true, l2, {}});
  AdamConfig max;
  max.maximize = true;
  max.beta1 = 0.8;
  max.beta2 = 0.95;
  max.eps = 1e-6;
  v.push_back({"adam_maximize", true, max, {}});
  v.push_back({"adamw", true, AdamWConfig(), {}});
  SgdConfig plain;
  plain.lr = 0.1;
  v.push_back({"sgd", false, {}, plain});
  SgdConfig mom;
  mom.momentum = 0.9;
  mom.dampening = 0.1;
  mom.weight_decay = 1e-4;
  v.push_back({"sgd_momentum_dampening_wd", false, {}, mom});
  SgdConfig nest;
  nest.momentum = 0.9;
  nest.nesterov = true;
  nest.maximize = true;
  v.push_back({"sgd_nesterov_maximize", false, {}, nest});
  return v;
}

absl::Status Step(const Variant& v, int64_t step, absl::Span<const UpdateSlice> slices,
                  const KernelOptions* fast) {
  if (v.adam) {
    return fast ? AdamStep(v.adam_config, step, slices, *fast)
                : ReferenceAdamStep(v.adam_config, step, slices);
  }
  return fast ? SgdStep(v.sgd_config, step, slices, *fast)
              : ReferenceSgdStep(v.sgd_config, step, slices);
}

class FastVsReferenceTest : public ::testing::TestWithParam<std::tuple<Isa, int>> {};

TEST_P(FastVsReferenceTest, BitwiseEqualOverTenSteps) {
  const auto [isa, threads] = GetParam();
  if (!IsaSupported(isa)) GTEST_SKIP() << IsaName(isa) << " not supported by this CPU";
  KernelOptions opt;
  opt.isa = isa;
  opt.num_threads = threads;
  opt.chunk_elements = kChunk;
  // Sizes 0, 1, 7, 8, 15, 16, 1023, chunk edges, 1M; all in one multi-slice call.
  const std::vector<int64_t> sizes = {
      0, 1, 7, 8, 15, 16, 1023, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5, 1 << 20};
  for (const Variant& v : Variants()) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(absl::StrCat(v.name, bf16 ? " bf16" : " fp32", " isa=", IsaName(isa),
                                " threads=", threads));
      std::vector<Buffers> fast, ref;
      for (size_t i = 0; i < sizes.size(); ++i) {
        fast.emplace_back(sizes[i], 17 + i);
        ref.emplace_back(sizes[i], 17 + i);
      }
      for (int step = 1; step <= 10; ++step) {
        std::vector<UpdateSlice> fs, rs;
        for (size_t i = 0; i < sizes.size(); ++i) {
          fast[i].NewGrads(1000 * step + i);
          ref[i].NewGrads(1000 * step + i);
          fs.push_back(fast[i].Slice(bf16));
          rs.push_back(ref[i].Slice(bf16));
        }
        ASSERT_TRUE(Step(v, step, fs, &opt).ok());
        ASSERT_TRUE(Step(v, step, rs, nullptr).ok());
      }
      for (size_t i = 0; i < sizes.size(); ++i) {
        std::string where;
        EXPECT_TRUE(BitwiseEqual(fast[i].p, ref[i].p, &where))
            << "size " << sizes[i] << " " << where;
        EXPECT_TRUE(BitwiseEqual(fast[i].s0, ref[i].s0, &where))
            << "size " << sizes[i] << " " << where;
        if (v.adam) {
          EXPECT_TRUE(BitwiseEqual(fast[i].s1, ref[i].s1, &where))
              << "size " << sizes[i] << " " << where;
        }
        if (bf16) {
          EXPECT_EQ(fast[i].p16, ref[i].p16) << "size " << sizes[i];
          for (int64_t k = 0; k < sizes[i]; k += 997) {
            EXPECT_EQ(fast[i].p16[k], FloatToBf16(fast[i].p[k]));
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(IsasAndThreads, FastVsReferenceTest,
                         ::testing::Combine(::testing::Values(Isa::kBaseline, Isa::kAvx2,
                                                              Isa::kAvx512),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return absl::StrCat(IsaName(std::get<0>(info.param)), "_",
                                               std::get<1>(info.param), "threads");
                         });

TEST(Bf16Test, Bf16PathTracksFp32PathWithinBf16Tolerance) {
  // A bf16 model (bf16 params and grads, fp32 master + state) against the same
  // model in fp32, 10 Adam steps: the master weights differ only by the
  // rounding of the gradients to bf16.
  const int64_t n = 100000;
  Buffers f32(n, 5), b16(n, 5);
  for (int step = 1; step <= 10; ++step) {
    f32.NewGrads(step);
    b16.NewGrads(step);
    UpdateSlice a = f32.Slice(false), b = b16.Slice(true);
    ASSERT_TRUE(AdamStep(AdamConfig(), step, {&a, 1}).ok());
    ASSERT_TRUE(AdamStep(AdamConfig(), step, {&b, 1}).ok());
  }
  double max_err = 0;
  for (int64_t i = 0; i < n; ++i) {
    // Adam's update is at most ~lr per step; bf16 grads change it by ~2^-8 relative.
    max_err = std::max(max_err, static_cast<double>(std::fabs(f32.p[i] - b16.p[i])));
    // The bf16 model copy is the master rounded: within half a bf16 ulp (2^-9 relative).
    const float model = Bf16ToFloat(b16.p16[i]);
    ASSERT_LE(std::fabs(model - b16.p[i]), std::fabs(b16.p[i]) * (1.0f / 256) + 1e-30f) << i;
  }
  EXPECT_LT(max_err, 10 * 1e-3 * 0.02);  // 10 steps x lr x bf16-size perturbation of direction
  EXPECT_GT(max_err, 0.0);               // the paths are genuinely different
}

TEST(Bf16Test, RoundingIsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even).
  EXPECT_EQ(FloatToBf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(FloatToBf16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBf16(-INFINITY), 0xff80);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(FloatToBf16(3.4e38f), 0x7f80);  // rounds up to infinity, as PyTorch does
}

TEST(ValidationTest, BadConfigsAndSlicesAreErrorsAndTouchNothing) {
  Buffers b(100, 1);
  b.NewGrads(1);
  const std::vector<float> before = b.p;
  UpdateSlice s = b.Slice(false);
  AdamConfig bad;
  bad.lr = -1;
  EXPECT_EQ(AdamStep(bad, 1, {&s, 1}).code(), absl::StatusCode::kInvalidArgument);
  bad = AdamConfig();
  bad.beta1 = 1.0;
  EXPECT_EQ(AdamStep(bad, 1, {&s, 1}).code(), absl::StatusCode::kInvalidArgument);
  bad = AdamConfig();
  bad.eps = NAN;
  EXPECT_EQ(ReferenceAdamStep(bad, 1, {&s, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamStep(AdamConfig(), 0, {&s, 1}).code(), absl::StatusCode::kInvalidArgument);
  SgdConfig nest;
  nest.nesterov = true;  // without momentum
  EXPECT_EQ(SgdStep(nest, 1, {&s, 1}).code(), absl::StatusCode::kInvalidArgument);
  UpdateSlice no_state = s;
  no_state.state1 = nullptr;
  EXPECT_EQ(AdamStep(AdamConfig(), 1, {&no_state, 1}).code(), absl::StatusCode::kInvalidArgument);
  UpdateSlice two_grads = s;
  two_grads.grad_bf16 = b.g16.data();
  EXPECT_EQ(AdamStep(AdamConfig(), 1, {&two_grads, 1}).code(), absl::StatusCode::kInvalidArgument);
  UpdateSlice negative = s;
  negative.size = -1;
  EXPECT_EQ(SgdStep(SgdConfig(), 1, {&negative, 1}).code(), absl::StatusCode::kInvalidArgument);
  KernelOptions opt;
  opt.chunk_elements = 0;
  EXPECT_EQ(AdamStep(AdamConfig(), 1, {&s, 1}, opt).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.p, before);
  // SGD without momentum needs no state.
  UpdateSlice stateless = s;
  stateless.state0 = stateless.state1 = nullptr;
  EXPECT_TRUE(SgdStep(SgdConfig(), 1, {&stateless, 1}).ok());
  EXPECT_NE(b.p, before);
}

}  // namespace
}  // namespace shardopt
