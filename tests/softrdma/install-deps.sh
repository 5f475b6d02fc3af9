#!/bin/sh
# install-deps.sh - install the host packages that tests/softrdma/guest-run.sh needs
# (Debian/Ubuntu). Fast no-op when everything is present: apt-get runs only when a
# package is missing, or when there are no apt lists (the guest kernel is fetched with them).
set -eu
PKGS="qemu-system-x86 busybox-static kmod cpio xz-utils iproute2 rdma-core
      ibverbs-providers ibverbs-utils rdmacm-utils perftest"
missing=
for p in $PKGS; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing="$missing $p"
done
# guest-run.sh fetches the guest kernel with apt-get download: it needs apt lists
lists=; for f in /var/lib/apt/lists/*_Packages*; do [ -e "$f" ] && lists=1; break; done
[ -z "$missing" ] && [ -n "$lists" ] && exit 0

SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
echo "install-deps.sh: installing:${missing:- (none; refreshing apt lists)}" >&2
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
[ -z "$missing" ] || $SUDO env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends $missing
