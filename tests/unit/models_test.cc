// The C++ models match their references: ResNet-101 parameter for parameter
// against torchvision's (tests/fixtures/resnet101_params.json).
#include "tools/models/models.h"

#include <ATen/Parallel.h>

#include "tools/models/model_shapes.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

TEST(ModelsTest, ResNet101MatchesTorchvisionParameterForParameter) {
  auto fixture = LoadModelShapes("tests/fixtures/resnet101_params.json");
  ASSERT_TRUE(fixture.ok()) << fixture.status();
  auto model = MakeModel("resnet101", 1);
  ASSERT_TRUE(model.ok());
  auto params = (*model)->NamedParameters();
  ASSERT_EQ(params.size(), fixture->params.size());
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].first, fixture->params[i].name) << i;
    EXPECT_EQ(params[i].second.sizes().vec(), fixture->params[i].shape) << params[i].first;
    total += params[i].second.numel();
  }
  EXPECT_EQ(total, 44549160);
  // One forward/backward on 2 samples works and gives a finite loss.
  at::set_num_threads(1);
  torch::Tensor loss = (*model)->Loss(0, 0, 2);
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
}

TEST(ModelsTest, UnknownModelIsAnError) {
  auto m = MakeModel("vgg", 1);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("resnet101"), absl::string_view::npos);
}

}  // namespace
}  // namespace shardopt
