#!/bin/bash
# Inside the Soft-RoCE guest: transport_kind::automatic with verbs as its
# remote provider (issue 30, point 3). Peers on this host take the local
# provider, the others verbs, and one registration serves both (verbs keys
# in the local provider's key space). Runs each test program given, in one
# guest boot; fails if any fails.
#   run-auto.sh AUTO_PROVIDER CONFORMANCE BLOCKS
set -u
rc=0
echo "== $(basename "$1") (SHUTTLE_TEST_ADDR=$SHUTTLE_TEST_ADDR)"
"$1" --duration=true || rc=1
for t in "$2" "$3"; do
  echo "== $(basename "$t") on SHUTTLE_TRANSPORT=auto"
  SHUTTLE_TRANSPORT=auto SHUTTLE_AUTO_LOCAL=1 "$t" --duration=true || rc=1
done
exit $rc
