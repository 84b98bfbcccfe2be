#define SHARDOPT_ISA_NS avx2
#include "server/cpu_kernels_isa.inc"
