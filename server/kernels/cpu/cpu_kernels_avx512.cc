#define SHARDOPT_ISA_NS avx512
#include "server/kernels/cpu/cpu_kernels_isa.inc"
