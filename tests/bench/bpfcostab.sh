#!/usr/bin/env bash
# A/B of the nat-path programs' own cost per run (tests/bench/bpfcost: the
# kernel's run-time statistics, on only while it runs) between natcost
# binaries of two trees, IPv4 and IPv6, under the same short-connection load.
# Two identical topologies (client, host with a bridge, guest; one marked
# DNAT rule per family to the guest, no brokkr table), the old binary's
# programs on one and the new one's on the other, measured at the same time
# (the machine's noise falls on both), the topologies swapping each round.
# It measures the programs' time, not the connection rate, so it can run
# beside other work; but each load's rate moves its own figure (warmer
# caches), and on a shared 2-core machine the per-round differences spread
# by ±200 ns: use many rounds, or tests/bench/natprof.sh for where it goes.
#
#   tests/bench/bpfcostab.sh OLD_NATCOST [NEW_NATCOST]
#   env: ROUNDS=5 SECS=4 CONNS=4 (connectors of each load)
#
# NEW_NATCOST defaults to this tree's tests/bench/natcost. Prints per round
# and binary the ns per run of brk_nat_pre (the caller's and the guest's
# packets both pass PREROUTING here, about 10 runs per connection), then
# medians [min..max] and the median of the per-round differences new - old.
# Root; creates and deletes its own brk-bca-* namespaces and bpffs mount.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "bpfcostab.sh: needs root" >&2; exit 1; }
[ $# -ge 1 ] || { echo "usage: bpfcostab.sh OLD_NATCOST [NEW_NATCOST]" >&2; exit 2; }
export PATH=/usr/local/go/bin:$PATH
P=brk-bca
ROUNDS=${ROUNDS:-5} SECS=${SECS:-4} CONNS=${CONNS:-4}
work=$(mktemp -d /tmp/brk-bca.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for t in x y; do for n in $P-$t-cli $P-$t-host $P-$t-g1; do
    ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete $n 2>/dev/null || true
  done; done
  umount "$work/bpf" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cp "$1" "$work/natcost-old"
if [ $# -ge 2 ]; then cp "$2" "$work/natcost-new"; else go build -o "$work/natcost-new" ./tests/bench/natcost; fi
go build -o "$work/" ./tests/bench/connrate ./tests/bench/bpfcost
ulimit -n "$(ulimit -Hn)"

. tests/bench/topo6.sh
# topo T: topo6's topology as $P-T-cli, $P-T-host, $P-T-g1, with a marked
# DNAT to the guest's connrate.
topo() {
  local CL=$P-$1-cli HO=$P-$1-host GU=$P-$1-g1
  topo6 $CL $HO $GU
  ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1 2>/dev/null || true
  nsenter --net=/run/netns/$GU -- "$work/connrate" -serve "[::]:7000" >/dev/null 2>&1 & pids+=($!)
  inns $HO nft -f - <<NFT
table inet brk-bca {
  chain pre { type nat hook prerouting priority -100; policy accept;
    ip daddr 10.99.0.1 tcp dport 31002 ct mark set 0x20000001 dnat ip to 10.213.0.11:7000
    ip6 daddr fd00:99::1 tcp dport 31002 ct mark set 0x20000001 dnat ip6 to [fd00:6272:6b72::c8]:7000
  }
}
NFT
  for i in $(seq 50); do [ -n "$(ip netns exec $GU ss -Hltn 'sport = :7000')" ] && break; sleep 0.1; done
}
topo x; topo y

mkdir -p "$work/bpf"; mount -t bpf bpf "$work/bpf"; mkdir "$work/bpf/x" "$work/bpf/y"
load() { # binary topology
  local m
  m=$("$work/natcost-$1" load -pins "$work/bpf/$2" -ns /run/netns/$P-$2-host -bridge br0 -guests 10.213.0.0/24 -guests6 fd00:6272:6b72::/64 -slot web -cap 100000)
  [ "$m" = 0x20000001 ] || { echo "bpfcostab.sh: $1 gave mark $m, the rules have 0x20000001" >&2; exit 1; }
}
unload() { "$work/natcost-$1" remove -pins "$work/bpf/$2" -ns /run/netns/$P-$2-host -bridge br0; }
progids() { for f in "$work/bpf/$1"/*link*; do bpftool -j link show pinned "$f" | sed -E 's/.*"prog_id":([0-9]+).*/\1/'; done | sort -u | paste -sd,; }
# measure binary topology family: the load and bpfcost of that topology's programs
measure() {
  local to=10.99.0.1:31002 rate ns runs bp
  [ "$3" = 6 ] && to="[fd00:99::1]:31002"
  "$work/bpfcost" -ids "$(progids "$2")" -d "$((SECS + 1))s" >"$work/cost-$2.txt" & bp=$!
  sleep 0.5
  rate=$(inns $P-$2-cli "$work/connrate" -rate "$to" -c "$CONNS" -d "${SECS}s" | awk '{print $1}')
  wait $bp
  ns=$(sed -nE 's/^bpf brk_nat_pre: ([0-9]+) runs, ([0-9]+) ns per run/\2/p' "$work/cost-$2.txt")
  runs=$(sed -nE 's/^bpf brk_nat_pre: ([0-9]+) runs, ([0-9]+) ns per run/\1/p' "$work/cost-$2.txt")
  echo "round=$r bin=$1 v$3 pre_ns=$ns runs=$runs conns/s=$rate topo=$2" >>"$work/res.txt"
}

echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds, ${SECS}s, $CONNS connectors per binary, both at once"
: >"$work/res.txt"
for r in $(seq "$ROUNDS"); do
  # Both binaries measured at once, each on its own topology (the same
  # machine's noise for both); the topologies swap each round.
  if [ $((r % 2)) = 1 ]; then tx=old ty=new; else tx=new ty=old; fi
  load $tx x; load $ty y
  for fam in 4 6; do
    sleep 1
    measure $tx x $fam & a=$!
    measure $ty y $fam & b=$!
    wait $a $b
  done
  unload $tx x; unload $ty y
  grep "^round=$r " "$work/res.txt"
done
echo "brk_nat_pre ns per run, median [min..max]:"
awk '{ k = $3 " " $2; split($4, a, "="); n[k]++; v[k, n[k]] = a[2] }
  END { for (k in n) { m = n[k]; for (i = 1; i <= m; i++) x[i] = v[k, i]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
    printf "  %-12s %s [%s..%s]\n", k, (m % 2 ? x[(m + 1) / 2] : (x[m / 2] + x[m / 2 + 1]) / 2), x[1], x[m] } }' "$work/res.txt" | sort
echo "new - old, ns per run, median [min..max] of the per-round differences:"
awk '{ split($4, a, "="); split($2, b, "="); v[$1, $3, b[2]] = a[2]; r[$1] = 1; f[$3] = 1 }
  END { for (fam in f) { m = 0; for (k in r) if ((k, fam, "new") in v && (k, fam, "old") in v) x[++m] = v[k, fam, "new"] - v[k, fam, "old"]
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
    printf "  %s %s [%s..%s] over %d rounds\n", fam, (m % 2 ? x[(m + 1) / 2] : (x[m / 2] + x[m / 2 + 1]) / 2), x[1], x[m], m } }' "$work/res.txt" | sort
