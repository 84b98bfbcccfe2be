#define SHARDOPT_ISA_NS avx2
#include "server/kernels/cpu/cpu_kernels_isa.inc"
