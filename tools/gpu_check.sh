#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and no Bazel. One command,
# under 10 minutes, all results in one JSON file:
#   tools/gpu_check.sh [OUT_DIR]          (default: $OUT, else ./out)
# 1. builds, in parallel, with nvcc and g++ alone: the CUDA kernels
#    (sm_80 + sm_90), tools/bench/gpu_check.cu, and the GPU gtests;
# 2. gpu_check: every kernel (Adam, AdamW, SGD; fp32, bf16/fp16 model copies,
#    bf16/fp16 gradients; 0, 1, odd, misaligned, 100 slices, > 2^31 bytes per
#    array) bitwise against the scalar reference; Adam vs a device-to-device
#    copy of the same bytes;
# 3. where Python PyTorch with CUDA is installed: torch.optim.Adam(fused=True)
#    on the same parameter count;
# 5. bench_gpu_step: one step on GPT-2 small shapes, ShardedOptimizer (default
#    and device_async_step, the target: >= 1.0x the fused Adam step) vs the
#    bare kernel vs ATen's fused Adam (tools/bench/bench_gpu_step.cc);
# 4. the gtests: kernels vs server/kernels/reference_optimizer.cc, NcclCommunicator
#    (world size 1), and the real ShardedOptimizer step on the GPU through
#    NCCL against LibTorch's optimizers, and a GPU checkpoint save + resume (built against the installed PyTorch's
#    LibTorch, which must have CUDA).
# Finds CUDA from nvcc, NCCL in $NCCL_HOME, CUDA's folder or PyTorch's
# nvidia/nccl package, Abseil, GoogleTest and nlohmann/json in $DEPS (a folder made by
# tools/gpu_deps.sh; default .gpu_deps when present) or /usr.
# Results: OUT_DIR/gpu_check.json (everything), gpu_check.log, gtest XML.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee "$out/gpu_check.log") 2>&1
start=$SECONDS
say() { printf '[gpu_check %3ds] %s\n' $((SECONDS - start)) "$*"; }

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $NVCC ]] || { say "nvcc not found (set NVCC)"; exit 1; }
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
CXX=${CXX:-g++}
PY=${PYTHON:-python3}
arch=${GPU_ARCH:-"-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90"}
DEPS=${DEPS:-}
[[ -z $DEPS && -d .gpu_deps ]] && DEPS=$PWD/.gpu_deps
deps_inc=(); deps_lib=()
if [[ -n $DEPS ]]; then deps_inc=(-I"$DEPS/include"); deps_lib=(-L"$DEPS/lib" -Wl,-rpath,"$DEPS/lib"); fi
have_absl=0
[[ -d ${DEPS:-/nonexistent}/include/absl || -d /usr/include/absl ]] && have_absl=1

# NCCL: header and library.
nccl_inc="" nccl_lib=""
for d in "${NCCL_HOME:-}" "$CUDA_HOME" \
         "$($PY -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)"; do
  [[ -n $d && -f $d/include/nccl.h ]] || continue
  for l in "$d/lib" "$d/lib64"; do
    if compgen -G "$l/libnccl.so*" >/dev/null; then nccl_inc=$d/include nccl_lib=$l; break 2; fi
  done
done
if [[ -z $nccl_lib ]]; then
  # a library without a header: use the header carried in $DEPS
  l=$($PY -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
  if [[ -n $l && -n $DEPS && -f $DEPS/nccl_include/nccl.h ]] && compgen -G "$l/libnccl.so*" >/dev/null; then
    nccl_inc=$DEPS/nccl_include nccl_lib=$l
  fi
fi
# LibTorch with CUDA, from the installed PyTorch.
torch_info=$($PY - <<'PY' 2>/dev/null
import torch, torch.utils.cpp_extension as c
print(int(torch.cuda.is_available()), int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__)
print(" ".join(c.include_paths()))
print(c.library_paths()[0])
PY
)
torch_cuda=0
if [[ -n $torch_info ]]; then
  read -r torch_cuda torch_abi torch_version <<<"$(sed -n 1p <<<"$torch_info")"
  torch_inc=$(sed -n 2p <<<"$torch_info"); torch_lib=$(sed -n 3p <<<"$torch_info")
fi
say "nvcc $NVCC; CUDA $CUDA_HOME; NCCL ${nccl_lib:-not found}; Abseil/GoogleTest $([[ $have_absl == 1 ]] && echo "${DEPS:-/usr}" || echo "not found"); PyTorch ${torch_version:-none} (cuda=${torch_cuda})"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/  gpu: /'

b=$(mktemp -d)
trap 'rm -rf "$b"' EXIT
NVFLAGS=(-std=c++17 -O3 -fmad=false -prec-div=true -prec-sqrt=true -Xcompiler -fPIC,-ffp-contract=off -I.)
CXXFLAGS=(-std=c++17 -O2 -fPIC -ffp-contract=off -I. -I"$CUDA_HOME/include" "${deps_inc[@]}")
declare -A job_obj=()
compile() {  # name, command...: runs in the background, log in $b/name.log
  local name=$1; shift
  ( "$@" >"$b/$name.log" 2>&1 || { echo "FAILED: $*" >>"$b/$name.log"; exit 1; } ) &
  job_obj[$name]=$!
}
# Stage 1: every object, in parallel.
say "building (parallel)"
compile impl $NVCC "${NVFLAGS[@]}" $arch -c server/kernels/cuda/cuda_kernels_impl.cu -o "$b/impl.o"
compile check $NVCC "${NVFLAGS[@]}" $arch -c tools/bench/gpu_check.cu -o "$b/check.o"
common_srcs=(server/kernels/update_slice.cc common/optimizer_config.cc server/kernels/reference_optimizer.cc
             server/kernels/cuda/cuda_kernels.cc client/comm/communicator.cc client/comm/kv_store.cc
             server/kernels/cuda/cuda_backend.cc server/kernels/cpu/cpu_backend.cc common/layout.cc common/planner.cc
             common/crc32c.cc common/file_system.cc tools/models/model_shapes.cc client/checkpoint/manifest.cc
             common/dtype.cc common/hyper_params.cc server/kernels/kernel_backend.cc
             client/staging_arena.cc client/deferred_collectives.cc client/collective_waiter.cc
             client/rank_agreement.cc client/trace.cc)
# tools/check_gpu_sources.sh (run by tools/test.sh, i.e. CI) checks with
# `bazel query` that every source the GPU targets depend on is named in this
# script, so this list cannot silently fall behind the BUILD files.
if [[ $have_absl == 1 ]]; then
  for s in "${common_srcs[@]}" tests/gpu/gpu_kernels_test.cc; do
    n=$(basename "$s" .cc); compile "$n" $CXX "${CXXFLAGS[@]}" -c "$s" -o "$b/$n.o"
  done
  compile cpu_kernels $CXX "${CXXFLAGS[@]}" -fopenmp -c server/kernels/cpu/cpu_kernels.cc -o "$b/cpu_kernels.o"
  kflags=(-O3 -fno-math-errno -fno-trapping-math)
  compile k_base $CXX "${CXXFLAGS[@]}" "${kflags[@]}" -c server/kernels/cpu/cpu_kernels_baseline.cc -o "$b/k_base.o"
  compile k_avx2 $CXX "${CXXFLAGS[@]}" "${kflags[@]}" -mavx2 -mfma -mf16c -c server/kernels/cpu/cpu_kernels_avx2.cc -o "$b/k_avx2.o"
  compile k_avx512 $CXX "${CXXFLAGS[@]}" "${kflags[@]}" -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma \
    -mprefer-vector-width=512 -c server/kernels/cpu/cpu_kernels_avx512.cc -o "$b/k_avx512.o"
  if [[ -n $nccl_lib ]]; then
    for s in client/comm/nccl_communicator.cc tests/gpu/gpu_nccl_test.cc; do
      n=$(basename "$s" .cc); compile "$n" $CXX "${CXXFLAGS[@]}" -I"$nccl_inc" -c "$s" -o "$b/$n.o"
    done
    if [[ $torch_cuda == 1 || ${BUILD_TORCH_TEST:-0} == 1 ]]; then
      tinc=(); for d in $torch_inc; do tinc+=(-isystem "$d"); done
      for s in client/sharded_optimizer.cc client/gradient_reducer.cc client/full_gradient_reducer.cc \
               client/sharded_gradient_reducer.cc client/grad_norm.cc \
               server/shard_owner.cc client/checkpoint/checkpoint.cc tests/gpu/gpu_sharded_optimizer_test.cc \
               tools/bench/bench_gpu_step.cc; do
        n=$(basename "$s" .cc)
        # LibTorch's headers may need C++20 (newer PyTorch): try 17, then 20.
        compile "$n" bash -c "$CXX ${CXXFLAGS[*]} -D_GLIBCXX_USE_CXX11_ABI=$torch_abi ${tinc[*]} -I$nccl_inc -c $s -o $b/$n.o 2>$b/$n.c17.log || $CXX ${CXXFLAGS[*]/-std=c++17/-std=c++20} -D_GLIBCXX_USE_CXX11_ABI=$torch_abi ${tinc[*]} -I$nccl_inc -c $s -o $b/$n.o"
      done
    fi
  fi
fi
build_ok=1
for n in "${!job_obj[@]}"; do
  if ! wait "${job_obj[$n]}"; then build_ok=0; say "build of $n failed:"; tail -n 30 "$b/$n.log"; fi
done
say "objects built"
obj() { for n in "$@"; do echo "$b/$n.o"; done; }
absl_libs=()
if [[ $have_absl == 1 ]]; then
  if [[ -n $DEPS ]]; then
    absl_libs=("$DEPS"/lib/libabsl_*.so*)
  else
    absl_libs=(/usr/lib/x86_64-linux-gnu/libabsl_*.so)
  fi
fi
gtest_libs=(-lgtest_main -lgtest -lpthread)
cudart_static=(-L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread)
link() {  # name, args...
  local name=$1; shift
  if "$@" >"$b/link_$name.log" 2>&1; then return 0; fi
  say "link of $name failed:"; tail -n 30 "$b/link_$name.log"; build_ok=0; return 1
}
[[ -f $b/impl.o && -f $b/check.o ]] && link gpu_check $NVCC $arch "$b/check.o" "$b/impl.o" -o "$b/gpu_check"
if [[ $have_absl == 1 ]]; then
  link gpu_kernels_test $CXX $(obj gpu_kernels_test reference_optimizer update_slice optimizer_config hyper_params dtype cuda_kernels impl) \
    "${deps_lib[@]}" -Wl,--start-group "${absl_libs[@]}" -Wl,--end-group "${gtest_libs[@]}" "${cudart_static[@]}" \
    -o "$b/gpu_kernels_test"
  if [[ -n $nccl_lib ]]; then
    nccl_link=(-L"$nccl_lib" -Wl,-rpath,"$nccl_lib" -l:"$(cd "$nccl_lib" && ls libnccl.so* | sort | tail -1)")
    link gpu_nccl_test $CXX $(obj gpu_nccl_test nccl_communicator communicator kv_store update_slice optimizer_config hyper_params dtype cuda_kernels impl) \
      "${deps_lib[@]}" -Wl,--start-group "${absl_libs[@]}" -Wl,--end-group "${gtest_libs[@]}" "${nccl_link[@]}" \
      "${cudart_static[@]}" -o "$b/gpu_nccl_test"
    if [[ -f $b/gpu_sharded_optimizer_test.o ]]; then
      tcuda=()
      [[ -f $torch_lib/libtorch_cuda.so ]] && tcuda=(-Wl,--no-as-needed -ltorch_cuda -lc10_cuda -Wl,--as-needed)
      # (BUILD_TORCH_TEST=1 builds it against a CPU LibTorch too, to check the build.)
      # Shared cudart here: one runtime with LibTorch's (same soname).
      link gpu_sharded_optimizer_test $CXX $(obj gpu_sharded_optimizer_test sharded_optimizer checkpoint manifest crc32c file_system cuda_backend cpu_backend shard_owner \
          nccl_communicator communicator kv_store layout planner cpu_kernels k_base k_avx2 k_avx512 optimizer_config \
          hyper_params dtype kernel_backend staging_arena deferred_collectives collective_waiter rank_agreement trace \
          gradient_reducer full_gradient_reducer sharded_gradient_reducer grad_norm update_slice cuda_kernels impl) -fopenmp \
        "${deps_lib[@]}" -Wl,--start-group "${absl_libs[@]}" -Wl,--end-group "${gtest_libs[@]}" "${nccl_link[@]}" \
        -L"$torch_lib" -Wl,-rpath,"$torch_lib" -Wl,--allow-shlib-undefined "${tcuda[@]}" \
        -ltorch -ltorch_cpu -lc10 -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart \
        -o "$b/gpu_sharded_optimizer_test"
      [[ -f $b/bench_gpu_step.o ]] && link bench_gpu_step $CXX $(obj bench_gpu_step model_shapes sharded_optimizer cuda_backend \
          cpu_backend shard_owner nccl_communicator communicator kv_store layout planner cpu_kernels k_base k_avx2 k_avx512 \
          optimizer_config hyper_params dtype kernel_backend staging_arena deferred_collectives collective_waiter \
          rank_agreement trace gradient_reducer full_gradient_reducer sharded_gradient_reducer grad_norm update_slice \
          cuda_kernels impl) -fopenmp \
        "${deps_lib[@]}" -Wl,--start-group "${absl_libs[@]}" -Wl,--end-group -lpthread "${nccl_link[@]}" \
        -L"$torch_lib" -Wl,-rpath,"$torch_lib" -Wl,--allow-shlib-undefined "${tcuda[@]}" \
        -ltorch -ltorch_cpu -lc10 -L"$CUDA_HOME/lib64" -Wl,-rpath,"$CUDA_HOME/lib64" -lcudart \
        -o "$b/bench_gpu_step"
    fi
  fi
fi
say "build finished (ok=$build_ok)"

# ONLY="test ..." runs just those gtests (skips the kernel checks and benchmarks).
ONLY=${ONLY:-}
# Stage 2: the kernels vs the reference, and the benchmark.
rc=0
if [[ -n $ONLY ]]; then
  echo '{"only": "'"$ONLY"'"}' >"$out/gpu_check.json"
elif [[ -x $b/gpu_check ]]; then
  timeout 300 "$b/gpu_check" --json="$out/gpu_check.json" || rc=1
else
  echo '{"correctness_ok": false, "error": "gpu_check did not build"}' >"$out/gpu_check.json"; rc=1
fi
say "kernel checks and benchmark done"
# Stage 3: PyTorch's fused Adam on the same number of parameters.
[[ -n $ONLY ]] || timeout 120 $PY - "$out/gpu_check.json" <<'PY' || true
import json, sys
path = sys.argv[1]
res = json.load(open(path))
try:
    import torch
    assert torch.cuda.is_available()
except Exception as e:
    print(f"  no PyTorch with CUDA here ({e.__class__.__name__}); torch comparison skipped")
    sys.exit(0)
n = res.get("bench_params")
if not n:
    sys.exit(0)
def bench(**kw):
    p = torch.zeros(n, device="cuda", requires_grad=True)
    p.grad = torch.zeros(n, device="cuda")
    opt = torch.optim.Adam([p], lr=1e-3, **kw)
    for _ in range(3):
        opt.step()
    best = 1e30
    for _ in range(3):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            opt.step()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 20)
    del opt, p
    torch.cuda.empty_cache()
    return best
ms = bench(fused=True)
res["torch_version"] = torch.__version__
res["torch_fused_adam_ms"] = ms
res["torch_fused_adam_gbps"] = 28.0 * n / (ms / 1e3) / 1e9
res["adam_vs_torch_fused"] = ms / res["adam_ms"]
ms2 = bench(foreach=True)
res["torch_foreach_adam_gbps"] = 28.0 * n / (ms2 / 1e3) / 1e9
json.dump(res, open(path, "w"), indent=1)
print(f"  torch {torch.__version__} fused Adam: {ms:.3f} ms ({res['torch_fused_adam_gbps']:.0f} GB/s); "
      f"foreach {res['torch_foreach_adam_gbps']:.0f} GB/s; shardopt is {res['adam_vs_torch_fused']:.2f}x fused")
PY
say "torch comparison done"
# Stage 4: the gtests.
export LD_LIBRARY_PATH=${DEPS:+$DEPS/lib:}${nccl_lib:+$nccl_lib:}${torch_lib:+$torch_lib:}${LD_LIBRARY_PATH:-}
gtests=()
for t in ${ONLY:-gpu_kernels_test gpu_nccl_test gpu_sharded_optimizer_test}; do
  if [[ -x $b/$t ]]; then
    say "running $t"
    if NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout 240 "$b/$t" --gtest_output="xml:$out/$t.xml"; then
      gtests+=("$t=passed")
    else
      gtests+=("$t=failed"); rc=1
    fi
  else
    gtests+=("$t=not_built"); rc=1
  fi
done
# Stage 5: one optimizer step on GPT-2 small shapes (ShardedOptimizer vs bare kernel vs ATen fused Adam).
if [[ -z $ONLY && -x $b/bench_gpu_step ]]; then
  say "running bench_gpu_step"
  timeout 180 "$b/bench_gpu_step" --json="$out/bench_gpu_step.json" || say "bench_gpu_step failed"
fi
$PY - "$out/gpu_check.json" "${gtests[*]}" "$build_ok" $((SECONDS - start)) <<'PY' || true
import json, sys, glob, os, xml.etree.ElementTree as ET
path, g, ok, secs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
res = json.load(open(path))
res["gtests"] = dict(item.split("=", 1) for item in g.split())
# Per-test outcomes and recorded properties from the gtest XML.
detail = {}
for x in glob.glob(os.path.join(os.path.dirname(path), "*.xml")):
    for case in ET.parse(x).getroot().iter("testcase"):
        name = case.get("classname") + "." + case.get("name")
        st = "failed" if case.find("failure") is not None else ("skipped" if case.get("result") == "skipped" else "passed")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        props.update({k: v for k, v in case.attrib.items() if k.endswith("_diff")})
        detail[name] = {"status": st, **props}
res["gtest_cases"] = detail
step = os.path.join(os.path.dirname(path), "bench_gpu_step.json")
if os.path.exists(step):
    res["gpu_step"] = json.load(open(step))
res["build_ok"] = ok == "1"
res["seconds"] = int(secs)
json.dump(res, open(path, "w"), indent=1)
PY
say "results in $out/ (rc=$rc)"
exit $rc
