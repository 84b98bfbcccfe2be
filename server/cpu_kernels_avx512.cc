#define SHARDOPT_ISA_NS avx512
#include "server/cpu_kernels_isa.inc"
