// CUDA kernels behind server/kernels/cuda/cuda_kernels.h. Compiled by nvcc with
// -fmad=false (no contraction), IEEE division and square root, so each
// element is computed exactly as server/kernels/reference_optimizer.cc computes it.
//
// Multi-tensor: one launch covers up to kMaxSlices slices (more are done in
// batches of that many, as PyTorch's multi_tensor_apply does). The slice table
// travels inside the kernel's parameters (a __grid_constant__ struct, read
// from the constant bank), so a step allocates nothing and copies nothing to
// the device. Each slice is cut into chunks of kChunk elements; blocks walk
// the chunks grid-stride, and the grid is as large as the device holds at
// once (occupancy), so there is no tail wave. Where every array of a slice is
// 16-byte (fp32) or 8-byte (16-bit) aligned, threads move 4 elements per
// access (float4 / 4 x 16-bit); the remainder and misaligned slices take the
// scalar path. Both paths compute each element with the same expression.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "server/kernels/cuda/device_types.h"

namespace shardopt {
namespace cuda {
namespace impl {

namespace {

constexpr int kMaxSlices = 32;
constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

struct Batch {
  DeviceSlice s[kMaxSlices];
  int64_t first_chunk[kMaxSlices + 1];  // prefix sums of each slice's chunk count
  uint32_t vec_mask;                    // bit i: slice i takes 4-wide accesses
  int n;
};
static_assert(sizeof(Batch) + sizeof(AdamArgs) < 4000, "kernel parameters must stay under 4 KB");

// Calls op(slice, begin, len, vectorized) for each chunk this block owns.
template <typename Op>
__device__ __forceinline__ void ForEachChunk(const Batch& b, Op&& op) {
  const int64_t total = b.first_chunk[b.n];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int i = 0;
    while (c >= b.first_chunk[i + 1]) ++i;  // n <= 32 and the same for the whole block
    const int64_t begin = (c - b.first_chunk[i]) * kChunk;
    const int64_t rest = b.s[i].size - begin;
    op(b.s[i], begin, rest < kChunk ? rest : kChunk, ((b.vec_mask >> i) & 1u) != 0);
  }
}

__device__ __forceinline__ float Bf16Bits(uint32_t hi16) { return __uint_as_float(hi16); }

__device__ __forceinline__ float LoadGrad(const void* g, DType t, int64_t i) {
  switch (t) {
    case DType::kBFloat16:
      return Bf16Bits(static_cast<uint32_t>(static_cast<const uint16_t*>(g)[i]) << 16);
    case DType::kFloat16: return __half2float(static_cast<const __half*>(g)[i]);
    default: return static_cast<const float*>(g)[i];
  }
}

// Four gradients from element i (aligned: see Batch::vec_mask).
__device__ __forceinline__ void LoadGrad4(const void* g, DType t, int64_t i, float out[4]) {
  switch (t) {
    case DType::kBFloat16: {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(g) + i);
      out[0] = Bf16Bits(u.x << 16);
      out[1] = Bf16Bits(u.x & 0xffff0000u);
      out[2] = Bf16Bits(u.y << 16);
      out[3] = Bf16Bits(u.y & 0xffff0000u);
      break;
    }
    case DType::kFloat16: {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __half*>(g) + i);
      const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
      const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
      out[0] = a.x;
      out[1] = a.y;
      out[2] = b.x;
      out[3] = b.y;
      break;
    }
    default: {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(g) + i);
      out[0] = f.x;
      out[1] = f.y;
      out[2] = f.z;
      out[3] = f.w;
    }
  }
}

// Round to nearest even, NaN stays NaN: the same bits as FloatToBf16 on the CPU.
__device__ __forceinline__ uint16_t ToBf16(float f) {
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

__device__ __forceinline__ uint16_t To16(float v, DType t) {
  return t == DType::kBFloat16 ? ToBf16(v) : __half_as_ushort(__float2half_rn(v));
}

__device__ __forceinline__ void StoreModel(void* m, DType t, int64_t i, float v) {
  if (m == nullptr) return;
  if (t == DType::kFloat32) {
    static_cast<float*>(m)[i] = v;
  } else {
    static_cast<uint16_t*>(m)[i] = To16(v, t);
  }
}

__device__ __forceinline__ void StoreModel4(void* m, DType t, int64_t i, const float4& v) {
  if (m == nullptr) return;
  if (t == DType::kFloat32) {
    *reinterpret_cast<float4*>(static_cast<float*>(m) + i) = v;
  } else {
    uint2 u;
    u.x = static_cast<uint32_t>(To16(v.x, t)) | (static_cast<uint32_t>(To16(v.y, t)) << 16);
    u.y = static_cast<uint32_t>(To16(v.z, t)) | (static_cast<uint32_t>(To16(v.w, t)) << 16);
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(m) + i) = u;
  }
}

// One element-wise update: f(p, g, s0, s1) on the fp32 master `p`, the
// gradient `g` and up to two fp32 state arrays, then the model copy.
template <bool kState0, bool kState1, typename F>
__device__ __forceinline__ void UpdateChunk(const DeviceSlice& s, int64_t begin, int64_t len,
                                            bool vec, const F& f) {
  int64_t scalar_from = begin;
  if (vec) {
    const int64_t nv = len / 4;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
      const int64_t e = begin + 4 * j;
      float4 p = *reinterpret_cast<const float4*>(s.master + e);
      float g[4];
      LoadGrad4(s.grad, s.grad_type, e, g);
      float4 m = kState0 ? *reinterpret_cast<const float4*>(s.state0 + e) : make_float4(0, 0, 0, 0);
      float4 v = kState1 ? *reinterpret_cast<const float4*>(s.state1 + e) : make_float4(0, 0, 0, 0);
      f(p.x, g[0], m.x, v.x);
      f(p.y, g[1], m.y, v.y);
      f(p.z, g[2], m.z, v.z);
      f(p.w, g[3], m.w, v.w);
      if (kState0) *reinterpret_cast<float4*>(s.state0 + e) = m;
      if (kState1) *reinterpret_cast<float4*>(s.state1 + e) = v;
      *reinterpret_cast<float4*>(s.master + e) = p;
      StoreModel4(s.model, s.model_type, e, p);
    }
    scalar_from = begin + 4 * nv;
  }
  for (int64_t e = scalar_from + threadIdx.x; e < begin + len; e += blockDim.x) {
    float p = s.master[e];
    const float g = LoadGrad(s.grad, s.grad_type, e);
    float m = kState0 ? s.state0[e] : 0.0f;
    float v = kState1 ? s.state1[e] : 0.0f;
    f(p, g, m, v);
    if (kState0) s.state0[e] = m;
    if (kState1) s.state1[e] = v;
    s.master[e] = p;
    StoreModel(s.model, s.model_type, e, p);
  }
}

// The per-element math is server/kernels/optimizer_math.h's, shared with the
// CPU kernels and the reference.
template <bool kL2, bool kDecoupled>
struct AdamOp {
  AdamArgs k;
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    AdamElement<kL2, kDecoupled>(k, p, g, m, v);
  }
};

template <bool kL2, bool kMomentum, bool kFirst, bool kNesterov>
struct SgdOp {
  SgdArgs k;
  __device__ __forceinline__ void operator()(float& p, float g, float& b, float&) const {
    SgdElement<kL2, kMomentum, kFirst, kNesterov>(k, p, g, b);
  }
};

// Adam's memory traffic with trivial arithmetic: the bandwidth reference.
struct SameTrafficOp {
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    SameTrafficElement(p, g, m, v);
  }
};

template <bool kState0, bool kState1, typename F>
__global__ void __launch_bounds__(kThreads) UpdateKernel(const __grid_constant__ Batch b, F f) {
  ForEachChunk(b, [&](const DeviceSlice& s, int64_t begin, int64_t len, bool vec) {
    UpdateChunk<kState0, kState1>(s, begin, len, vec, f);
  });
}

__global__ void __launch_bounds__(kThreads)
    SquaredNormKernel(const __grid_constant__ Batch b, double* out) {
  __shared__ double partial[kThreads];
  double acc = 0;
  ForEachChunk(b, [&](const DeviceSlice& s, int64_t begin, int64_t len, bool vec) {
    int64_t from = begin;
    if (vec) {
      const int64_t nv = len / 4;
      for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
        float g[4];
        LoadGrad4(s.grad, s.grad_type, begin + 4 * j, g);
        for (int q = 0; q < 4; ++q) acc += static_cast<double>(g[q]) * g[q];
      }
      from = begin + 4 * nv;
    }
    for (int64_t e = from + threadIdx.x; e < begin + len; e += blockDim.x) {
      const double g = LoadGrad(s.grad, s.grad_type, e);
      acc += g * g;
    }
  });
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0 && partial[0] != 0.0) atomicAdd(out, partial[0]);
}

__global__ void __launch_bounds__(kThreads)
    OverflowKernel(const __grid_constant__ Batch b, int* flag) {
  bool bad = false;
  ForEachChunk(b, [&](const DeviceSlice& s, int64_t begin, int64_t len, bool vec) {
    int64_t from = begin;
    if (vec) {
      const int64_t nv = len / 4;
      for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
        float g[4];
        LoadGrad4(s.grad, s.grad_type, begin + 4 * j, g);
        bad |= !isfinite(g[0]) || !isfinite(g[1]) || !isfinite(g[2]) || !isfinite(g[3]);
      }
      from = begin + 4 * nv;
    }
    for (int64_t e = from + threadIdx.x; e < begin + len; e += blockDim.x) {
      bad |= !isfinite(LoadGrad(s.grad, s.grad_type, e));
    }
  });
  if (bad) *flag = 1;
}

int Fail(cudaError_t e, const char* what, char* err, int errlen) {
  std::snprintf(err, static_cast<size_t>(errlen), "%s: %s", what, cudaGetErrorString(e));
  return static_cast<int>(e);
}

bool Aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

int Bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Whether every array of `s` allows 4-wide accesses at multiples of 4.
bool Vectorizable(const DeviceSlice& s) {
  return Aligned(s.master, 16) && Aligned(s.state0, 16) && Aligned(s.state1, 16) &&
         Aligned(s.grad, 4 * Bytes(s.grad_type)) &&
         (s.model == nullptr || Aligned(s.model, 4 * Bytes(s.model_type)));
}

// Blocks of `kernel` the device runs at once (cached per kernel and device).
int GridFor(const void* kernel, char* err, int errlen, int* blocks) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return Fail(e, "cudaGetDevice", err, errlen);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({kernel, device});
  if (it == cache.end()) {
    int sms = 1, per_sm = 1;
    e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) return Fail(e, "cudaDeviceGetAttribute", err, errlen);
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
    if (e != cudaSuccess)
      return Fail(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", err, errlen);
    it = cache.emplace(std::make_pair(kernel, device), sms * (per_sm > 0 ? per_sm : 1)).first;
  }
  *blocks = it->second;
  return 0;
}

// Launches `launch(batch, blocks, stream)` for each batch of up to kMaxSlices
// slices (empty slices skipped).
template <typename Launch>
int Run(const void* kernel, const DeviceSlice* slices, int n, void* stream_ptr, char* err,
        int errlen, Launch launch) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int max_blocks = 0;
  if (int rc = GridFor(kernel, err, errlen, &max_blocks); rc != 0) return rc;
  int i = 0;
  while (i < n) {
    Batch b;
    std::memset(&b, 0, sizeof(b));
    b.first_chunk[0] = 0;
    for (; i < n && b.n < kMaxSlices; ++i) {
      if (slices[i].size <= 0) continue;
      b.s[b.n] = slices[i];
      if (Vectorizable(slices[i])) b.vec_mask |= 1u << b.n;
      b.first_chunk[b.n + 1] = b.first_chunk[b.n] + (slices[i].size + kChunk - 1) / kChunk;
      ++b.n;
    }
    const int64_t chunks = b.first_chunk[b.n];
    if (chunks == 0) continue;
    const int blocks = static_cast<int>(chunks < max_blocks ? chunks : max_blocks);
    launch(b, blocks, stream);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return Fail(e, "kernel launch", err, errlen);
  }
  return 0;
}

template <bool kState0, bool kState1, typename F>
int RunUpdate(const F& f, const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  const void* kernel = reinterpret_cast<const void*>(&UpdateKernel<kState0, kState1, F>);
  return Run(kernel, slices, n, stream, err, errlen,
             [&](const Batch& b, int blocks, cudaStream_t st) {
               UpdateKernel<kState0, kState1, F><<<blocks, kThreads, 0, st>>>(b, f);
             });
}

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

int Adam(const AdamArgs& a, const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  if (a.decoupled)
    return RunUpdate<true, true>(AdamOp<false, true>{a}, slices, n, stream, err, errlen);
  if (a.l2) return RunUpdate<true, true>(AdamOp<true, false>{a}, slices, n, stream, err, errlen);
  return RunUpdate<true, true>(AdamOp<false, false>{a}, slices, n, stream, err, errlen);
}

namespace {
template <bool kMomentum, bool kFirst, bool kNesterov>
int SgdWith(const SgdArgs& a, const DeviceSlice* slices, int n, void* stream, char* err,
            int errlen) {
  if (a.l2) {
    return RunUpdate<kMomentum, false>(SgdOp<true, kMomentum, kFirst, kNesterov>{a}, slices, n,
                                       stream, err, errlen);
  }
  return RunUpdate<kMomentum, false>(SgdOp<false, kMomentum, kFirst, kNesterov>{a}, slices, n,
                                     stream, err, errlen);
}
}  // namespace

int Sgd(const SgdArgs& a, const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  if (!a.momentum_enabled) return SgdWith<false, false, false>(a, slices, n, stream, err, errlen);
  if (a.first_step) {
    return a.nesterov ? SgdWith<true, true, true>(a, slices, n, stream, err, errlen)
                      : SgdWith<true, true, false>(a, slices, n, stream, err, errlen);
  }
  return a.nesterov ? SgdWith<true, false, true>(a, slices, n, stream, err, errlen)
                    : SgdWith<true, false, false>(a, slices, n, stream, err, errlen);
}

int SquaredNorm(const DeviceSlice* slices, int n, double* out, void* stream, char* err,
                int errlen) {
  cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Fail(e, "cudaMemsetAsync", err, errlen);
  return Run(reinterpret_cast<const void*>(&SquaredNormKernel), slices, n, stream, err, errlen,
             [&](const Batch& b, int blocks, cudaStream_t st) {
               SquaredNormKernel<<<blocks, kThreads, 0, st>>>(b, out);
             });
}

int CheckOverflow(const DeviceSlice* slices, int n, int* flag, void* stream, char* err,
                  int errlen) {
  cudaError_t e = cudaMemsetAsync(flag, 0, sizeof(int), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Fail(e, "cudaMemsetAsync", err, errlen);
  return Run(reinterpret_cast<const void*>(&OverflowKernel), slices, n, stream, err, errlen,
             [&](const Batch& b, int blocks, cudaStream_t st) {
               OverflowKernel<<<blocks, kThreads, 0, st>>>(b, flag);
             });
}

int SameTraffic(const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  return RunUpdate<true, true>(SameTrafficOp{}, slices, n, stream, err, errlen);
}

}  // namespace impl
}  // namespace cuda
}  // namespace shardopt
