#!/usr/bin/env bash
# netplane (nat) benchmark. Standalone as root; creates and deletes its own
# brk-nf-* namespaces (trap), touches nothing else.
#
#   client ns (10.99.0.2) --veth-- host ns (10.99.0.1; br0 10.213.0.1/24)
#                                          --veth on br0-- guest ns (10.213.0.11)
#
# 1. iperf3 P=1 and P=8, and the short-connection rate, client -> guest
#    routed directly (baseline) and client -> host port -> guest through the
#    brokkr table (DNAT), in the same run, interleaved.
# 2. scale: apply 10..100,000 exposures (SCALE_SIZES), one more change at
#    each size, connect latency to the last exposure against direct routing
#    at each size; then a linear-chain anchor at 10,000 (SCALE_LINEAR, 0 =
#    off). The rows go to $OUT/nat-scale.csv and tests/bench/plot draws
#    $OUT/nat-apply.png and $OUT/nat-latency.png from them.
# 3. changes: at 10..100,000 exposures (CHANGES_SIZES), interleaved rounds
#    (CHANGES_ROUNDS): a whole table into an empty one, one exposure more
#    and less through Update, one more through a whole-state Converge, a
#    no-change pass, the same after another program's commit; medians and
#    spread to $OUT/nat-changes.csv, drawn as $OUT/nat-changes.png.
#
# OUT: tests/bench/out/<UTC time>/ unless run.sh passes BENCH_OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "nat.sh: needs root" >&2; exit 1; }
P=brk-nf
CLI=$P-cli HOST=$P-host G1=$P-g1
DUR=${DUR:-5}
CONNS=${CONNS:-3000}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $CLI $HOST $G1; do ip netns delete $n 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
cleanup

OUT=${BENCH_OUT:-tests/bench/out/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
go build -o /tmp/brk-nf-natscale ./tests/bench/natscale
go build -o /tmp/brk-nf-plot ./tests/bench/plot
NS=/tmp/brk-nf-natscale

for n in $CLI $HOST $G1; do ip netns add $n; ip -n $n link set lo up; done
ip -n $CLI link add eth0 type veth peer name vh-cli netns $HOST
ip -n $CLI addr add 10.99.0.2/24 dev eth0; ip -n $CLI link set eth0 up
ip -n $CLI route add default via 10.99.0.1
ip -n $HOST addr add 10.99.0.1/24 dev vh-cli; ip -n $HOST link set vh-cli up
# A second host address: a port is 16 bits, so 100,000 exposures need two.
ip -n $HOST addr add 10.99.1.1/32 dev vh-cli
ip -n $HOST link add br0 type bridge
ip -n $HOST addr add 10.213.0.1/24 dev br0; ip -n $HOST link set br0 up
ip -n $HOST link add g1p type veth peer name eth0 netns $G1
ip -n $HOST link set g1p master br0; ip -n $HOST link set g1p up
ip -n $G1 addr add 10.213.0.11/24 dev eth0; ip -n $G1 link set eth0 up
ip -n $G1 route add default via 10.213.0.1
ip netns exec $HOST sysctl -qw net.ipv4.ip_forward=1

ip netns exec $G1 iperf3 -s -D -p 5201 --pidfile /tmp/brk-nf-iperf.pid
sleep 0.3
pids+=("$(cat /tmp/brk-nf-iperf.pid)")
$NS serve -ns /run/netns/$G1 -addr :7000 & pids+=($!)
sleep 0.3

echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores (shared with other work), iperf3 ${DUR}s"
# The scale part first: its apply timings should not pay for the
# conntrack entries the throughput rounds leave in the host namespace.
echo "# scale"
$NS scale -ns /run/netns/$HOST -client /run/netns/$CLI -guest 10.213.0.11 -guestport 7000 -hostaddrs 10.99.0.1,10.99.1.1 \
  -sizes "${SCALE_SIZES:-10,100,1000,10000,100000}" -n "${SCALE_CONNS:-1000}" -linear "${SCALE_LINEAR:-10000}" -csv "$OUT/nat-scale.csv"
/tmp/brk-nf-plot -csv "$OUT/nat-scale.csv" -out "$OUT"
echo "# changes"
$NS changes -ns /run/netns/$HOST -guest 10.213.0.11 -guestport 7000 -hostaddrs 10.99.0.1,10.99.1.1 \
  -sizes "${CHANGES_SIZES:-10,1000,10000,100000}" -rounds "${CHANGES_ROUNDS:-5}" -csv "$OUT/nat-changes.csv"
/tmp/brk-nf-plot -csv "$OUT/nat-changes.csv" -out "$OUT"
$NS apply -ns /run/netns/$HOST -guest 10.213.0.11 -map 20001:5201,20002:7000
echo "# throughput"
# One iperf3 run (Gbit/s received); the single-client server may still be
# closing the last test, so a "busy" answer is retried.
gbps() {
  for try in 1 2 3; do
    sleep 1
    if out=$(ip netns exec $CLI iperf3 -c "$1" -p "$2" -t "$DUR" -P "$3" -f g 2>/dev/null); then
      echo "$out" | awk '/receiver/ {v=$(NF-2)} END {print v}' && return
    fi
  done
  echo "nan"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for P1 in 1 8; do
    d=$(gbps 10.213.0.11 5201 $P1); n=$(gbps 10.99.0.1 20001 $P1)
    echo "iperf3 round=$round P=$P1 direct=${d}Gbit/s nat=${n}Gbit/s ratio=$(awk -v n="$n" -v d="$d" 'BEGIN {if (d > 0) printf "%.3f", n/d; else print "nan"}')"
  done
  $NS connrate -ns /run/netns/$CLI -addr 10.213.0.11:7000 -n "$CONNS" | sed "s/^/round=$round direct /"
  $NS connrate -ns /run/netns/$CLI -addr 10.99.0.1:20002 -n "$CONNS" | sed "s/^/round=$round nat    /"
done

