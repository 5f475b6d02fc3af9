#!/bin/bash
# shuttle-perf (verbs provider) vs perftest (ib_write_bw, ib_read_bw, ib_send_bw,
# ib_write_lat, ib_send_lat, ib_read_lat) on Soft-RoCE, inside ONE QEMU guest
# (tests/softrdma/guest-run.sh, MTU 9000 -> RoCE MTU 4096), server and client
# of each pair in the same guest. Points: bw at 4 KiB and 64 KiB, lat at 2 B and
# 64 B, and a small-write message rate (64 B writes, 128 in flight). The order
# alternates per point. Soft-RoCE under TCG is slow and noisy: only the ratios
# of one run mean anything. Each row is REPS (default 3) pairs of runs; the
# verdict is on the median of the pairs' ratios, over the pairs whose two runs
# fell in the same phase of the guest (bench/pair_ratios.py). Targets: bw ratio >= 1.0,
# lat ratio <= 1.05 (t_typical), msg-rate ratio >= 1.0.
#
# Fair defaults on both sides: depth 128 (perftest's tx_depth). shuttle-perf
# posts batches of 32 (post_batch: one ibv_post_send of 32 chained WRs, the
# last one signaled; four batches in flight); perftest signals one WR in 100
# (--cq-mod 100, its default) and posts them one by one (--post_list 1).
# The same memory on both: perftest's ib_*_bw point every operation above
# 2 KiB at one buffer on each side (below, they step through one page), so
# the bw and msg-rate rows run shuttle-perf with --slots 1 (one buffer of
# the message size; 64 B messages step through the page the buffer is
# rounded up to). With a slot per operation in flight (shuttle-perf's
# default), 128 x 64 KiB = 8 MiB on each side pass through Soft-RoCE's
# copies instead of 64 KiB.
# Latency rows compare t_typical (perftest's column 5) and print both
# tools' median t_min. Each iteration of perftest's latency tests posts one
# work request built before the loop; shuttle-perf's the same way: one
# operation prepared before the loop (connection::prepare), started each
# iteration. The row marked "single" times read_lat with the single-operation
# API instead (connection::read each iteration: arguments passed, the
# registration looked up and the state built and destroyed every time); it
# is shown for reference, with no verdict. They run shuttle-perf with --rx-depth 16 on both sides:
# a ping-pong needs one receive, and perftest's latency tests point every
# posted receive at the same buffer (one page), while each of shuttle's owns
# its buffer; with shuttle-perf's default of 512 x 64 KiB, every message lands
# in a page not touched for 512 round trips, which costs Soft-RoCE under TCG
# about 1 us per round trip (measured: send_lat 64 B 15.8 us at 512, 14.8 at 16).
# CONTROL=1 adds to every row a second perftest run per pair, in an order
# rotating through the three runs' six orders: the row then also prints
# perftest against itself (the pairs' Q/P, same median and CI), the spread
# this method gives between two runs of one tool. A >= row whose ratio
# misses the target but lies inside that control's 90% CI reads "tie":
# perftest gets such a ratio against itself.
# Both latency sides busy-poll (perftest spins on the CQ; shuttle-perf's
# --spin-us 5000 keeps its loop polling). The load average of the host is
# printed first: a loaded host makes every number (latency above all) noise.
#
# Usage: [SECTIONS="bw lat rate"] [REPS=3] [CONTROL=1] [VERBOSE=1] bench/verbs_perf.sh [BUILD_DIR]
# (needs the perftest package and tests/softrdma/install-deps.sh's packages)
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = --in-guest ]; then
  perf=$2
  # shellcheck source=guest_common.sh
  . "$here/guest_common.sh"
  work=$(mktemp -d)
  port=19000
  spid=
  trap '[ -n "$spid" ] && kill $spid 2>/dev/null; true' EXIT

  finish() {  # wait for the server, at most 30 s
    for _ in $(seq 300); do kill -0 $spid 2>/dev/null || break; sleep 0.1; done
    kill $spid 2>/dev/null || true; wait $spid 2>/dev/null || true; spid=
  }
  # shuttle TEST SIZE ITERS DEPTH -> metric (bw: MB/s average, msgrate: Mpps, lat: t_typical us)
  shuttle() {
    port=$((port + 1))
    $perf $O --bind $addr --port $port $shuttle_extra >$work/s.log 2>&1 &
    spid=$!
    wait_for $work/s.log listening || { finish; echo nan; return; }
    local sz=(--size $2); [ "$1" = atomic ] && sz=()
    timeout 120 $perf $addr $O --port $port $shuttle_extra --test $1 "${sz[@]}" --iters $3 --depth $4 --json >$work/c.log 2>&1 ||
      { echo "shuttle-perf $1 failed:" >&2; cat $work/c.log $work/s.log >&2; finish; echo nan; return; }
    finish
    grep '^{' $work/c.log | python3 -c 'import json,sys; d=json.loads(sys.stdin.readline()); m=sys.argv[1]
print("%.3f" % (d["msg_rate_mpps"] if m == "mpps" else d.get("bw_avg_mb_s", d.get("t_typical_us"))))' "$5"
    [ "$5" = usec ] && grep '^{' $work/c.log | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["t_min_us"])' >$work/s.min
    true
  }
  # perftest METRIC BINARY SIZE ITERS [EXTRA...] (a lat row's t_min goes to $min_file, default $work/p.min)
  perftest() {
    local m=$1; shift
    local bin=$1 size=$2 n=$3; shift 3
    port=$((port + 1))
    $bin $P -p $port -s $size -n $n "$@" >$work/ps.log 2>&1 &
    spid=$!
    wait_listen $port $spid || { cat $work/ps.log >&2; finish; echo nan; return; }
    timeout 120 $bin $P -p $port -s $size -n $n "$@" $addr >$work/pc.log 2>&1 ||
      { echo "$bin failed:" >&2; cat $work/pc.log $work/ps.log >&2; finish; echo nan; return; }
    finish
    # bw row: bytes iters peak avg mpps; lat row: bytes iters min max typical avg stdev p99 p99.9
    awk -v s=$size -v m=$m '$1 == s && NF >= 5 { v = m == "mpps" ? $5 : m == "usec" ? $5 : $4 } END { print v == "" ? "nan" : v }' \
      $work/pc.log
    [ $m = usec ] && awk -v s=$size '$1 == s && NF >= 5 { print $3 }' $work/pc.log >"${min_file:-$work/p.min}"
    true
  }

  reps=${REPS:-3}
  shuttle_extra=  # options for both shuttle-perf sides (see the latency rows)
  printf "%-9s %-7s %-6s %12s %12s %8s %15s %13s %8s %s\n" test bytes metric shuttle perftest ratio "(ratio range)" "90% CI" target verdict
  flip=0
  order=0 orders=("S P Q" "P Q S" "Q S P" "S Q P" "Q P S" "P S Q")  # CONTROL=1
  # One row: REPS pairs of runs (the order alternating within each pair).
  # bench/pair_ratios.py turns them into the row: each tool's median, and
  # the median of the pairs' shuttle/perftest ratios over the pairs whose two
  # runs fell in the same phase of the guest (a TCG guest on a shared host
  # runs at times much slower for seconds, long enough to take one run of a
  # pair and not the other: such a pair is left out and counted, by which
  # tool's run was the slow one). The 90% CI is a bootstrap interval of that
  # median: where it spans the target, these pairs cannot tell a hit from a
  # miss; more pairs can. "all" is the median over every pair.
  row() {  # name size metric "shuttle-args" "perftest-args" target op
    local name=$1 size=$2 metric=$3 sargs=$4 pargs=$5 target=$6 op=$7 s p
    local pairs=() smins=() pmins=() controls=() q k
    for _ in $(seq "$reps"); do
      if [ -n "${CONTROL:-}" ]; then
        for k in $(echo "${orders[$order]}"); do
          case $k in
          S) s=$(shuttle $sargs $metric) ;;
          P) p=$(perftest $metric $pargs) ;;
          Q) q=$(min_file=/dev/null perftest $metric $pargs) ;;  # its t_min is not the row's
          esac
        done
        order=$(((order + 1) % 6))
        controls+=("$q,$p")
      elif [ $flip = 0 ]; then s=$(shuttle $sargs $metric); p=$(perftest $metric $pargs)
      else p=$(perftest $metric $pargs); s=$(shuttle $sargs $metric); fi
      flip=$((1 - flip))
      if [ $metric = usec ]; then
        smins+=("$(cat $work/s.min 2>/dev/null || echo nan)") pmins+=("$(cat $work/p.min 2>/dev/null || echo nan)")
        rm -f $work/s.min $work/p.min
      fi
      pairs+=("$s,$p")
    done
    local sm pm r lo hi cl ch same all invalid sslow pslow v
    read -r sm pm r lo hi cl ch same all invalid sslow pslow <<<"$(python3 "$here/pair_ratios.py" \
      "$([ $op = ">=" ] && echo higher || echo lower)" "${pairs[@]}")"
    local c=nan c_lo=nan c_hi=nan c_n=0
    if [ -n "${CONTROL:-}" ]; then
      read -r _ _ c _ _ c_lo c_hi c_n _ <<<"$(python3 "$here/pair_ratios.py" \
        "$([ $op = ">=" ] && echo higher || echo lower)" "${controls[@]}")"
    fi
    if [ "$op" = info ]; then
      v="reference: --ops single, no verdict"
    else
      v=$(python3 -c "r, c_lo = float('$r'), float('$c_lo')
print('ok' if r == r and r $op $target else 'tie' if '$op' == '>=' and r == r and r >= c_lo else 'MISS')")
      python3 -c "import sys; lo, hi, t = float('$cl'), float('$ch'), float('$target'); sys.exit(0 if lo <= t <= hi else 1)" &&
        v="$v (CI spans the target)"
    fi
    v="$v all $all"
    [ -n "${CONTROL:-}" ] && v="$v control perftest/perftest $c (CI $c_lo-$c_hi, $c_n pairs)"
    [ $((sslow + pslow)) -gt 0 ] && v="$v ($((sslow + pslow)) pairs split by a slow phase: shuttle's run slow in $sslow, perftest's in $pslow)"
    [ "$invalid" -gt 0 ] && v="$v ($invalid of $reps pairs without a result)"
    if [ $metric = usec ]; then
      v="$v min $(python3 "$here/pair_ratios.py" --median "${smins[@]}")/$(python3 "$here/pair_ratios.py" --median "${pmins[@]}")"
    fi
    printf "%-9s %-7s %-6s %12s %12s %8s %15s %13s %8s %s\n" $name $size $metric "$sm" "$pm" "$r" "($lo-$hi)" "$cl-$ch" "$([ "$op" = info ] && echo - || echo "$op$target")" "$v"
    [ -n "${VERBOSE:-}" ] && echo "  # $name $size: shuttle,perftest ${pairs[*]}"
    [ -n "${VERBOSE:-}" ] && [ -n "${CONTROL:-}" ] && echo "  # $name $size: perftest,perftest ${controls[*]}"
    true
  }
  want() { case " ${SECTIONS:-bw lat rate} " in *" $1 "*) return 0 ;; esac; return 1; }
  bw_extra="--slots 1"  # perftest's memory (see the top)
  shuttle_extra=$bw_extra
  for size in 4096 65536; do
    want bw || break
    n=$([ $size = 4096 ] && echo 5000 || echo 1000)
    row write_bw $size MB/s "write_bw $size $n 128" "ib_write_bw $size $n" 1.0 ">=" 
    row read_bw $size MB/s "read_bw $size $n 128" "ib_read_bw $size $n" 1.0 ">="
    row send_bw $size MB/s "send_bw $size $n 128" "ib_send_bw $size $n" 1.0 ">="
  done
  for size in 2 64; do
    want lat || break
    shuttle_extra="--rx-depth 16"
    for t in write send read; do
      row ${t}_lat $size usec "${t}_lat $size 1000 1" "ib_${t}_lat $size 1000" 1.05 "<="
    done
  done
  if want lat; then
    shuttle_extra="--rx-depth 16 --ops single"
    row read_lat 2 usec "read_lat 2 1000 1" "ib_read_lat 2 1000" 1.05 info
  fi
  shuttle_extra=$bw_extra
  want rate && row msgrate 64 Mpps "write_bw 64 20000 128" "ib_write_bw 64 20000" 1.0 ">="
  exit 0
fi

build=${1:-build-bench}
cd "$(dirname "$0")/.."
if [ ! -d "$build" ]; then meson setup "$build" --buildtype=release >/dev/null; fi
ninja -C "$build" examples/shuttle-perf >/dev/null
for b in ib_write_bw ib_read_bw ib_send_bw ib_write_lat ib_send_lat ib_read_lat; do
  command -v $b >/dev/null || { echo "verbs_perf.sh: $b not found (apt-get install perftest)" >&2; exit 1; }
done
perf=$(readlink -f "$build/examples/shuttle-perf")
echo "# host load average: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
echo "# verbs_perf: shuttle-perf (verbs provider) vs perftest $(dpkg-query -W -f='${Version}' perftest 2>/dev/null)," \
  "Soft-RoCE rxe0 in a TCG guest (2 vCPUs, RoCE MTU 4096); bw MB/s (2^20) average, lat t_typical usec"
set +e
bash tests/softrdma/guest-run.sh -M 9000 -t 6000 -e SECTIONS="${SECTIONS:-bw lat rate}" -e REPS="${REPS:-3}" -e VERBOSE="${VERBOSE:-}" \
  -e CONTROL="${CONTROL:-}" -- bash "$(readlink -f "$0")" --in-guest "$perf"
rc=$?
[ $rc = 77 ] && echo "verbs_perf.sh: no Soft-RoCE guest available (skipped)" >&2
exit $rc
