# Sourced inside the Soft-RoCE guest by the benchmarks that pair shuttle-perf
# with perftest (verbs_perf.sh, verbs_insn.sh): both tools' options for rxe0
# (GID index 1 is the IPv4 one, see tests/softrdma/guest-run.sh) and waiting
# for a server. Messages name the sourcing script.
O="--transport verbs --device rxe0 --gid-index 1"
P="-d rxe0 -x 1 -F"
addr=192.168.77.1
guest_bench=$(basename "$0" .sh)

# wait_for FILE PATTERN: until a server's log shows PATTERN (60 s at most:
# a server under valgrind starts slowly)
wait_for() {
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "$guest_bench: server did not start:" >&2; cat "$1" >&2; return 1
}
# wait_listen PORT [PID]: until something listens on TCP PORT (perftest's
# server), giving up early when PID has exited
wait_listen() {
  for _ in $(seq 600); do
    [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null && break
    ss -Hltn "sport = :$1" 2>/dev/null | grep -q LISTEN && return 0
    sleep 0.1
  done
  echo "$guest_bench: perftest server did not listen on $1" >&2; return 1
}
