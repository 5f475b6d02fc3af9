#!/bin/bash
# guest-run.sh - run one command as root in a throw-away QEMU guest that has Soft-RoCE.
#
# Usage: tests/softrdma/guest-run.sh [options] [--] CMD [ARGS...]
#   -t SEC   timeout for CMD inside the guest (default 600)
#   -M MTU   MTU of the dummy netdev under rxe0 (default 1500 -> RoCE MTU 1024;
#            9000 -> RoCE MTU 4096)
#   -m MEM   guest memory (default 2G)
#   -c N     guest vCPUs (default 2)
#   -e N=V   put N=V into CMD's environment (repeatable); otherwise CMD gets only
#            PATH, HOME, LANG and TERM
#   -n       do not create the rxe0 device
#   -v       print timings (cache build, guest boot, wall) on stderr
#
# The guest boots Debian 12's own kernel (rdma_rxe is a module there) under TCG
# (-smp 2 unless -c, -cpu max). Its root is the host's / shared read-only over virtio-9p with a
# tmpfs overlay, so host-built binaries run unchanged and writes are thrown away. CMD
# runs in the host's current directory with `ulimit -l unlimited`; rxe0 sits on dummy0,
# 192.168.77.1/24 (GID index 1 is the IPv4 one). CMD's stdout+stderr come back on stdout.
# Exit status: CMD's; 124 if CMD timed out; 77 (meson "skip") if no guest could be
# used (qemu missing, kernel not downloadable, boot or rxe setup failed); 99 if the
# guest died after CMD had started (e.g. a kernel panic caused by CMD).
# Environment: SHUTTLE_SOFTRDMA_CACHE (cache dir), SHUTTLE_SOFTRDMA_KEEP=1 (keep the
# per-run dir with console log). Host packages: tests/softrdma/install-deps.sh.
set -uo pipefail
usage() { sed -n '4,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
skip() { echo "guest-run.sh: SKIP: $*" >&2; exit 77; }

TMO=600 MTU=1500 MEM=2G CPUS=2 RXE=1 VERBOSE=0 ENVS=()
while getopts t:M:m:c:e:nvh o; do case $o in
  t) TMO=$OPTARG;; M) MTU=$OPTARG;; m) MEM=$OPTARG;; c) CPUS=$OPTARG;; n) RXE=0;; v) VERBOSE=1;;
  e) [[ $OPTARG =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || usage; ENVS+=("$OPTARG");;
  *) usage;; esac; done
shift $((OPTIND-1))
if [ $# = 0 ] || ! [[ $TMO =~ ^[1-9][0-9]*$ && $MTU =~ ^[0-9]+$ && $CPUS =~ ^[1-9][0-9]?$ ]]; then usage; fi

for t in qemu-system-x86_64 busybox apt-get dpkg depmod modprobe cpio xz flock timeout; do
  command -v $t >/dev/null || skip "$t not found (run tests/softrdma/install-deps.sh)"
done
SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")

CACHE=${SHUTTLE_SOFTRDMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shuttle-softrdma}
mkdir -p "$CACHE/runs" || skip "cannot create $CACHE"
# Kernel: the one linux-image-amd64 depends on. apt-cache takes ~1 s, so the answer is
# kept until the apt lists change (and used as is when apt cannot answer).
KVER=$(cat "$CACHE/kver" 2>/dev/null)
if [ -z "$KVER" ] || [ /var/lib/apt/lists -nt "$CACHE/kver" ]; then
  KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
  [ -n "$KPKG" ] && KVER=${KPKG#linux-image-} && echo "$KVER" > "$CACHE/kver.$$" && mv "$CACHE/kver.$$" "$CACHE/kver"
fi
[ -n "$KVER" ] || skip "cannot tell which kernel to use (apt-cache depends linux-image-amd64 failed)"
C=$CACHE/$KVER

build() {  # one-time: the kernel as an ELF vmlinux + a busybox initramfs with the modules
  set -e; local B=$C.build; rm -rf "$B"; mkdir -p "$B"; cd "$B"
  apt-get download "linux-image-$KVER" >/dev/null 2>&1 || { echo "apt-get download linux-image-$KVER failed"; return 1; }
  dpkg -x linux-image-*.deb k; depmod -b k "$KVER"
  # Boot the uncompressed vmlinux directly (PVH): ~5 s faster than bzImage+SeaBIOS in TCG.
  local off; off=$(LC_ALL=C grep -obUaP -m1 '\xfd7zXZ\x00' "k/boot/vmlinuz-$KVER" | head -1 | cut -d: -f1)
  tail -c +$((off+1)) "k/boot/vmlinuz-$KVER" | xz -dc --single-stream > vmlinux 2>/dev/null || [ -s vmlinux ]
  mkdir -p ir/bin ir/proc ir/sys ir/dev ir/lower ir/ovl ir/host
  cp "$(command -v busybox)" ir/bin/busybox; ln -s /bin/busybox ir/bin/modprobe
  # rdma_rxe needs a crypto "crc32" (crc32_generic/_pclmul) that is no modinfo dependency
  # (else ENOENT on `rdma link add`); dummy, because rxe on lo breaks every rdma_cm call.
  local MODS="virtio_pci 9pnet_virtio 9p overlay crc32_generic crc32_pclmul crc32c_generic libcrc32c rdma_rxe rdma_ucm ib_umad dummy"
  for m in $MODS; do modprobe -d "$PWD/k" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'; done |
    sort -u | while read -r f; do r=${f#"$PWD"/k/}; mkdir -p "ir/${r%/*}"; cp "$f" "ir/$r"; done
  cp k/lib/modules/"$KVER"/modules.{builtin*,order} ir/lib/modules/"$KVER"/; depmod -b ir "$KVER"
  echo "$MODS" > ir/modlist; guest_init > ir/init; chmod +x ir/init
  (cd ir && find . | cpio -o -H newc --quiet) > initramfs.cpio   # uncompressed: faster in TCG
  cd "$CACHE"; rm -rf "$C" "$B"/k "$B"/ir "$B"/*.deb; mv "$B" "$C"
}

guest_init() { cat <<'INIT'
#!/bin/busybox sh
# PID 1 of the guest: modules, root overlay, rxe0, then the job; results go to /run/res.
/bin/busybox --install -s /bin; export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for a in $(cat /proc/cmdline); do case $a in sr_*=*) eval "${a%%=*}=${a#*=}";; esac; done
fail() { echo "$*" > /host/run/res/setup_error; echo "@@ setup failed: $*" > /dev/ttyS0; finish; }
finish() { sync; echo o > /proc/sysrq-trigger; poweroff -f; }
for m in $(cat /modlist); do [ $m = dummy ] && o=numdummies=0 || o=; modprobe $m $o 2>/dev/null; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower || finish
mount -t tmpfs -o mode=755 tmpfs /ovl; mkdir /ovl/u /ovl/w
mount -t overlay -o lowerdir=/lower,upperdir=/ovl/u,workdir=/ovl/w overlay /host || finish
R=/host
mount -t proc proc $R/proc; mount -t sysfs sys $R/sys; mount -t devtmpfs dev $R/dev
mkdir -p $R/dev/pts $R/dev/shm; mount -t devpts devpts $R/dev/pts; mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/run; mkdir -p $R/run/res $R/tmp
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results $R/run/res || finish
ip link set lo up
ip link add dummy0 type dummy && ip link set dummy0 mtu $sr_mtu && ip link set dummy0 up &&
  ip addr add 192.168.77.1/24 dev dummy0 || fail "dummy0 setup failed"
if [ "$sr_rxe" = 1 ]; then
  err=$(chroot $R rdma link add rxe0 type rxe netdev dummy0 2>&1) || fail "rdma link add rxe0 failed: $err"
  # the IPv4 GID (index 1) appears asynchronously; wait for it so CMD can use -g 1 at once
  i=0; until grep -q ffff /sys/class/infiniband/rxe0/ports/1/gids/1 2>/dev/null; do
    i=$((i+1)); [ $i -gt 100 ] && fail "rxe0 got no IPv4 GID"; sleep 0.05; done
fi
cut -d' ' -f1 /proc/uptime > $R/run/res/ready; t0=$(cut -d. -f1 /proc/uptime)
chroot $R /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/bash -c "ulimit -l unlimited; exec timeout -k 10 $sr_tmo bash /run/res/job" \
  > $R/run/res/output 2>&1 < /dev/null
rc=$?   # timeout(1) gives 124, or 137 when CMD ignored SIGTERM and needed the SIGKILL
if [ $rc = 124 -o $rc = 137 ] && [ $(( $(cut -d. -f1 /proc/uptime) - t0 )) -ge $sr_tmo ]; then
  rc=124; touch $R/run/res/timedout; fi
echo $rc > $R/run/res/rc.tmp; mv $R/run/res/rc.tmp $R/run/res/rc
finish
INIT
}

# Build the cache under a lock (parallel meson tests); rebuild when this script is newer.
exec 9> "$CACHE/lock"; flock 9
if [ ! -s "$C/initramfs.cpio" ] || [ "$SCRIPT" -nt "$C/initramfs.cpio" ]; then
  echo "guest-run.sh: building guest kernel cache in $C ..." >&2; T=$SECONDS
  (build) > "$CACHE/build.log" 2>&1   # not in an || list: that would disable set -e in build
  [ $? = 0 ] || { rm -rf "$C.build"; skip "cannot build the guest kernel cache: $(tail -n1 "$CACHE/build.log")"; }
  [ $VERBOSE = 1 ] && echo "guest-run.sh: cache built in $((SECONDS-T)) s" >&2
fi
# Per-run dir; hard links keep this run's kernel even if another instance rebuilds the cache.
RUN=$(mktemp -d "$CACHE/runs/run.XXXXXX") || skip "mktemp failed"
ln "$C/vmlinux" "$C/initramfs.cpio" "$RUN/" 2>/dev/null || cp "$C/vmlinux" "$C/initramfs.cpio" "$RUN/"
exec 9>&-
# Runs killed with SIGKILL leave their dir behind: drop those older than a day.
find "$CACHE/runs" -mindepth 1 -maxdepth 1 -mmin +1440 -exec rm -rf {} + 2>/dev/null
cleanup() { if [ "${SHUTTLE_SOFTRDMA_KEEP:-0}" = 1 ]; then echo "guest-run.sh: logs in $RUN" >&2; else rm -rf "$RUN"; fi; }
trap cleanup EXIT
# Interrupted: neither a skip nor CMD's status. Killed by a test harness's
# timeout, it shows what CMD had written (the guest writes it as it goes).
trap 'exit 130' INT
trap 'cat "${RUN:-/nonexistent}/res/output" 2>/dev/null; echo "guest-run.sh: terminated" >&2; exit 143' TERM

mkdir "$RUN/res"
{ printf 'cd %q || exit 125\n' "$PWD"
  for e in "${ENVS[@]}"; do printf 'export %s=%q\n' "${e%%=*}" "${e#*=}"; done
  printf 'exec'; printf ' %q' "$@"; echo; } > "$RUN/res/job"

# The guest enforces -t itself; the outer timeout only catches a hung boot or guest.
T0=$(date +%s%N)
timeout --foreground -k 5 $((TMO + 180)) qemu-system-x86_64 \
  -accel tcg,thread=multi -cpu max -smp "$CPUS" -m "$MEM" \
  -nodefaults -no-user-config -display none -no-reboot -serial file:"$RUN/console" \
  -kernel "$RUN/vmlinux" -initrd "$RUN/initramfs.cpio" \
  -append "console=ttyS0 loglevel=3 panic=-1 reboot=t mitigations=off sr_mtu=$MTU sr_rxe=$RXE sr_tmo=$TMO" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$RUN/res",mount_tag=results,security_model=none > "$RUN/qemu.log" 2>&1
QRC=$?
cat "$RUN/res/output" 2>/dev/null
[ $VERBOSE = 1 ] && echo "guest-run.sh: qemu_rc=$QRC guest_ready_at=$(cat "$RUN/res/ready" 2>/dev/null)s" \
  "wall=$(( ($(date +%s%N) - T0) / 1000000 ))ms" >&2
[ -f "$RUN/res/timedout" ] && echo "guest-run.sh: timed out after ${TMO}s" >&2
if [ -f "$RUN/res/rc" ]; then exit "$(cat "$RUN/res/rc")"; fi
[ -f "$RUN/res/setup_error" ] && skip "guest setup: $(cat "$RUN/res/setup_error")"
if [ -f "$RUN/res/ready" ]; then   # CMD had started: not a skip
  if [ $QRC = 124 ] || [ $QRC = 137 ]; then echo "guest-run.sh: timed out after ${TMO}s" >&2; exit 124; fi
  echo "guest-run.sh: guest died while running the command (qemu rc $QRC)" >&2; exit 99
fi
why=$( { head -n1 "$RUN/qemu.log"; grep -s -a -m1 -o 'Kernel panic.*' "$RUN/console"; } | tr -d '\r' | paste -sd' ')
[ $QRC = 124 ] && why="not ready within $((TMO + 180))s"
skip "guest failed to boot: ${why:-no result (qemu rc $QRC)}; SHUTTLE_SOFTRDMA_KEEP=1 keeps the console log"
