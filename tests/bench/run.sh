#!/usr/bin/env bash
# make bench: runs every area's benchmark script (tests/bench/*.sh) and the Go
# benchmarks, each comparing against a baseline measured in the same run.
# Output goes to tests/bench/out/<timestamp>/; BENCHMARKS.md records results.
# BENCH_ONLY="nat6 natab" (script names without .sh) runs only those scripts
# and no Go benchmarks, e.g. `BENCH_ONLY=nat6 make bench` for the IPv6 nat path.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=tests/bench/out/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
rc=0
for s in tests/bench/*.sh; do
  [ "$(basename "$s")" = run.sh ] && continue
  if [ -n "${BENCH_ONLY:-}" ] && ! [[ " $BENCH_ONLY " == *" $(basename "$s" .sh) "* ]]; then continue; fi
  echo "== $s"
  BENCH_OUT=$out bash "$s" 2>&1 | tee "$out/$(basename "$s" .sh).txt" || rc=1
  scripts/clean-ns.sh
done
if [ -z "${BENCH_ONLY:-}" ]; then
  echo "== go test -bench"
  go test -run '^$' -bench . -benchtime 1x ./... 2>&1 | tee "$out/go-bench.txt" || rc=1
fi
echo "results in $out"
exit $rc
