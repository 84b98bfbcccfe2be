#!/usr/bin/env bash
# Installs exactly the Debian packages shardopt's build and tests need.
# Skips what is already installed (checked with dpkg-query, one call, no pipe:
# `dpkg -s P | grep -q` under pipefail fails at random when grep exits first
# and dpkg dies of SIGPIPE); fails loudly, naming the package, when an install
# fails. Safe to run repeatedly.
set -euo pipefail

PACKAGES=(
  # build (third_party/system_configure.bzl reads the libraries' pkg-config files)
  bazel-bootstrap bazel-platforms g++ pkg-config
  # tools/format_check.sh (counted by tools/test.sh); tools/tsa_check.sh:
  # clang's thread-safety analysis (libomp: clang's -fopenmp)
  clang-format git clang libomp-dev
  # gRPC / protobuf code generation and runtime
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # libraries
  libabsl-dev libtorch-dev libgloo-dev libgtest-dev libgoogle-glog-dev
  libopenblas0-pthread nlohmann-json3-dev
  # tests: a second, independent gRPC client; certificates for the TLS tests;
  # PyTorch as an independent reader of exported checkpoints
  python3-grpcio python3-protobuf openssl python3-torch
  # tests: network namespaces (multi-host test), pgrep (end-to-end tests)
  iproute2 procps
  # tests: Slurm for real (tests/e2e/slurm_test.sh: slurmctld, slurmd, srun,
  # sbatch, scancel; munged for their authentication); the Kubernetes
  # manifest's check reads YAML (tests/e2e/kubernetes_env_test.sh)
  slurm-wlm munge python3-yaml
  # tests: a real terminal for shardctl top (tests/e2e/shardctl_top_test.sh)
  tmux
  # metrics: the Prometheus client library (shardrun --metrics-port); the
  # Prometheus server and promtool for tests/e2e/prometheus_test.sh
  prometheus-cpp-dev prometheus
  # Python API: the pybind11 extension (python/), its tests and the Python benchmark
  pybind11-dev python3-pytest python3-torchvision
)

case "${1:-}" in
  --help|-h)
    echo "usage: tools/setup.sh [--with-bench]"
    echo "  installs the Debian packages shardopt's build and tests need (idempotent):"
    printf '    %s\n' "${PACKAGES[@]}"
    echo "  --with-bench also installs python3-matplotlib (bench_oss --png)"
    exit 0
    ;;
  --with-bench) PACKAGES+=(python3-matplotlib) ;;
  "") ;;
  *) echo "setup: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

# "ii " when installed (db:Status-Abbrev); anything else (or an unknown
# package, where dpkg-query fails) is missing.
installed() {
  local status
  status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null) || return 1
  [[ $status == "ii "* ]]
}

missing=()
for p in "${PACKAGES[@]}"; do
  if ! installed "$p"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "setup: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
echo "setup: installing ${missing[*]}"
if ! $SUDO apt-get update -q; then
  echo "setup: FAILED: apt-get update" >&2
  exit 1
fi
# One transaction for speed; on failure retry one by one to name the culprit.
if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; then
  for p in "${missing[@]}"; do
    if ! $SUDO apt-get install -y -q --no-install-recommends "$p"; then
      echo "setup: FAILED to install Debian package '$p'" >&2
      exit 1
    fi
  done
fi
for p in "${missing[@]}"; do
  if ! installed "$p"; then
    echo "setup: FAILED: package '$p' is not installed after apt-get" >&2
    exit 1
  fi
done
echo "setup: done"
