#define SHARDOPT_ISA_NS baseline
#include "server/cpu_kernels_isa.inc"
