#!/usr/bin/env bash
# Installs every Debian 12 package deltaserve needs to build, test and run on the CPU.
# Idempotent: packages already present are skipped; `apt-get update` runs at most once per call,
# and only when something is missing. CUDA 13 (nvcc) is optional and never installed here.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build pkg-config ccache git python3 python3-venv
  clang-format clang-tidy
  # engine-side libraries (tokenizer pre-split regex)
  libonig-dev
  # cluster layers
  libcaf-dev librocksdb-dev libucx-dev ucx-utils libboost-dev prometheus-cpp-dev
  libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev
  # cluster TLS: the tunnel of actors/tls_tunnel.cpp (Boost.Asio SSL over OpenSSL; libboost-dev above)
  libssl-dev
  # tests and benchmarks; openssl makes the test CAs and certificates of the cluster TLS tests
  libgtest-dev libgmock-dev googletest libbenchmark-dev openssl
  # ops checks: promtool and a real Prometheus server (tests/ops)
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup-debian: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "setup-debian: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
