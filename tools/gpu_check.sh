#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and no Bazel: builds the
# CUDA sources with nvcc alone, checks the kernels against the scalar
# reference (bitwise), benchmarks Adam against a device-to-device copy, and,
# where Python PyTorch with CUDA is installed, against torch.optim.Adam(fused=True)
# on the same size. One command, all results in one JSON file:
#   tools/gpu_check.sh [OUT_DIR]       (default: $OUT or ./out)
# Not covered yet: NCCL and the ShardedOptimizer GPU path (issue 7).
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
echo "gpu_check: results in $out/gpu_check.json"
exit $rc
