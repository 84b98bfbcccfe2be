// Internal: per-instruction-set kernel entry points. The same source
// (cpu_kernels_isa.inc) is compiled once per instruction set, as ATen does
// with its CPU_CAPABILITY builds; cpu_kernels.cc picks one at run time.
#ifndef SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_ISA_H_
#define SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_ISA_H_

#include <cstdint>

#include "server/kernels/update_slice.h"

namespace shardopt {
namespace internal {

struct KernelTable {
  // Contiguous fp32 blocks; n elements each.
  void (*adam)(const AdamScalars& k, float* p, const float* g, float* m, float* v, int64_t n);
  void (*sgd)(const SgdScalars& k, float* p, const float* g, float* buf, int64_t n);
  void (*same_traffic)(float* p, const float* g, float* m, float* v, int64_t n);
  void (*bf16_to_float)(const uint16_t* in, float* out, int64_t n);
  void (*float_to_bf16)(const float* in, uint16_t* out, int64_t n);
};

#define SHARDOPT_DECLARE_TABLE(ns) \
  namespace ns {                   \
  const KernelTable& Table();      \
  }
SHARDOPT_DECLARE_TABLE(baseline)
SHARDOPT_DECLARE_TABLE(avx2)
SHARDOPT_DECLARE_TABLE(avx512)
#undef SHARDOPT_DECLARE_TABLE

}  // namespace internal
}  // namespace shardopt

#endif  // SHARDOPT_SERVER_KERNELS_CPU_CPU_KERNELS_ISA_H_
