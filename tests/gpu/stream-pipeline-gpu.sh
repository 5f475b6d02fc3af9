#!/bin/bash
# stream-pipeline-gpu.sh STREAM_PIPELINE: the streaming pipeline with its
# compute stage on the GPU (--compute gpu): every record confirmed by the sink
# with the digest the kernel computed (count and checksum equal). Exit 77
# (skip) where no GPU is usable.
exe=$1
if ! nvidia-smi -L >/dev/null 2>&1; then echo "SKIP: no GPU (nvidia-smi -L failed)"; exit 77; fi
out=$("$exe" --compute gpu --clients 8 --records-per-client 20000 --quiet 2>&1)
rc=$?
echo "$out"
[ $rc = 0 ] || { echo "FAIL: stream_pipeline exit status $rc"; exit 1; }
grep -q "compute stage on the GPU" <<<"$out" || { echo "FAIL: the compute stage did not run on the GPU"; exit 1; }
grep -q "OK: out == in" <<<"$out" || { echo "FAIL: out != in"; exit 1; }
echo "stream-pipeline-gpu: OK"
