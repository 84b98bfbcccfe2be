// gpu_check: the GPU check that runs where Bazel is not installed (built by
// tools/gpu_check.sh with nvcc alone). Checks the CUDA kernels against a
// scalar reference (the expressions of server/reference_optimizer.cc, copied
// here so this program needs nothing but the CUDA toolkit) on many sizes,
// including 0, 1, odd, chunk edges and more than 2^31 bytes in total, then
// benchmarks Adam against a device-to-device copy. Writes JSON.
//   gpu_check [--json=PATH] [--bench-params=N] [--big=N]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "server/cuda/device_types.h"

using namespace shardopt::cuda;

namespace {

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

AdamArgs MakeAdam(int64_t step, bool adamw) {
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = adamw ? 1e-2 : 0.0;
  AdamArgs a;
  a.grad_sign = 1.0f;
  a.weight_decay = static_cast<float>(wd);
  a.decay = adamw ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  a.l2 = 0;
  a.decoupled = adamw ? 1 : 0;
  a.beta1 = static_cast<float>(b1);
  a.one_minus_beta1 = static_cast<float>(1.0 - b1);
  a.beta2 = static_cast<float>(b2);
  a.one_minus_beta2 = static_cast<float>(1.0 - b2);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, static_cast<double>(step))));
  a.eps = static_cast<float>(eps);
  a.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(b1, static_cast<double>(step)))));
  return a;
}

// The reference, element by element (compiled without contraction: see the build).
void ReferenceAdam(const AdamArgs& k, float* p, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    float gi = g[i] * k.grad_sign;
    if (k.l2) gi = gi + k.weight_decay * pi;
    if (k.decoupled) pi = pi * k.decay;
    const float mi = m[i] * k.beta1 + k.one_minus_beta1 * gi;
    const float vi = v[i] * k.beta2 + k.one_minus_beta2 * gi * gi;
    const float denom = std::sqrt(vi) / k.bias_correction2_sqrt + k.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi + k.neg_step_size * mi / denom;
  }
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Result {
  std::string name;
  bool ok;
  std::string detail;
};

// One correctness case: `sizes` slices, `steps` steps, fp32 master + bf16 or
// fp16 model copy; compares bitwise.
Result CheckCase(const std::vector<int64_t>& sizes, bool adamw, ParamType model_type, int steps) {
  std::vector<std::vector<float>> p, g, m, v;
  std::vector<DeviceSlice> dev;
  std::vector<void*> allocs;
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0, 1);
  for (int64_t n : sizes) {
    p.emplace_back(n);
    g.emplace_back(n);
    m.emplace_back(n, 0.0f);
    v.emplace_back(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      p.back()[i] = d(rng);
      g.back()[i] = 0.1f * d(rng);
    }
    DeviceSlice s;
    const size_t b = static_cast<size_t>(std::max<int64_t>(n, 1)) * 4;
    float *dp, *dg, *dm, *dv;
    void* dmodel;
    CHECK_CUDA(cudaMalloc(&dp, b));
    CHECK_CUDA(cudaMalloc(&dg, b));
    CHECK_CUDA(cudaMalloc(&dm, b));
    CHECK_CUDA(cudaMalloc(&dv, b));
    CHECK_CUDA(cudaMalloc(&dmodel, b));
    allocs.insert(allocs.end(), {dp, dg, dm, dv, dmodel});
    CHECK_CUDA(cudaMemcpy(dp, p.back().data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dg, g.back().data(), n * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dm, 0, b));
    CHECK_CUDA(cudaMemset(dv, 0, b));
    s.master = dp;
    s.grad = dg;
    s.state0 = dm;
    s.state1 = dv;
    s.model = dmodel;
    s.model_type = model_type;
    s.size = n;
    dev.push_back(s);
  }
  char err[256];
  for (int step = 1; step <= steps; ++step) {
    const AdamArgs a = MakeAdam(step, adamw);
    if (impl::Adam(a, dev.data(), static_cast<int>(dev.size()), nullptr, err, sizeof(err)) != 0) {
      return {"", false, err};
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      ReferenceAdam(a, p[i].data(), g[i].data(), m[i].data(), v[i].data(), sizes[i]);
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::string detail;
  bool ok = true;
  for (size_t i = 0; i < sizes.size() && ok; ++i) {
    const int64_t n = sizes[i];
    std::vector<float> got(n);
    CHECK_CUDA(cudaMemcpy(got.data(), dev[i].master, n * 4, cudaMemcpyDeviceToHost));
    for (int64_t k = 0; k < n; ++k) {
      if (std::memcmp(&got[k], &p[i][k], 4) != 0) {
        ok = false;
        detail = "size " + std::to_string(n) + " element " + std::to_string(k) + ": gpu " +
                 std::to_string(got[k]) + " reference " + std::to_string(p[i][k]);
        break;
      }
    }
    std::vector<uint16_t> model(n);
    CHECK_CUDA(cudaMemcpy(model.data(), dev[i].model, n * 2, cudaMemcpyDeviceToHost));
    for (int64_t k = 0; k < n && ok; k += 1 + n / 4096) {
      const uint16_t want = model_type == ParamType::kBFloat16
                                ? ToBf16(p[i][k])
                                : __half_as_ushort(__float2half_rn(p[i][k]));
      if (model[k] != want) {
        ok = false;
        detail = "model copy differs at size " + std::to_string(n) + " element " + std::to_string(k);
      }
    }
  }
  for (void* a : allocs) cudaFree(a);
  return {"", ok, ok ? "bitwise equal" : detail};
}

double TimeIt(const std::function<void()>& fn, int reps) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn();  // warm-up
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / 1000.0 / reps;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json = "gpu_check.json";
  int64_t bench_n = int64_t{1} << 27;  // 134M fp32 parameters
  int64_t big = 600000000;              // one slice of 2.4 GB per array
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--json=", 0) == 0) json = a.substr(7);
    if (a.rfind("--bench-params=", 0) == 0) bench_n = std::atoll(a.c_str() + 15);
    if (a.rfind("--big=", 0) == 0) big = std::atoll(a.c_str() + 6);
  }
  const int devices = impl::DeviceCount();
  FILE* out = std::fopen(json.c_str(), "w");
  if (devices == 0) {
    std::printf("gpu_check: no CUDA device; nothing to check\n");
    std::fprintf(out, "{\"devices\": 0}\n");
    std::fclose(out);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("gpu_check: %s (sm_%d%d, %.0f GiB)\n", prop.name, prop.major, prop.minor,
              prop.totalGlobalMem / 1073741824.0);
  std::vector<Result> results;
  const std::vector<int64_t> sizes = {0, 1, 7, 8, 15, 16, 1023, 65535, 65536, 65537, 1000003, 1 << 20};
  for (bool adamw : {false, true}) {
    for (ParamType t : {ParamType::kBFloat16, ParamType::kFloat16}) {
      Result r = CheckCase(sizes, adamw, t, 5);
      r.name = std::string(adamw ? "adamw" : "adam") + (t == ParamType::kBFloat16 ? "_bf16" : "_fp16") +
               "_many_sizes";
      results.push_back(r);
    }
  }
  if (big > 0) {
    Result r = CheckCase({big, 3}, false, ParamType::kBFloat16, 2);
    r.name = "adam_over_2GiB_per_array";
    results.push_back(r);
  }
  bool all_ok = true;
  for (const Result& r : results) {
    std::printf("  %-28s %s\n", r.name.c_str(), r.ok ? "ok (bitwise equal)" : ("FAILED: " + r.detail).c_str());
    all_ok &= r.ok;
  }
  // Benchmark: Adam on bench_n fp32 parameters vs a device-to-device copy.
  float *p, *g, *m, *v, *src, *dst;
  const size_t b = static_cast<size_t>(bench_n) * 4;
  CHECK_CUDA(cudaMalloc(&p, b));
  CHECK_CUDA(cudaMalloc(&g, b));
  CHECK_CUDA(cudaMalloc(&m, b));
  CHECK_CUDA(cudaMalloc(&v, b));
  CHECK_CUDA(cudaMemset(p, 0, b));
  CHECK_CUDA(cudaMemset(g, 0, b));
  CHECK_CUDA(cudaMemset(m, 0, b));
  CHECK_CUDA(cudaMemset(v, 0, b));
  DeviceSlice s;
  s.master = p;
  s.grad = g;
  s.state0 = m;
  s.state1 = v;
  s.size = bench_n;
  char err[256];
  const AdamArgs a = MakeAdam(10, false);
  const double t_adam = TimeIt([&] { impl::Adam(a, &s, 1, nullptr, err, sizeof(err)); }, 20);
  const double t_same = TimeIt([&] { impl::SameTraffic(&s, 1, nullptr, err, sizeof(err)); }, 20);
  CHECK_CUDA(cudaMalloc(&src, 2 * b));
  CHECK_CUDA(cudaMalloc(&dst, 2 * b));
  const double t_copy = TimeIt([&] { cudaMemcpyAsync(dst, src, 2 * b, cudaMemcpyDeviceToDevice); }, 20);
  const double adam_gbps = 28.0 * bench_n / t_adam / 1e9;
  const double copy_gbps = 2.0 * 2 * b / t_copy / 1e9;
  const double same_gbps = 28.0 * bench_n / t_same / 1e9;
  std::printf("  Adam on %lld params: %.3f ms, %.0f GB/s; same-traffic %.0f GB/s; d2d copy %.0f GB/s; "
              "adam_copy_fraction %.3f\n",
              static_cast<long long>(bench_n), t_adam * 1e3, adam_gbps, same_gbps, copy_gbps,
              adam_gbps / copy_gbps);
  std::fprintf(out,
               "{\"device\": \"%s\", \"devices\": %d, \"correctness_ok\": %s, \"bench_params\": %lld, "
               "\"adam_ms\": %.4f, \"adam_gbps\": %.2f, \"same_traffic_gbps\": %.2f, "
               "\"d2d_copy_gbps\": %.2f, \"adam_copy_fraction\": %.4f, \"cases\": [",
               prop.name, devices, all_ok ? "true" : "false", static_cast<long long>(bench_n),
               t_adam * 1e3, adam_gbps, same_gbps, copy_gbps, adam_gbps / copy_gbps);
  for (size_t i = 0; i < results.size(); ++i) {
    std::fprintf(out, "%s{\"name\": \"%s\", \"ok\": %s}", i ? ", " : "", results[i].name.c_str(),
                 results[i].ok ? "true" : "false");
  }
  std::fprintf(out, "]}\n");
  std::fclose(out);
  return all_ok ? 0 : 1;
}
