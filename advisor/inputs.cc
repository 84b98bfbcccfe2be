#include "advisor/inputs.h"

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_system.h"

namespace shardopt {
namespace advisor {
namespace {

absl::StatusOr<nlohmann::json> ParseJson(const std::string& text, const char* what) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("not a ", what, " --json result"));
  }
  return j;
}

}  // namespace

absl::StatusOr<Link> LinkFromBenchComm(const std::string& json_text, const std::string& transport) {
  auto j = ParseJson(json_text, "bench_comm");
  if (!j.ok()) return j.status();
  const char* key = transport == "shm"    ? "shm_rs_ag_s"
                    : transport == "gloo" ? "rs_ag_s_seg4096k"
                                          : nullptr;
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport must be gloo or shm, got '", transport, "'"));
  }
  const int n = j->value("ranks", 2);
  if (!j->contains("sizes") || !(*j)["sizes"].is_array() || n < 2) {
    return absl::InvalidArgumentError("bench_comm result has no sizes (or fewer than 2 ranks)");
  }
  // Least squares t = a + b S.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  int k = 0;
  for (const auto& s : (*j)["sizes"]) {
    if (!s.contains(key) || !s.contains("size_mb")) continue;
    const double x = s["size_mb"].get<double>() * 1e6;  // bench_comm's MB
    const double y = s[key].get<double>();
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
    ++k;
  }
  if (k < 2) return absl::InvalidArgumentError(absl::StrCat("fewer than 2 sizes with ", key));
  const double b = (k * sxy - sx * sy) / (k * sxx - sx * sx);
  const double a = (sy - b * sx) / k;
  if (!(b > 0)) return absl::InvalidArgumentError("bench_comm times do not grow with size");
  Link l;
  l.name = absl::StrCat("measured-", transport);
  l.bandwidth = 2.0 * (n - 1) / n / b;
  l.latency = 0.0;
  l.per_call = std::max(0.0, a / 2.0);
  l.source = absl::StrCat("fitted to bench_comm's ", transport,
                          " reduce-scatter + all-gather over ", k, " sizes");
  return l;
}

absl::StatusOr<OptimizerCost> OptimizerCostFromBenchKernels(const std::string& json_text) {
  auto j = ParseJson(json_text, "bench_kernels");
  if (!j.ok()) return j.status();
  if (!j->contains("adam_ns_per_param_1t") || !j->contains("adam_vs_torch_speedup_1t")) {
    return absl::InvalidArgumentError("bench_kernels result lacks adam_ns_per_param_1t");
  }
  OptimizerCost c;
  const double fused = (*j)["adam_ns_per_param_1t"].get<double>() * 1e-9;
  c.fused_s_per_element = fused;
  c.unfused_s_per_element = fused * (*j)["adam_vs_torch_speedup_1t"].get<double>();
  return c;
}

absl::StatusOr<double> ComputeFromBenchOss(const std::string& json_text, const std::string& model) {
  auto j = ParseJson(json_text, "bench_oss");
  if (!j.ok()) return j.status();
  if (!j->contains(model) || !(*j)[model].is_object()) {
    return absl::NotFoundError(absl::StrCat("bench_oss result has no model '", model, "'"));
  }
  for (const auto& [row, v] : (*j)[model].items()) {
    if (row.rfind("compute_only", 0) == 0 && v.contains("fwd_bwd_s")) {
      return v["fwd_bwd_s"].get<double>();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("bench_oss result has no compute_only row for '", model, "'"));
}

absl::StatusOr<Link> LinkFromSpec(const std::string& spec) {
  const size_t colon = spec.rfind(':');
  const std::string file = spec.substr(0, colon == std::string::npos ? spec.size() : colon);
  if (!absl::EndsWith(file, ".json")) return FindLink(spec);
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", spec, "': say FILE.json:gloo or :shm"));
  }
  auto text = ReadConfigFile(file, kMaxInputBytes);
  if (!text.ok()) return text.status();
  return LinkFromBenchComm(*text, spec.substr(colon + 1));
}

absl::StatusOr<std::vector<ParamSpec>> StandardModel(const std::string& spec) {
  auto gpt = [&](int l, int h, int v, int s) { return GptShapes(l, h, v, s); };
  if (spec == "gpt2-small") return gpt(12, 768, 50257, 1024);
  if (spec == "gpt-1.3b") return gpt(24, 2048, 50257, 2048);
  if (spec == "gpt-7b") return gpt(32, 4096, 50257, 2048);
  if (spec.rfind("mlp:", 0) == 0) {  // Linear layers: weights [out, in], biases [out]
    std::vector<std::string> f = absl::StrSplit(spec.substr(4), ',');
    std::vector<int64_t> w;
    for (const std::string& x : f) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(x, &v) || v < 1 || v > (int64_t{1} << 24)) {
        return absl::InvalidArgumentError(
            absl::StrCat("mlp:...: '", x, "' is not an integer in [1, 16777216]"));
      }
      w.push_back(v);
    }
    if (w.size() < 2)
      return absl::InvalidArgumentError("mlp:IN,HIDDEN...,OUT: at least two widths");
    std::vector<ParamSpec> out;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      out.push_back(ParamSpec{absl::StrCat(i, ".weight"), {w[i + 1], w[i]}, DType::kFloat32, true});
      out.push_back(ParamSpec{absl::StrCat(i, ".bias"), {w[i + 1]}, DType::kFloat32, true});
    }
    return out;
  }
  if (spec.rfind("gpt:", 0) == 0) {
    std::vector<std::string> f = absl::StrSplit(spec.substr(4), ',');
    int v[4];
    if (f.size() != 4)
      return absl::InvalidArgumentError("gpt:LAYERS,HIDDEN,VOCAB,SEQ: four integers");
    for (int i = 0; i < 4; ++i) {
      if (!absl::SimpleAtoi(f[i], &v[i]) || v[i] < 1 || v[i] > (1 << 24)) {
        return absl::InvalidArgumentError(
            absl::StrCat("gpt:...: '", f[i], "' is not an integer in [1, 16777216]"));
      }
    }
    return gpt(v[0], v[1], v[2], v[3]);
  }
  return absl::NotFoundError(absl::StrCat("no standard model '", spec, "'"));
}

std::vector<ParamSpec> GptShapes(int layers, int hidden, int vocab, int seq) {
  const int64_t h = hidden;
  std::vector<ParamSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    out.push_back(ParamSpec{std::move(name), std::move(shape), DType::kFloat32, true});
  };
  add("wte.weight", {vocab, h});
  add("wpe.weight", {seq, h});
  for (int l = 0; l < layers; ++l) {
    const std::string p = absl::StrCat("h.", l, ".");
    add(p + "ln_1.weight", {h});
    add(p + "ln_1.bias", {h});
    add(p + "attn.c_attn.weight", {h, 3 * h});
    add(p + "attn.c_attn.bias", {3 * h});
    add(p + "attn.c_proj.weight", {h, h});
    add(p + "attn.c_proj.bias", {h});
    add(p + "ln_2.weight", {h});
    add(p + "ln_2.bias", {h});
    add(p + "mlp.c_fc.weight", {h, 4 * h});
    add(p + "mlp.c_fc.bias", {4 * h});
    add(p + "mlp.c_proj.weight", {4 * h, h});
    add(p + "mlp.c_proj.bias", {h});
  }
  add("ln_f.weight", {h});
  add("ln_f.bias", {h});
  return out;
}

}  // namespace advisor
}  // namespace shardopt
