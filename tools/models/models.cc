#include "tools/models/models.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/any.h>

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
    at::Generator gen =
        at::detail::createCPUGenerator(seed * 1000003ull + static_cast<uint64_t>(i));
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
    torch::Tensor h = x;
    for (auto& layer : *seq_) {
      Gate(*layer.ptr());
      h = layer.forward(h);
    }
    return torch::nn::functional::mse_loss(h.to(torch::kFloat), y);
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
    Gate(*this);  // small: every parameter at once
    torch::Tensor h = torch::relu(fc1_->forward(x)) * frozen_scale_;
    torch::Tensor out = fc2_->forward(h);
    if (step % 2 == 0) out = out + even_bias_;  // no gradient on odd steps
    return torch::nn::functional::mse_loss(out.to(torch::kFloat), y);
  }

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
  torch::Tensor frozen_scale_, even_bias_;
};

// torchvision's ResNet-101: bottleneck blocks 3-4-23-3, batch norm, 1000
// classes; parameter names and shapes match torchvision's (tested against
// tests/fixtures/resnet101_params.json).
struct BottleneckImpl : torch::nn::Module {
  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride, bool downsample) {
    conv1 = register_module(
        "conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(inplanes, planes, 1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(planes));
    conv2 = register_module(
        "conv2",
        torch::nn::Conv2d(
            torch::nn::Conv2dOptions(planes, planes, 3).stride(stride).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(planes));
    conv3 = register_module(
        "conv3", torch::nn::Conv2d(torch::nn::Conv2dOptions(planes, planes * 4, 1).bias(false)));
    bn3 = register_module("bn3", torch::nn::BatchNorm2d(planes * 4));
    if (downsample) {
      down = register_module(
          "downsample",
          torch::nn::Sequential(
              torch::nn::Conv2d(
                  torch::nn::Conv2dOptions(inplanes, planes * 4, 1).stride(stride).bias(false)),
              torch::nn::BatchNorm2d(planes * 4)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    // In-place ReLUs and residual add, as torchvision's Bottleneck (BatchNorm's
    // backward does not read its output; the results are the same bits).
    torch::Tensor out = bn1->forward(conv1->forward(x)).relu_();
    out = bn2->forward(conv2->forward(out)).relu_();
    out = bn3->forward(conv3->forward(out));
    out.add_(down.is_empty() ? x : down->forward(x));
    return out.relu_();
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential down{nullptr};
};
TORCH_MODULE(Bottleneck);

class ResNet101 : public TrainModel, public torch::nn::Module {
 public:
  explicit ResNet101(uint64_t seed) {
    torch::manual_seed(seed);
    conv1 = register_module(
        "conv1",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(64));
    int64_t inplanes = 64;
    const int64_t blocks[4] = {3, 4, 23, 3};
    for (int l = 0; l < 4; ++l) {
      const int64_t planes = 64 << l;
      torch::nn::Sequential layer;
      for (int64_t b = 0; b < blocks[l]; ++b) {
        const int64_t stride = (b == 0 && l > 0) ? 2 : 1;
        layer->push_back(Bottleneck(inplanes, planes, stride, b == 0));
        inplanes = planes * 4;
      }
      layers[l] = register_module("layer" + std::to_string(l + 1), layer);
    }
    fc = register_module("fc", torch::nn::Linear(2048, 1000));
  }
  std::string name() const override { return "resnet101"; }
  torch::nn::Module& module() override { return *this; }
  int64_t batch_per_rank() const override { return 32; }
  torch::Tensor Loss(int64_t step, int64_t begin, int64_t end) override {
    torch::Tensor x =
        SyntheticRows(3 * step + 1, 3 * 32 * 32, begin, end).view({end - begin, 3, 32, 32});
    torch::Tensor labels =
        (SyntheticRows(3 * step + 2, 1, begin, end).view({end - begin}).abs() * 331)
            .to(torch::kLong)
            .remainder(1000);
    Gate(*conv1);
    Gate(*bn1);
    torch::Tensor h = torch::max_pool2d(bn1->forward(conv1->forward(x)).relu_(), 3, 2, 1);
    for (auto& layer : layers) {
      for (auto& block : *layer) {  // one bottleneck at a time
        Gate(*block.ptr());
        h = block.forward(h);
      }
    }
    h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    Gate(*fc);
    return torch::nn::functional::cross_entropy(fc->forward(h), labels);
  }

 private:
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layers[4];
  torch::nn::Linear fc{nullptr};
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
  if (name == "resnet101") return std::unique_ptr<TrainModel>(new ResNet101(seed));
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
      // The holder's gate is the one set_layer_gate sets: it covers every
      // parameter (the small model reads them all at once).
      torch::Tensor Loss(int64_t s, int64_t b, int64_t e) override {
        Gate(m->module());
        return m->Loss(s, b, e);
      }
    };
    auto h = std::make_unique<Holder>();
    h->m = m;
    return std::unique_ptr<TrainModel>(std::move(h));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model '", name, "' (expected mlp, resnet101, small or tiny)"));
}

}  // namespace shardopt
