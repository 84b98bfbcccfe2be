// The per-element math of every optimizer, written once.
//
// The reference (server/kernels/reference_optimizer.cc), the vectorised CPU kernels
// (server/kernels/cpu/cpu_kernels_isa.inc, one build per ISA), the CUDA kernels
// (server/kernels/cuda/cuda_kernels_impl.cu) and the standalone GPU check
// (tools/bench/gpu_check.cu) all call these functions, so they compute the same
// expressions in the same order: with contraction off (-ffp-contract=off,
// nvcc -fmad=false) and IEEE division and square root, every build gives
// bitwise the result of the reference. The expressions are those of
// torch.optim (PyTorch 1.13, single-tensor path), in float, including where
// ATen fuses: `x.add_(y, alpha=a)` is one fused multiply-add in ATen's
// vectorised CPU kernels (Vectorized::fmadd), so it is fmaf(y, a, x) here
// too, and `x.addcmul_(y, z, value=a)` is fmaf(a * y, z, x) (both checked
// element by element against torch 1.13 on an AVX2 CPU); that makes shardopt's steps bitwise those
// of torch.optim.AdamW / SGD on CPUs with FMA (x86-64 AVX2 and later). Explicit fmaf is exact in
// every build (a libm call where the ISA has no FMA instruction: the baseline kernels on pre-AVX2
// CPUs are slower, not different).
//
// Plain C++ with no dependencies: nvcc compiles it for the device.
#ifndef SHARDOPT_SERVER_KERNELS_OPTIMIZER_MATH_H_
#define SHARDOPT_SERVER_KERNELS_OPTIMIZER_MATH_H_

#include <math.h>

#if defined(__CUDACC__)
#define SHARDOPT_HD __host__ __device__ __forceinline__
#else
#define SHARDOPT_HD inline
#endif

namespace shardopt {

// Per-step scalars, computed in double as PyTorch does and rounded to float
// where PyTorch passes them to a float kernel (MakeAdamScalars, in
// server/kernels/update_slice.h).
struct AdamScalars {
  float grad_sign;     // -1 when maximizing
  float weight_decay;  // L2 term (Adam); 0 for AdamW
  float decay;         // AdamW: 1 - lr * weight_decay; 1 for Adam
  bool l2;             // Adam with weight_decay != 0
  bool decoupled;      // AdamW
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
};

struct SgdScalars {
  float grad_sign;
  float weight_decay;
  bool l2;
  bool momentum_enabled;  // momentum != 0
  bool first_step;        // momentum buffer := gradient
  bool nesterov;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
};

// Adam / AdamW on one element: parameter p, gradient g, exp_avg m,
// exp_avg_sq v. The branches are template parameters so that loops over
// elements carry none.
template <bool kL2, bool kDecoupled>
SHARDOPT_HD void AdamElement(const AdamScalars& k, float& p, float g, float& m, float& v) {
  g = g * k.grad_sign;
  if (kL2) g = fmaf(p, k.weight_decay, g);          // grad.add(param, alpha=wd)
  if (kDecoupled) p = p * k.decay;                  // param.mul_(1 - lr * wd)
  m = fmaf(g, k.one_minus_beta1, m * k.beta1);      // exp_avg.mul_(b1).add_(g, 1 - b1)
  v = fmaf(k.one_minus_beta2 * g, g, v * k.beta2);  // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
  const float denom = sqrtf(v) / k.bias_correction2_sqrt + k.eps;
  p = p + k.neg_step_size * m / denom;  // param.addcdiv_(m, denom, -step_size)
}

// SGD on one element: parameter p, gradient g, momentum buffer b.
template <bool kL2, bool kMomentum, bool kFirst, bool kNesterov>
SHARDOPT_HD void SgdElement(const SgdScalars& k, float& p, float g, float& b) {
  float d = g * k.grad_sign;
  if (kL2) d = fmaf(p, k.weight_decay, d);  // grad.add(param, alpha=wd)
  if (kMomentum) {
    b = kFirst ? d
               : fmaf(d, k.one_minus_dampening, b * k.momentum);  // buf.mul_(m).add_(d, 1 - damp)
    d = kNesterov ? fmaf(b, k.momentum, d) : b;                   // d.add(buf, alpha=momentum)
  }
  p = fmaf(d, k.neg_lr, p);  // param.add_(d, alpha=-lr)
}

// Adam's memory traffic (read p, g, m, v; write p, m, v) with trivial
// arithmetic: the bandwidth reference of the kernel benchmarks.
SHARDOPT_HD void SameTrafficElement(float& p, float g, float& m, float& v) {
  m = m + g;
  v = v + g;
  p = p + m;
}

// The same with the branches taken at run time (for scalar reference loops).
SHARDOPT_HD void AdamElementAny(const AdamScalars& k, float& p, float g, float& m, float& v) {
  if (k.decoupled) {
    AdamElement<false, true>(k, p, g, m, v);
  } else if (k.l2) {
    AdamElement<true, false>(k, p, g, m, v);
  } else {
    AdamElement<false, false>(k, p, g, m, v);
  }
}

SHARDOPT_HD void SgdElementAny(const SgdScalars& k, float& p, float g, float& b) {
  if (!k.momentum_enabled) {
    k.l2 ? SgdElement<true, false, false, false>(k, p, g, b)
         : SgdElement<false, false, false, false>(k, p, g, b);
  } else if (k.first_step) {
    if (k.nesterov) {
      k.l2 ? SgdElement<true, true, true, true>(k, p, g, b)
           : SgdElement<false, true, true, true>(k, p, g, b);
    } else {
      k.l2 ? SgdElement<true, true, true, false>(k, p, g, b)
           : SgdElement<false, true, true, false>(k, p, g, b);
    }
  } else if (k.nesterov) {
    k.l2 ? SgdElement<true, true, false, true>(k, p, g, b)
         : SgdElement<false, true, false, true>(k, p, g, b);
  } else {
    k.l2 ? SgdElement<true, true, false, false>(k, p, g, b)
         : SgdElement<false, true, false, false>(k, p, g, b);
  }
}

}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_OPTIMIZER_MATH_H_
