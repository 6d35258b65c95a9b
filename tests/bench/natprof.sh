#!/usr/bin/env bash
# Where brk_nat_pre's time goes, by kind of packet, for the nat-path
# programs of one or more git revisions: each revision's bpf/natpath.c is
# instrumented by natprof/prof.py (the program times itself with
# bpf_ktime_get_ns, about 30 ns of its own per run, and adds the time to a
# per-CPU array by what the packet was: admitted SYN, SYN-ACK, data, first
# FIN, second FIN (release), other packets of a flow, packets without one),
# built into natcost, and loaded in turn on one topology (a client, a host
# with a bridge, a guest; one marked DNAT rule per family, no brokkr table)
# under the same short-connection load, IPv4 then IPv6, the revisions'
# order alternating each round. A diagnostic, not a benchmark: the figures
# include the instrumentation, and the machine's load moves them; compare
# revisions measured in the same run.
#
#   tests/bench/natprof.sh REV...        e.g. natprof.sh 47c2e0f HEAD
#   env: ROUNDS=2 SECS=4 CONNS=4
#
# Needs clang-14 (go generate) and root; creates and deletes its own
# brk-npf-* namespaces and bpffs mount.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "natprof.sh: needs root" >&2; exit 1; }
[ $# -ge 1 ] || { echo "usage: natprof.sh REV..." >&2; exit 2; }
export PATH=/usr/local/go/bin:$PATH
P=brk-npf
CL=$P-cli HO=$P-host GU=$P-g1
ROUNDS=${ROUNDS:-2} SECS=${SECS:-4} CONNS=${CONNS:-4}
work=$(mktemp -d /tmp/brk-npf.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $CL $HO $GU; do
    ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns delete $n 2>/dev/null || true
  done
  umount "$work/bpf" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

go build -o "$work/" ./tests/bench/connrate
revs=()
for rev in "$@"; do
  h=$(git rev-parse --short "$rev")
  mkdir "$work/src-$h"
  git archive "$h" | tar -x -C "$work/src-$h"
  python3 tests/bench/natprof/prof.py "$work/src-$h/bpf/natpath.c"
  (cd "$work/src-$h" && go generate ./bpf/... >/dev/null && go build -o "$work/natcost-$h" ./tests/bench/natcost)
  revs+=("$h")
done

. tests/bench/topo6.sh
topo6 $CL $HO $GU
ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1 2>/dev/null || true
ulimit -n "$(ulimit -Hn)"
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve "[::]:7000" >/dev/null 2>&1 & pids+=($!)
inns $HO nft -f - <<NFT
table inet brk-npf {
  chain pre { type nat hook prerouting priority -100; policy accept;
    ip daddr 10.99.0.1 tcp dport 31002 ct mark set 0x20000001 dnat ip to 10.213.0.11:7000
    ip6 daddr fd00:99::1 tcp dport 31002 ct mark set 0x20000001 dnat ip6 to [fd00:6272:6b72::c8]:7000
  }
}
NFT
for i in $(seq 50); do [ -n "$(ip netns exec $GU ss -Hltn 'sport = :7000')" ] && break; sleep 0.1; done
mkdir -p "$work/bpf"; mount -t bpf bpf "$work/bpf"

# dump: the brk_prof array summed over CPUs, "key n ns" per line.
dump() {
  bpftool -j map dump id "$1" | python3 -c '
import json, sys
for e in json.load(sys.stdin):
    f = e["formatted"]
    print(f["key"], sum(v["value"]["n"] for v in f["values"]), sum(v["value"]["ns"] for v in f["values"]))'
}
names="0:other 2:admitted 3:no-flow 4:syn-ack 5:data 6:fin-first 7:fin-second 8:flow-other 9:rst"
echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds, ${SECS}s, $CONNS connectors"
for r in $(seq "$ROUNDS"); do
  order=("${revs[@]}")
  [ $((r % 2)) = 0 ] && order=($(printf '%s\n' "${revs[@]}" | tac))
  for h in "${order[@]}"; do
    "$work/natcost-$h" load -pins "$work/bpf" -ns /run/netns/$HO -bridge br0 -guests 10.213.0.0/24 -guests6 fd00:6272:6b72::/64 -slot web -cap 100000 >/dev/null
    id=$(bpftool -j map show | python3 -c 'import json,sys; print(max(m["id"] for m in json.load(sys.stdin) if m.get("name") == "brk_prof"))')
    for fam in 4 6; do
      to=10.99.0.1:31002; [ $fam = 6 ] && to="[fd00:99::1]:31002"
      sleep 1
      dump "$id" >"$work/a"
      rate=$(inns $CL "$work/connrate" -rate "$to" -c "$CONNS" -d "${SECS}s" | awk '{print $1}')
      dump "$id" >"$work/b"
      line=$(join "$work/a" "$work/b" | awk -v names="$names" '
        BEGIN { n = split(names, a, " "); for (i = 1; i <= n; i++) { split(a[i], kv, ":"); nm[kv[1]] = kv[2] } }
        { dn = $4 - $2; dt = $5 - $3; if (dn > 0) { printf " %s=%.0f", (($1 in nm) ? nm[$1] : $1), dt / dn; N += dn; T += dt } }
        END { printf " | all=%.0f ns (%d runs)", (N ? T / N : 0), N }')
      echo "round=$r rev=$h v$fam conns/s=$rate:$line"
    done
    "$work/natcost-$h" remove -pins "$work/bpf" -ns /run/netns/$HO -bridge br0
  done
done
