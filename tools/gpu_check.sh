#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and no Bazel: builds the
# CUDA sources with nvcc alone, checks the kernels against the scalar
# reference (bitwise), benchmarks Adam against a device-to-device copy, and,
# where Python PyTorch with CUDA is installed, against torch.optim.Adam(fused=True)
# on the same size. One command, all results in one JSON file:
#   tools/gpu_check.sh [OUT_DIR]       (default: $OUT or ./out)
# Where Abseil and GoogleTest are installed it also builds and runs the GPU
# gtests (kernels vs the reference; NcclCommunicator at world size 1).
# Not covered yet: the ShardedOptimizer GPU path (issue 7).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out}}
mkdir -p "$out"
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
if [[ ! -x $NVCC ]]; then echo "gpu_check: nvcc not found (set NVCC)" >&2; exit 1; fi
arch=${GPU_ARCH:-"-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90"}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
echo "gpu_check: building with $NVCC"
$NVCC -std=c++17 -O3 -fmad=false -prec-div=true -prec-sqrt=true -Xcompiler -ffp-contract=off $arch -I. \
  server/cuda/cuda_kernels_impl.cu tools/gpu_check.cu -o "$build/gpu_check" || exit 1
"$build/gpu_check" --json="$out/gpu_check.json"
rc=$?
# PyTorch's fused Adam on the same number of parameters, when available.
python3 - "$out/gpu_check.json" <<'PY' || true
import json, sys
try:
    import torch
    assert torch.cuda.is_available()
except Exception as e:
    print(f"gpu_check: no PyTorch with CUDA here ({e.__class__.__name__}); skipping the torch comparison")
    sys.exit(0)
path = sys.argv[1]
res = json.load(open(path))
n = res["bench_params"]
p = torch.zeros(n, device="cuda", requires_grad=True)
p.grad = torch.zeros(n, device="cuda")
opt = torch.optim.Adam([p], lr=1e-3, fused=True)
for _ in range(3):
    opt.step()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    opt.step()
end.record()
torch.cuda.synchronize()
ms = start.elapsed_time(end) / 20
res["torch_fused_adam_ms"] = ms
res["torch_fused_adam_gbps"] = 28.0 * n / (ms / 1e3) / 1e9
res["adam_vs_torch_fused"] = res["torch_fused_adam_ms"] / res["adam_ms"]
json.dump(res, open(path, "w"), indent=1)
print(f"  torch fused Adam: {ms:.3f} ms ({res['torch_fused_adam_gbps']:.0f} GB/s); shardopt is {res['adam_vs_torch_fused']:.2f}x")
PY
# The gtests, built with g++ and nvcc alone, when the libraries are there.
if [[ -d /usr/include/absl && -d /usr/include/gtest ]]; then
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
  NCCL_LIB=${NCCL_LIB:-$CUDA_HOME/lib64}
  ABSL="-labsl_statusor -labsl_status -labsl_str_format_internal -labsl_strings -labsl_strings_internal
        -labsl_cord -labsl_cordz_info -labsl_cord_internal -labsl_cordz_functions -labsl_cordz_handle
        -labsl_synchronization -labsl_graphcycles_internal -labsl_stacktrace -labsl_symbolize
        -labsl_debugging_internal -labsl_demangle_internal -labsl_time -labsl_time_zone -labsl_int128
        -labsl_hash -labsl_city -labsl_low_level_hash -labsl_raw_hash_set -labsl_throw_delegate
        -labsl_malloc_internal -labsl_base -labsl_spinlock_wait -labsl_raw_logging_internal -labsl_log_severity"
  $NVCC -std=c++17 -O3 -fmad=false -prec-div=true -prec-sqrt=true -Xcompiler -fPIC $arch -I. \
    -c server/cuda/cuda_kernels_impl.cu -o "$build/impl.o" &&
  g++ -std=c++17 -O2 -ffp-contract=off -I. -I"$CUDA_HOME/include" \
    tests/gpu_kernels_test.cc server/reference_optimizer.cc server/update_slice.cc \
    server/optimizer_config.cc server/cuda/cuda_kernels.cc "$build/impl.o" \
    -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart -lgtest_main -lgtest $ABSL -lpthread \
    -o "$build/gpu_kernels_test" &&
  "$build/gpu_kernels_test" --gtest_output=json:"$out/gpu_kernels_test.json" || rc=1
  g++ -std=c++17 -O2 -I. -I"$CUDA_HOME/include" tests/gpu_nccl_test.cc client/nccl_communicator.cc \
    client/communicator.cc client/kv_store.cc server/update_slice.cc server/optimizer_config.cc \
    server/cuda/cuda_kernels.cc "$build/impl.o" \
    -L"$CUDA_HOME/lib64" -L"$NCCL_LIB" -Wl,-rpath,"$CUDA_HOME/lib64" -Wl,-rpath,"$NCCL_LIB" \
    -lnccl -lcudart -lgtest_main -lgtest $ABSL -lpthread -o "$build/gpu_nccl_test" &&
  "$build/gpu_nccl_test" --gtest_output=json:"$out/gpu_nccl_test.json" || rc=1
else
  echo "gpu_check: no Abseil/GoogleTest headers here: gtests not built (the checks above cover the kernels)"
fi
echo "gpu_check: results in $out/"
exit $rc
