// CUDA kernels behind server/cuda/cuda_kernels.h. Compiled by nvcc with
// -fmad=false (no contraction), IEEE division and square root, so each
// element is computed exactly as server/reference_optimizer.cc computes it.
// Work is a table of chunks (slice, begin, length) walked grid-stride, so one
// launch covers every owned slice whatever their sizes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "server/cuda/device_types.h"

namespace shardopt {
namespace cuda {
namespace impl {

namespace {

constexpr int64_t kChunk = 64 * 1024;
constexpr int kThreads = 256;

struct Chunk {
  int32_t slice;
  int64_t begin;
  int64_t len;
};

__device__ __forceinline__ float LoadGrad(const void* g, ParamType t, int64_t i) {
  switch (t) {
    case ParamType::kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(g)[i]) << 16;
      return __uint_as_float(bits);
    }
    case ParamType::kFloat16:
      return __half2float(static_cast<const __half*>(g)[i]);
    default:
      return static_cast<const float*>(g)[i];
  }
}

// Round to nearest even, NaN stays NaN: the same bits as FloatToBf16 on the CPU.
__device__ __forceinline__ uint16_t ToBf16(float f) {
  uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

__device__ __forceinline__ void StoreModel(void* m, ParamType t, int64_t i, float v) {
  if (m == nullptr) return;
  switch (t) {
    case ParamType::kBFloat16: static_cast<uint16_t*>(m)[i] = ToBf16(v); break;
    case ParamType::kFloat16: static_cast<__half*>(m)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(m)[i] = v; break;
  }
}

template <bool kL2, bool kDecoupled>
__global__ void AdamKernel(AdamArgs k, const DeviceSlice* slices, const Chunk* chunks, int nchunks) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const DeviceSlice s = slices[ch.slice];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.begin + ch.len; i += blockDim.x) {
      float p = s.master[i];
      float g = LoadGrad(s.grad, s.grad_type, i) * k.grad_sign;
      if (kL2) g = g + k.weight_decay * p;
      if (kDecoupled) p = p * k.decay;
      const float m = s.state0[i] * k.beta1 + k.one_minus_beta1 * g;
      const float v = s.state1[i] * k.beta2 + k.one_minus_beta2 * g * g;
      const float denom = sqrtf(v) / k.bias_correction2_sqrt + k.eps;
      p = p + k.neg_step_size * m / denom;
      s.state0[i] = m;
      s.state1[i] = v;
      s.master[i] = p;
      StoreModel(s.model, s.model_type, i, p);
    }
  }
}

template <bool kL2, bool kMomentum, bool kFirst, bool kNesterov>
__global__ void SgdKernel(SgdArgs k, const DeviceSlice* slices, const Chunk* chunks, int nchunks) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const DeviceSlice s = slices[ch.slice];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.begin + ch.len; i += blockDim.x) {
      float p = s.master[i];
      float d = LoadGrad(s.grad, s.grad_type, i) * k.grad_sign;
      if (kL2) d = d + k.weight_decay * p;
      if (kMomentum) {
        const float b = kFirst ? d : s.state0[i] * k.momentum + k.one_minus_dampening * d;
        s.state0[i] = b;
        d = kNesterov ? d + k.momentum * b : b;
      }
      p = p + k.neg_lr * d;
      s.master[i] = p;
      StoreModel(s.model, s.model_type, i, p);
    }
  }
}

__global__ void SquaredNormKernel(const DeviceSlice* slices, const Chunk* chunks, int nchunks,
                                  double* out) {
  __shared__ double partial[kThreads];
  double acc = 0;
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const DeviceSlice s = slices[ch.slice];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.begin + ch.len; i += blockDim.x) {
      const double g = LoadGrad(s.grad, s.grad_type, i);
      acc += g * g;
    }
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

__global__ void OverflowKernel(const DeviceSlice* slices, const Chunk* chunks, int nchunks, int* flag) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const DeviceSlice s = slices[ch.slice];
    for (int64_t i = ch.begin + threadIdx.x; i < ch.begin + ch.len; i += blockDim.x) {
      if (!isfinite(LoadGrad(s.grad, s.grad_type, i))) *flag = 1;
    }
  }
}

__global__ void SameTrafficKernel(const DeviceSlice* slices, const Chunk* chunks, int nchunks) {
  for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const DeviceSlice s = slices[ch.slice];
    const float* g = static_cast<const float*>(s.grad);
    for (int64_t i = ch.begin + threadIdx.x; i < ch.begin + ch.len; i += blockDim.x) {
      const float gi = g[i];
      const float m = s.state0[i] + gi;
      const float v = s.state1[i] + gi;
      s.state0[i] = m;
      s.state1[i] = v;
      s.master[i] = s.master[i] + m;
    }
  }
}

int Fail(cudaError_t e, const char* what, char* err, int errlen) {
  std::snprintf(err, static_cast<size_t>(errlen), "%s: %s", what, cudaGetErrorString(e));
  return static_cast<int>(e);
}

// Copies the slice and chunk tables to the device (stream-ordered) and runs
// `launch(slices, chunks, nchunks, blocks)`; tables are freed in stream order.
template <typename Launch>
int Run(const DeviceSlice* slices, int n, void* stream_ptr, char* err, int errlen, Launch launch) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<Chunk> chunks;
  for (int i = 0; i < n; ++i) {
    for (int64_t b = 0; b < slices[i].size; b += kChunk) {
      chunks.push_back(Chunk{i, b, slices[i].size - b < kChunk ? slices[i].size - b : kChunk});
    }
  }
  if (chunks.empty()) return 0;
  const size_t slice_bytes = sizeof(DeviceSlice) * static_cast<size_t>(n);
  const size_t chunk_bytes = sizeof(Chunk) * chunks.size();
  void* table = nullptr;
  cudaError_t e = cudaMallocAsync(&table, slice_bytes + chunk_bytes, stream);
  if (e != cudaSuccess) return Fail(e, "cudaMallocAsync", err, errlen);
  std::vector<char> host(slice_bytes + chunk_bytes);
  std::memcpy(host.data(), slices, slice_bytes);
  std::memcpy(host.data() + slice_bytes, chunks.data(), chunk_bytes);
  e = cudaMemcpyAsync(table, host.data(), host.size(), cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return Fail(e, "cudaMemcpyAsync", err, errlen);
  // cudaMemcpyAsync from pageable memory returns once the data is staged, so
  // `host` may be freed when this function returns.
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int nchunks = static_cast<int>(chunks.size());
  const int blocks = nchunks < sms * 8 ? nchunks : sms * 8;
  launch(static_cast<const DeviceSlice*>(table),
         reinterpret_cast<const Chunk*>(static_cast<char*>(table) + slice_bytes), nchunks, blocks,
         stream);
  e = cudaGetLastError();
  if (e != cudaSuccess) return Fail(e, "kernel launch", err, errlen);
  e = cudaFreeAsync(table, stream);
  if (e != cudaSuccess) return Fail(e, "cudaFreeAsync", err, errlen);
  return 0;
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
  return Run(slices, n, stream, err, errlen,
             [&](const DeviceSlice* s, const Chunk* c, int nc, int blocks, cudaStream_t st) {
               if (a.decoupled) {
                 AdamKernel<false, true><<<blocks, kThreads, 0, st>>>(a, s, c, nc);
               } else if (a.l2) {
                 AdamKernel<true, false><<<blocks, kThreads, 0, st>>>(a, s, c, nc);
               } else {
                 AdamKernel<false, false><<<blocks, kThreads, 0, st>>>(a, s, c, nc);
               }
             });
}

int Sgd(const SgdArgs& a, const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  return Run(slices, n, stream, err, errlen,
             [&](const DeviceSlice* s, const Chunk* c, int nc, int blocks, cudaStream_t st) {
#define SHARDOPT_SGD(L2, M, F, N) SgdKernel<L2, M, F, N><<<blocks, kThreads, 0, st>>>(a, s, c, nc)
               if (!a.momentum_enabled) {
                 if (a.l2) SHARDOPT_SGD(true, false, false, false); else SHARDOPT_SGD(false, false, false, false);
               } else if (a.first_step) {
                 if (a.nesterov) {
                   if (a.l2) SHARDOPT_SGD(true, true, true, true); else SHARDOPT_SGD(false, true, true, true);
                 } else {
                   if (a.l2) SHARDOPT_SGD(true, true, true, false); else SHARDOPT_SGD(false, true, true, false);
                 }
               } else if (a.nesterov) {
                 if (a.l2) SHARDOPT_SGD(true, true, false, true); else SHARDOPT_SGD(false, true, false, true);
               } else {
                 if (a.l2) SHARDOPT_SGD(true, true, false, false); else SHARDOPT_SGD(false, true, false, false);
               }
#undef SHARDOPT_SGD
             });
}

int SquaredNorm(const DeviceSlice* slices, int n, double* out, void* stream, char* err, int errlen) {
  cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Fail(e, "cudaMemsetAsync", err, errlen);
  return Run(slices, n, stream, err, errlen,
             [&](const DeviceSlice* s, const Chunk* c, int nc, int blocks, cudaStream_t st) {
               SquaredNormKernel<<<blocks, kThreads, 0, st>>>(s, c, nc, out);
             });
}

int CheckOverflow(const DeviceSlice* slices, int n, int* flag, void* stream, char* err, int errlen) {
  cudaError_t e = cudaMemsetAsync(flag, 0, sizeof(int), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return Fail(e, "cudaMemsetAsync", err, errlen);
  return Run(slices, n, stream, err, errlen,
             [&](const DeviceSlice* s, const Chunk* c, int nc, int blocks, cudaStream_t st) {
               OverflowKernel<<<blocks, kThreads, 0, st>>>(s, c, nc, flag);
             });
}

int SameTraffic(const DeviceSlice* slices, int n, void* stream, char* err, int errlen) {
  return Run(slices, n, stream, err, errlen,
             [&](const DeviceSlice* s, const Chunk* c, int nc, int blocks, cudaStream_t st) {
               SameTrafficKernel<<<blocks, kThreads, 0, st>>>(s, c, nc);
             });
}

}  // namespace impl
}  // namespace cuda
}  // namespace shardopt
