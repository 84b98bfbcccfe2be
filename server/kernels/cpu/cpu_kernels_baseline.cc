#define SHARDOPT_ISA_NS baseline
#include "server/kernels/cpu/cpu_kernels_isa.inc"
