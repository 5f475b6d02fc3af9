#!/bin/bash
# Installs the Debian 12 packages shuttle needs, only those missing (fast
# when everything is there). Run as root.
set -euo pipefail
packages=(
  g++ clang libclang-rt-14-dev meson ninja-build pkg-config python3 netcat-openbsd
  liburing-dev libibverbs-dev librdmacm-dev libboost-dev doctest-dev libcli11-dev
  python3-matplotlib  # bench/plot.py
  # Asio's own examples, built on shuttle's loop by tests/asio/doc_examples.sh
  libboost1.81-doc
  # Soft-RoCE guest for the verbs tests (tests/softrdma/guest-run.sh)
  qemu-system-x86 busybox-static kmod cpio xz-utils iproute2
  rdma-core ibverbs-providers ibverbs-utils rdmacm-utils perftest
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The guest harness downloads the kernel package with apt: it needs the lists
# (stored compressed on some systems: *_Packages.lz4).
ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1 || apt-get update -qq
# The second Boost the Asio interop is tested against (1.81 beside the
# system 1.74; conflicting packages, so unpacked into a cache, not installed).
bash "$(dirname "$0")/boost-alt.sh" 1.81 >/dev/null
