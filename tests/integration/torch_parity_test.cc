// The scalar reference against LibTorch's torch::optim::Adam / AdamW / SGD on
// the same tensors over 10 steps.
//
// Tolerance: LibTorch's vectorised CPU kernels use fused multiply-add (ATen's
// Vectorized::fmadd in add_/addcmul_) and may evaluate x*alpha/y in a different
// order, so results are not bitwise equal; each step differs by a few fp32 ulps
// of the update. We require |ours - torch| <= 1e-6 * max(1, |p|) for parameters
// after 10 steps, and for optimizer state 1e-5 relative plus 1e-7 absolute:
// state is a sum of terms of the gradients' scale (0.1 here) that can cancel,
// so its error is relative to that scale (1e-6 of it), not to the result.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/kernels/reference_optimizer.h"

namespace shardopt {
namespace {

// Shapes of a small model: weight matrices, biases, a scalar.
const std::vector<std::vector<int64_t>> kShapes = {{64, 33}, {33}, {7, 5, 3}, {1}, {1000}};

struct Model {
  std::vector<at::Tensor> params;  // torch's copy (requires_grad)
  std::vector<std::vector<float>> ours, s0, s1;
};

Model MakeModel() {
  at::manual_seed(1234);
  Model m;
  for (const auto& shape : kShapes) {
    at::Tensor t = at::randn(shape).set_requires_grad(true);
    m.params.push_back(t);
    const float* d = t.data_ptr<float>();
    m.ours.emplace_back(d, d + t.numel());
    m.s0.emplace_back(t.numel(), 0.0f);
    m.s1.emplace_back(t.numel(), 0.0f);
  }
  return m;
}

// Runs 10 steps on both; `torch_step` steps LibTorch's optimizer, `ref_step` ours.
template <typename TorchStep, typename RefStep>
void RunAndCompare(Model& m, TorchStep torch_step, RefStep ref_step, bool has_state1) {
  for (int step = 1; step <= 10; ++step) {
    std::vector<std::vector<float>> grads;
    for (auto& p : m.params) {
      at::Tensor g = at::randn(p.sizes()) * 0.1;
      p.mutable_grad() = g;
      const float* d = g.data_ptr<float>();
      grads.emplace_back(d, d + g.numel());
    }
    torch_step();
    std::vector<UpdateSlice> slices;
    for (size_t i = 0; i < m.params.size(); ++i) {
      UpdateSlice s;
      s.param = m.ours[i].data();
      s.grad = grads[i].data();
      s.state0 = m.s0[i].data();
      s.state1 = m.s1[i].data();
      s.size = static_cast<int64_t>(m.ours[i].size());
      slices.push_back(s);
    }
    ASSERT_TRUE(ref_step(step, slices).ok());
  }
  double max_rel = 0;
  for (size_t i = 0; i < m.params.size(); ++i) {
    const float* t = m.params[i].data_ptr<float>();
    for (size_t k = 0; k < m.ours[i].size(); ++k) {
      const double err = std::fabs(static_cast<double>(t[k]) - m.ours[i][k]) /
                         std::max(1.0, std::fabs(static_cast<double>(t[k])));
      max_rel = std::max(max_rel, err);
      ASSERT_LE(err, 1e-6) << "param " << i << " element " << k << ": torch " << t[k] << " ours "
                           << m.ours[i][k];
    }
  }
  ::testing::Test::RecordProperty("max_param_rel_error", absl::StrCat(max_rel));
  (void)has_state1;
}

void CompareState(const at::Tensor& torch_state, const std::vector<float>& ours,
                  const std::string& what) {
  const float* t = torch_state.data_ptr<float>();
  for (size_t k = 0; k < ours.size(); ++k) {
    ASSERT_NEAR(t[k], ours[k], 1e-5 * std::fabs(t[k]) + 1e-7) << what << " element " << k;
  }
}

TEST(TorchParityTest, Adam) {
  for (double wd : {0.0, 0.01}) {
    Model m = MakeModel();
    torch::optim::Adam opt(
        m.params, torch::optim::AdamOptions(1e-2).betas({0.9, 0.99}).eps(1e-8).weight_decay(wd));
    AdamConfig c;
    c.lr = 1e-2;
    c.beta2 = 0.99;
    c.weight_decay = wd;
    RunAndCompare(
        m, [&] { opt.step(); },
        [&](int64_t step, const std::vector<UpdateSlice>& s) {
          return ReferenceAdamStep(c, step, s);
        },
        true);
    for (size_t i = 0; i < m.params.size(); ++i) {
      auto& st = static_cast<torch::optim::AdamParamState&>(
          *opt.state().at(c10::guts::to_string(m.params[i].unsafeGetTensorImpl())));
      CompareState(st.exp_avg(), m.s0[i], "exp_avg");
      CompareState(st.exp_avg_sq(), m.s1[i], "exp_avg_sq");
      EXPECT_EQ(st.step(), 10);
    }
  }
}

TEST(TorchParityTest, AdamW) {
  Model m = MakeModel();
  torch::optim::AdamW opt(m.params, torch::optim::AdamWOptions(5e-3).weight_decay(0.1));
  AdamConfig c = AdamWConfig();
  c.lr = 5e-3;
  c.weight_decay = 0.1;
  RunAndCompare(
      m, [&] { opt.step(); },
      [&](int64_t step, const std::vector<UpdateSlice>& s) {
        return ReferenceAdamStep(c, step, s);
      },
      true);
}

TEST(TorchParityTest, Sgd) {
  struct Case {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const Case& k : {Case{0, 0, 0, false}, Case{0.9, 0, 0, false}, Case{0.9, 0.2, 1e-3, false},
                        Case{0.8, 0, 1e-2, true}}) {
    SCOPED_TRACE(absl::StrCat("momentum ", k.momentum, " dampening ", k.dampening, " wd ", k.wd,
                              " nesterov ", k.nesterov));
    Model m = MakeModel();
    torch::optim::SGD opt(m.params, torch::optim::SGDOptions(0.05)
                                        .momentum(k.momentum)
                                        .dampening(k.dampening)
                                        .weight_decay(k.wd)
                                        .nesterov(k.nesterov));
    SgdConfig c;
    c.lr = 0.05;
    c.momentum = k.momentum;
    c.dampening = k.dampening;
    c.weight_decay = k.wd;
    c.nesterov = k.nesterov;
    RunAndCompare(
        m, [&] { opt.step(); },
        [&](int64_t step, const std::vector<UpdateSlice>& s) {
          return ReferenceSgdStep(c, step, s);
        },
        false);
    if (k.momentum != 0) {
      for (size_t i = 0; i < m.params.size(); ++i) {
        auto& st = static_cast<torch::optim::SGDParamState&>(
            *opt.state().at(c10::guts::to_string(m.params[i].unsafeGetTensorImpl())));
        CompareState(st.momentum_buffer(), m.s0[i], "momentum_buffer");
      }
    }
  }
}

}  // namespace
}  // namespace shardopt
