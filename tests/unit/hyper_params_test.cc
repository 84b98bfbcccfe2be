// One rule per hyper-parameter (common/hyper_params.h), checked with the one
// table of values (tests/fixtures/hyper_parameters.tsv) on every C++ path a
// value enters: the rule itself, the optimizer configs (which the optimizer's
// constructor and setters use), the CLI flag parser, and the checkpoint
// manifest reader. The Python and binary paths read the same table
// (tests/python/hyper_params_test.py, tests/hyper_params_cli_test.sh).
#include "common/hyper_params.h"

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "client/checkpoint/manifest.h"
#include "common/optimizer_config.h"
#include "gtest/gtest.h"
#include "tools/cli/flags.h"

namespace shardopt {
namespace {

struct Case {
  std::string name, text;
  double value = 0;
  bool ok = false;
  std::string change;  // "ok", "bad" or "-"
};

std::vector<Case> LoadCases() {
  std::ifstream in("tests/fixtures/hyper_parameters.tsv");
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = absl::StrSplit(line, '\t');
    if (f.size() != 4) {
      ADD_FAILURE() << "bad table line: " << line;
      continue;
    }
    Case c{f[0], f[1], 0, f[2] == "ok", f[3]};
    if (!absl::SimpleAtod(c.text, &c.value)) ADD_FAILURE() << "bad number: " << line;
    cases.push_back(c);
  }
  return cases;
}

std::string Describe(const Case& c) {
  return c.name + "=" + c.text + " (expected " + (c.ok ? "ok" : "refused") + ")";
}

TEST(HyperParamsTable, CoversEveryHyperParameter) {
  const std::vector<Case> cases = LoadCases();
  ASSERT_GE(cases.size(), 40u);
  for (HyperParameter p : AllHyperParameters()) {
    bool good = false, bad = false;
    for (const Case& c : cases) {
      if (ParseHyperParameterName(c.name) != p) continue;
      (c.ok ? good : bad) = true;
    }
    EXPECT_TRUE(good && bad) << HyperParameterName(p) << " needs an accepted and a refused row";
  }
}

TEST(HyperParamsTable, TheRule) {
  for (const Case& c : LoadCases()) {
    auto p = ParseHyperParameterName(c.name);
    ASSERT_TRUE(p.has_value()) << c.name;
    const absl::Status s = ValidateHyperParameter(*p, c.value);
    EXPECT_EQ(s.ok(), c.ok) << Describe(c) << ": " << s;
    if (!s.ok()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      // The message names the parameter and its range.
      EXPECT_NE(s.message().find(HyperParameterName(*p)), absl::string_view::npos) << s;
      EXPECT_NE(s.message().find(HyperParameterRange(*p)), absl::string_view::npos) << s;
    }
    if (c.change != "-") {
      EXPECT_EQ(ValidateLearningRateChange(c.value).ok(), c.change == "ok")
          << c.name << "=" << c.text << " as a change to a running job";
    }
  }
}

// What the optimizer's constructor, SetGroup and SetHyperParameters check.
TEST(HyperParamsTable, OptimizerConfigs) {
  for (const Case& c : LoadCases()) {
    const HyperParameter p = *ParseHyperParameterName(c.name);
    AdamConfig adam;
    SgdConfig sgd;
    bool in_adam = true, in_sgd = true;
    switch (p) {
      case HyperParameter::kLearningRate: adam.lr = sgd.lr = c.value; break;
      case HyperParameter::kWeightDecay: adam.weight_decay = sgd.weight_decay = c.value; break;
      case HyperParameter::kBeta1: adam.beta1 = c.value, in_sgd = false; break;
      case HyperParameter::kBeta2: adam.beta2 = c.value, in_sgd = false; break;
      case HyperParameter::kEps: adam.eps = c.value, in_sgd = false; break;
      case HyperParameter::kMomentum: sgd.momentum = c.value, in_adam = false; break;
      case HyperParameter::kDampening: sgd.dampening = c.value, in_adam = false; break;
      case HyperParameter::kMaxGradNorm: in_adam = in_sgd = false; break;
    }
    if (in_adam) EXPECT_EQ(ValidateAdamConfig(adam).ok(), c.ok) << "Adam " << Describe(c);
    if (in_sgd) EXPECT_EQ(ValidateSgdConfig(sgd).ok(), c.ok) << "SGD " << Describe(c);
  }
}

// The CLI flag parser (shardopt_train --lr, --clip).
TEST(HyperParamsTable, CliFlags) {
  for (const Case& c : LoadCases()) {
    const HyperParameter p = *ParseHyperParameterName(c.name);
    std::string arg = "--x=" + c.text;
    char prog[] = "prog";
    char* argv[] = {prog, arg.data(), nullptr};
    auto flags = Flags::Parse(2, argv, {"x"});
    ASSERT_TRUE(flags.ok()) << flags.status();
    auto v = flags->HyperParam("x", p, 0);
    EXPECT_EQ(v.ok(), c.ok) << "--" << Describe(c) << ": " << v.status();
    if (v.ok()) EXPECT_EQ(*v, c.value);
  }
}

// The checkpoint manifest's optimizer record.
TEST(HyperParamsTable, Manifest) {
  for (const Case& c : LoadCases()) {
    const HyperParameter p = *ParseHyperParameterName(c.name);
    if (p == HyperParameter::kMaxGradNorm) continue;  // not saved
    SavedOptimizer o;
    o.kind = (p == HyperParameter::kMomentum || p == HyperParameter::kDampening) ? "sgd" : "adam";
    o.lr = 1e-3;
    switch (p) {
      case HyperParameter::kLearningRate: o.lr = c.value; break;
      case HyperParameter::kWeightDecay: o.weight_decay = c.value; break;
      case HyperParameter::kBeta1: o.beta1 = c.value; break;
      case HyperParameter::kBeta2: o.beta2 = c.value; break;
      case HyperParameter::kEps: o.eps = c.value; break;
      case HyperParameter::kMomentum: o.momentum = c.value; break;
      case HyperParameter::kDampening: o.dampening = c.value; break;
      case HyperParameter::kMaxGradNorm: break;
    }
    auto parsed = ParseSavedOptimizer(SavedOptimizerJson(o), "test");
    EXPECT_EQ(parsed.ok(), c.ok) << "manifest " << Describe(c) << ": " << parsed.status();
  }
}

}  // namespace
}  // namespace shardopt
