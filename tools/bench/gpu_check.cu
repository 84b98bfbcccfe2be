// gpu_check: the GPU check that runs where Bazel is not installed (built by
// tools/gpu_check.sh with nvcc alone). Checks the CUDA kernels against a
// scalar reference (the expressions of server/kernels/reference_optimizer.cc, copied
// here so this program needs nothing but the CUDA toolkit) on many sizes,
// including 0, 1, odd, chunk edges and more than 2^31 bytes in total, then
// benchmarks Adam against a device-to-device copy. Writes JSON.
//   gpu_check [--json=PATH] [--bench-params=N] [--big=N]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "server/kernels/cuda/device_types.h"

using namespace shardopt::cuda;

namespace {

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
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
  a.bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(b2, static_cast<double>(step))));
  a.eps = static_cast<float>(eps);
  a.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(b1, static_cast<double>(step)))));
  return a;
}

SgdArgs MakeSgd(int64_t step, bool nesterov) {
  SgdArgs a;
  a.grad_sign = 1.0f;
  a.weight_decay = 1e-4f;
  a.l2 = 1;
  a.momentum_enabled = 1;
  a.first_step = step == 1 ? 1 : 0;
  a.nesterov = nesterov ? 1 : 0;
  a.momentum = 0.9f;
  a.one_minus_dampening = 1.0f;
  a.neg_lr = -0.01f;
  return a;
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float FromBf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t To16(float f, DType t) {
  return t == DType::kBFloat16 ? ToBf16(f) : __half_as_ushort(__float2half_rn(f));
}
float From16(uint16_t h, DType t) {
  return t == DType::kBFloat16 ? FromBf16(h) : __half2float(__ushort_as_half(h));
}

// The reference, element by element: server/kernels/optimizer_math.h's
// functions (those of server/kernels/reference_optimizer.cc), run on the host
// without contraction (see the build).
void ReferenceAdam(const AdamArgs& k, float* p, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) AdamElementAny(k, p[i], g[i], m[i], v[i]);
}
void ReferenceSgd(const SgdArgs& k, float* p, const float* g, float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) SgdElementAny(k, p[i], g[i], b[i]);
}

// Cheap deterministic values (the > 2 GiB case fills billions).
struct Rng {
  uint64_t s;
  float Next() {  // roughly uniform in [-1, 1)
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<float>(static_cast<int32_t>(s >> 32)) * (1.0f / 2147483648.0f);
  }
};

struct Result {
  std::string name;
  bool ok;
  std::string detail;
};

enum class Opt { kAdam, kAdamW, kSgd, kSgdNesterov };

// One correctness case: `sizes` slices updated together (one multi-tensor
// call per step), `steps` steps; gradients in `grad_type`; a model copy in
// `model_type` unless `with_model` is false; `offset` elements shift every
// device array off 16-byte alignment (the scalar path). Compares bitwise.
Result CheckCase(const std::vector<int64_t>& sizes, Opt opt, DType grad_type, bool with_model,
                 DType model_type, int steps, int offset = 0) {
  std::vector<std::vector<float>> p, g, m, v;
  std::vector<DeviceSlice> dev;
  std::vector<void*> allocs;
  Rng rng{0x9e3779b97f4a7c15ull};
  for (int64_t n : sizes) {
    p.emplace_back(n);
    g.emplace_back(n);
    m.emplace_back(n, 0.0f);
    v.emplace_back(n, 0.0f);
    std::vector<uint16_t> g16(grad_type == DType::kFloat32 ? 0 : n);
    for (int64_t i = 0; i < n; ++i) {
      p.back()[i] = rng.Next();
      float gi = 0.1f * rng.Next();
      if (grad_type != DType::kFloat32) {
        g16[i] = To16(gi, grad_type);
        gi = From16(g16[i], grad_type);
      }
      g.back()[i] = gi;
    }
    const size_t b = (static_cast<size_t>(n) + offset + 4) * 4;
    char *dp, *dg, *dm, *dv, *dmodel;
    CHECK_CUDA(cudaMalloc(&dp, b));
    CHECK_CUDA(cudaMalloc(&dg, b));
    CHECK_CUDA(cudaMalloc(&dm, b));
    CHECK_CUDA(cudaMalloc(&dv, b));
    CHECK_CUDA(cudaMalloc(&dmodel, b));
    allocs.insert(allocs.end(), {dp, dg, dm, dv, dmodel});
    DeviceSlice s;
    s.master = reinterpret_cast<float*>(dp) + offset;
    s.grad_type = grad_type;
    s.grad = dg + offset * (grad_type == DType::kFloat32 ? 4 : 2);
    s.state0 = reinterpret_cast<float*>(dm) + offset;
    s.state1 = reinterpret_cast<float*>(dv) + offset;
    s.model = with_model ? dmodel + offset * (model_type == DType::kFloat32 ? 4 : 2) : nullptr;
    s.model_type = model_type;
    s.size = n;
    CHECK_CUDA(cudaMemcpy(s.master, p.back().data(), n * 4, cudaMemcpyHostToDevice));
    if (grad_type == DType::kFloat32) {
      CHECK_CUDA(
          cudaMemcpy(const_cast<void*>(s.grad), g.back().data(), n * 4, cudaMemcpyHostToDevice));
    } else {
      CHECK_CUDA(cudaMemcpy(const_cast<void*>(s.grad), g16.data(), n * 2, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMemset(dm, 0, b));
    CHECK_CUDA(cudaMemset(dv, 0, b));
    dev.push_back(s);
  }
  char err[256];
  for (int step = 1; step <= steps; ++step) {
    int rc = 0;
    if (opt == Opt::kAdam || opt == Opt::kAdamW) {
      const AdamArgs a = MakeAdam(step, opt == Opt::kAdamW);
      rc = impl::Adam(a, dev.data(), static_cast<int>(dev.size()), nullptr, err, sizeof(err));
      for (size_t i = 0; i < sizes.size(); ++i) {
        ReferenceAdam(a, p[i].data(), g[i].data(), m[i].data(), v[i].data(), sizes[i]);
      }
    } else {
      const SgdArgs a = MakeSgd(step, opt == Opt::kSgdNesterov);
      rc = impl::Sgd(a, dev.data(), static_cast<int>(dev.size()), nullptr, err, sizeof(err));
      for (size_t i = 0; i < sizes.size(); ++i)
        ReferenceSgd(a, p[i].data(), g[i].data(), m[i].data(), sizes[i]);
    }
    if (rc != 0) return {"", false, err};
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
    CHECK_CUDA(cudaMemcpy(got.data(), dev[i].state0, n * 4, cudaMemcpyDeviceToHost));
    if (ok && n > 0 && std::memcmp(got.data(), m[i].data(), n * 4) != 0) {
      ok = false;
      detail = "first state differs at size " + std::to_string(n);
    }
    if (!with_model || !ok) continue;
    if (model_type == DType::kFloat32) {
      CHECK_CUDA(cudaMemcpy(got.data(), dev[i].model, n * 4, cudaMemcpyDeviceToHost));
      if (n > 0 && std::memcmp(got.data(), p[i].data(), n * 4) != 0) {
        ok = false;
        detail = "fp32 model copy differs at size " + std::to_string(n);
      }
      continue;
    }
    std::vector<uint16_t> model(n);
    CHECK_CUDA(cudaMemcpy(model.data(), dev[i].model, n * 2, cudaMemcpyDeviceToHost));
    for (int64_t k = 0; k < n && ok; ++k) {
      if (model[k] != To16(p[i][k], model_type)) {
        ok = false;
        detail = "16-bit model copy differs at size " + std::to_string(n) + " element " +
                 std::to_string(k);
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
  int64_t big = 600000000;             // one slice of 2.4 GB per array
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
  const std::vector<int64_t> sizes = {0,    1,     3,     7,     8,     15,      16,
                                      1023, 16383, 16384, 16385, 65537, 1000003, 1 << 20};
  auto add = [&](const std::string& name, Result r) {
    r.name = name;
    std::printf("  %-34s %s\n", name.c_str(),
                r.ok ? "ok (bitwise equal)" : ("FAILED: " + r.detail).c_str());
    std::fflush(stdout);
    results.push_back(r);
  };
  const DType kF32 = DType::kFloat32, kBf16 = DType::kBFloat16, kF16 = DType::kFloat16;
  add("adam_fp32", CheckCase(sizes, Opt::kAdam, kF32, false, kF32, 5));
  add("adamw_fp32", CheckCase(sizes, Opt::kAdamW, kF32, false, kF32, 5));
  add("adam_fp32_model_copy", CheckCase(sizes, Opt::kAdam, kF32, true, kF32, 3));
  add("adam_bf16_model_fp32_master", CheckCase(sizes, Opt::kAdam, kF32, true, kBf16, 5));
  add("adamw_fp16_model_fp32_master", CheckCase(sizes, Opt::kAdamW, kF32, true, kF16, 5));
  add("adam_bf16_grads_bf16_model", CheckCase(sizes, Opt::kAdam, kBf16, true, kBf16, 5));
  add("adam_fp16_grads_fp16_model", CheckCase(sizes, Opt::kAdam, kF16, true, kF16, 5));
  add("sgd_momentum_fp32", CheckCase(sizes, Opt::kSgd, kF32, false, kF32, 5));
  add("sgd_nesterov_bf16_model", CheckCase(sizes, Opt::kSgdNesterov, kF32, true, kBf16, 5));
  add("adam_misaligned_scalar_path", CheckCase(sizes, Opt::kAdam, kF32, true, kBf16, 3, 1));
  add("adam_bf16_misaligned", CheckCase(sizes, Opt::kAdam, kBf16, true, kBf16, 3, 2));
  {
    std::vector<int64_t> many;  // more slices than one launch takes (batches of 32)
    for (int i = 0; i < 100; ++i) many.push_back(1 + (i * 7919) % 40000);
    add("adam_100_slices", CheckCase(many, Opt::kAdam, kF32, true, kBf16, 3));
  }
  if (big > 0)
    add("adam_over_2GiB_per_array", CheckCase({big, 3}, Opt::kAdam, kF32, true, kBf16, 2));
  bool all_ok = true;
  for (const Result& r : results) all_ok &= r.ok;
  // Benchmark: Adam on bench_n fp32 parameters vs a device-to-device copy of
  // a buffer of the same size as one Adam pass moves, all in this run.
  float *p, *g, *m, *v;
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
  const int reps = 20;
  auto adam = [&](const std::vector<DeviceSlice>& sl) {
    if (impl::Adam(a, sl.data(), static_cast<int>(sl.size()), nullptr, err, sizeof(err)) != 0) {
      std::fprintf(stderr, "Adam failed: %s\n", err);
      std::exit(1);
    }
  };
  const std::vector<DeviceSlice> one = {s};
  // The same parameters as ~145 slices of GPT-2-like uneven sizes (multi-tensor):
  // `aligned` rounds each size up to 64 elements, as allocators and our
  // layout's alignment do; otherwise odd sizes leave most slices misaligned,
  // which takes the scalar path.
  auto slices_of = [&](bool aligned) {
    std::vector<DeviceSlice> out;
    int64_t at = 0;
    for (int i = 0; at < bench_n; ++i) {
      DeviceSlice t = s;
      int64_t want = (i % 4 == 0) ? bench_n / 40 : (i % 4 == 1 ? bench_n / 400 : 768 * 4 + i);
      if (aligned) want = (want + 63) / 64 * 64;
      t.size = std::min<int64_t>(want, bench_n - at);
      t.master = p + at;
      t.grad = g + at;
      t.state0 = m + at;
      t.state1 = v + at;
      out.push_back(t);
      at += t.size;
    }
    return out;
  };
  const std::vector<DeviceSlice> many = slices_of(true);
  const std::vector<DeviceSlice> many_misaligned = slices_of(false);
  // bf16 model copy with fp32 master (mixed precision): 2 more bytes/param.
  uint16_t* model16;
  CHECK_CUDA(cudaMalloc(&model16, bench_n * 2));
  DeviceSlice sm = s;
  sm.model = model16;
  sm.model_type = DType::kBFloat16;
  const std::vector<DeviceSlice> mixed = {sm};
  void *src, *dst;
  const size_t copy_bytes =
      14 * static_cast<size_t>(bench_n);  // 28 bytes/param moved, half each way
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 0, copy_bytes));
  double t_adam = 1e30, t_same = 1e30, t_copy = 1e30, t_many = 1e30, t_mixed = 1e30, t_mis = 1e30;
  for (int round = 0; round < 3; ++round) {  // interleaved rounds, best of each
    t_adam = std::min(t_adam, TimeIt([&] { adam(one); }, reps));
    t_same = std::min(t_same,
                      TimeIt([&] { impl::SameTraffic(&s, 1, nullptr, err, sizeof(err)); }, reps));
    t_copy = std::min(
        t_copy,
        TimeIt([&] { cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice); }, reps));
    t_many = std::min(t_many, TimeIt([&] { adam(many); }, reps));
    t_mixed = std::min(t_mixed, TimeIt([&] { adam(mixed); }, reps));
    t_mis = std::min(t_mis, TimeIt([&] { adam(many_misaligned); }, reps));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const double adam_gbps = 28.0 * bench_n / t_adam / 1e9;
  const double copy_gbps = 2.0 * copy_bytes / t_copy / 1e9;
  const double same_gbps = 28.0 * bench_n / t_same / 1e9;
  const double many_gbps = 28.0 * bench_n / t_many / 1e9;
  const double mixed_gbps = 30.0 * bench_n / t_mixed / 1e9;
  const double mis_gbps = 28.0 * bench_n / t_mis / 1e9;
  std::printf(
      "  Adam on %lld fp32 params: %.3f ms, %.0f GB/s; same-traffic kernel %.0f GB/s; d2d copy "
      "%.0f GB/s; "
      "adam_copy_fraction %.3f\n",
      static_cast<long long>(bench_n), t_adam * 1e3, adam_gbps, same_gbps, copy_gbps,
      adam_gbps / copy_gbps);
  std::printf(
      "  Adam over %zu aligned slices: %.0f GB/s; over %zu misaligned slices (scalar path): %.0f "
      "GB/s; "
      "one slice with a bf16 model copy: %.0f GB/s\n",
      many.size(), many_gbps, many_misaligned.size(), mis_gbps, mixed_gbps);
  std::fprintf(
      out,
      "{\"device\": \"%s\", \"devices\": %d, \"correctness_ok\": %s, \"bench_params\": %lld, "
      "\"adam_ms\": %.4f, \"adam_gbps\": %.2f, \"same_traffic_gbps\": %.2f, "
      "\"d2d_copy_gbps\": %.2f, \"adam_copy_fraction\": %.4f, \"adam_multi_slice_count\": %zu, "
      "\"adam_multi_slice_gbps\": %.2f, \"adam_misaligned_multi_slice_gbps\": %.2f, "
      "\"adam_bf16_model_gbps\": %.2f, \"cases\": [",
      prop.name, devices, all_ok ? "true" : "false", static_cast<long long>(bench_n), t_adam * 1e3,
      adam_gbps, same_gbps, copy_gbps, adam_gbps / copy_gbps, many.size(), many_gbps, mis_gbps,
      mixed_gbps);
  for (size_t i = 0; i < results.size(); ++i) {
    std::fprintf(out, "%s{\"name\": \"%s\", \"ok\": %s}", i ? ", " : "", results[i].name.c_str(),
                 results[i].ok ? "true" : "false");
  }
  std::fprintf(out, "]}\n");
  std::fclose(out);
  return all_ok ? 0 : 1;
}
