#include "client/models.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace shardopt {

std::vector<std::pair<std::string, torch::Tensor>> TrainModel::NamedParameters() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : module().named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

namespace {

// Rows [begin, end) of a seeded global batch: row i depends only on (seed, i),
// so a rank generates exactly its own rows.
torch::Tensor SyntheticRows(uint64_t seed, int64_t cols, int64_t begin, int64_t end) {
  torch::Tensor out = torch::empty({end - begin, cols});
  for (int64_t i = begin; i < end; ++i) {
    at::Generator gen = at::detail::createCPUGenerator(seed * 1000003ull + static_cast<uint64_t>(i));
    out[i - begin].copy_(at::randn({cols}, gen));
  }
  return out;
}

class MlpModel : public TrainModel {
 public:
  MlpModel(std::vector<int64_t> dims, int64_t batch, uint64_t seed, std::string name)
      : dims_(std::move(dims)), batch_(batch), name_(std::move(name)) {
    torch::manual_seed(seed);
    for (size_t i = 0; i + 1 < dims_.size(); ++i) {
      seq_->push_back(torch::nn::Linear(dims_[i], dims_[i + 1]));
      if (i + 2 < dims_.size()) seq_->push_back(torch::nn::ReLU());
    }
    holder_->register_module("net", seq_);
  }
  std::string name() const override { return name_; }
  torch::nn::Module& module() override { return *holder_; }
  int64_t batch_per_rank() const override { return batch_; }
  torch::Tensor Loss(int64_t step, int64_t begin, int64_t end) override {
    const auto dtype = holder_->parameters().front().scalar_type();
    torch::Tensor x = SyntheticRows(2 * step + 1, dims_.front(), begin, end).to(dtype);
    torch::Tensor y = SyntheticRows(2 * step + 2, dims_.back(), begin, end);
    return torch::nn::functional::mse_loss(seq_->forward(x).to(torch::kFloat), y);
  }

 private:
  std::vector<int64_t> dims_;
  int64_t batch_;
  std::string name_;
  std::shared_ptr<torch::nn::Module> holder_ = std::make_shared<torch::nn::Module>();
  torch::nn::Sequential seq_;
};

// Biases, a frozen parameter, and a parameter unused on odd steps.
class SmallModel : public TrainModel, public torch::nn::Module {
 public:
  explicit SmallModel(uint64_t seed) {
    torch::manual_seed(seed);
    fc1_ = register_module("fc1", torch::nn::Linear(16, 32));
    frozen_scale_ = register_parameter("frozen_scale", torch::rand({32}) + 0.5, false);
    fc2_ = register_module("fc2", torch::nn::Linear(32, 8));
    even_bias_ = register_parameter("even_bias", torch::randn({8}) * 0.1);
  }
  std::string name() const override { return "small"; }
  torch::nn::Module& module() override { return *this; }
  int64_t batch_per_rank() const override { return 12; }
  torch::Tensor Loss(int64_t step, int64_t begin, int64_t end) override {
    torch::Tensor x = SyntheticRows(7 * step + 1, 16, begin, end).to(fc1_->weight.scalar_type());
    torch::Tensor y = SyntheticRows(7 * step + 2, 8, begin, end);
    torch::Tensor h = torch::relu(fc1_->forward(x)) * frozen_scale_;
    torch::Tensor out = fc2_->forward(h);
    if (step % 2 == 0) out = out + even_bias_;  // no gradient on odd steps
    return torch::nn::functional::mse_loss(out.to(torch::kFloat), y);
  }

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::Tensor frozen_scale_, even_bias_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<TrainModel>> MakeModel(const std::string& name, uint64_t seed) {
  // Initialisation draws from LibTorch's global generator: one model at a
  // time, so that ranks built concurrently in one process get equal weights.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (name == "mlp") {
    return std::unique_ptr<TrainModel>(
        new MlpModel({1024, 4096, 4096, 4096, 1024}, 64, seed, "mlp"));
  }
  if (name == "tiny") {
    return std::unique_ptr<TrainModel>(new MlpModel({64, 256, 256, 32}, 16, seed, "tiny"));
  }
  if (name == "small") {
    auto m = std::make_shared<SmallModel>(seed);
    struct Holder : TrainModel {
      std::shared_ptr<SmallModel> m;
      std::string name() const override { return m->name(); }
      torch::nn::Module& module() override { return m->module(); }
      int64_t batch_per_rank() const override { return m->batch_per_rank(); }
      torch::Tensor Loss(int64_t s, int64_t b, int64_t e) override { return m->Loss(s, b, e); }
    };
    auto h = std::make_unique<Holder>();
    h->m = m;
    return std::unique_ptr<TrainModel>(std::move(h));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model '", name, "' (expected mlp, small or tiny)"));
}

}  // namespace shardopt
