#!/usr/bin/env bash
# The kernel nat path at kernel cost. In one run, interleaved per round, the
# same caller (a client namespace) reaches the same guest server:
#   direct        routed to the guest, no NAT (the baseline)
#   plain-nft     one hand-written nft DNAT rule, no cap, no counting
#   nat-capped    brokkrd's `nat` exposure, maxConns 256
#   nat-uncapped  brokkrd's `nat` exposure, maxConns 0
#   docker-proxy  Debian's docker-proxy, one process for the port
# Measured: iperf3 -P1/-P8, short connections/s (8 connectors), p50/p99 of a
# whole short connection (1 connector), brokkrd's CPU per connection, the
# docker-proxy's rate with brokkrd running and stopped, and brokkrd's
# netplane pass with 0 and 200,000 unrelated conntrack entries.
# Then the socket path: a caller on the host itself (in the host namespace,
# in a child cgroup the script makes, where brokkrd attaches its cgroup
# programs) reaches the guest:
#   local-direct   the guest's address
#   socket         127.0.0.1:port of an `auto` exposure (connect-time translation)
#   brokkr-proxy   127.0.0.1:port of a `proxy` exposure
#   local-docker   docker-proxy on 127.0.0.1
# Standalone as root; creates and deletes its own brk-np-* namespaces.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "natpath.sh: needs root" >&2; exit 1; }
export PATH=/usr/local/go/bin:$PATH
P=brk-np
CL=$P-cli HO=$P-host GU=$P-g1
ROUNDS=${ROUNDS:-3} SECS=${SECS:-4} DUR=${DUR:-4}
work=$(mktemp -d /tmp/brk-np.XXXXXX)
CG=/sys/fs/cgroup/unified/brk-np-$$
pids=()
daemon=""
cleanup() {
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $CL $HO $GU; do ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns delete $n 2>/dev/null || true; done
  cp "$work/brokkrd.log" /tmp/brk-np-brokkrd.log 2>/dev/null || true
  umount "$work/bpf" 2>/dev/null || true
  [ -d "$CG" ] && { cat "$CG/cgroup.procs" 2>/dev/null | while read -r p; do echo "$p" > /sys/fs/cgroup/unified/cgroup.procs 2>/dev/null; done; rmdir "$CG" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

go build -o "$work/" ./cmd/brokkrd ./tests/bench/connrate ./tests/bench/ctfill ./tests/bench/bpfcost
DP=.cache/docker-proxy/usr/sbin/docker-proxy
if [ ! -x "$DP" ]; then
  (cd "$work" && { apt-get download docker.io 2>/dev/null || { apt-get update -qq && apt-get download docker.io; }; } && dpkg -x docker.io_*.deb dx)
  mkdir -p "$(dirname "$DP")"; cp "$work/dx/usr/sbin/docker-proxy" "$DP"
fi

inns() { local n=$1; shift; nsenter --net=/run/netns/$n -- "$@"; }
for n in $CL $HO $GU; do ip netns delete $n 2>/dev/null || true; ip netns add $n; ip -n $n link set lo up; done
ip -n $CL link add eth0 type veth peer name vh-cli netns $HO
ip -n $CL addr add 10.99.0.2/24 dev eth0; ip -n $CL link set eth0 up
ip -n $CL route add default via 10.99.0.1
ip -n $HO addr add 10.99.0.1/24 dev vh-cli; ip -n $HO link set vh-cli up
for n in $CL $HO; do ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000"; done
# Thousands of short connections a second leave their conntrack entries in
# TIME_WAIT for 120 s and fill the table (nf_conntrack_max), which then
# slows whichever path runs next: the host namespace (ours) keeps them 1 s.
ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1 2>/dev/null || {
  ip netns exec $HO nft add table ip brk-np-ct 2>/dev/null; ip netns exec $HO nft delete table ip brk-np-ct 2>/dev/null
  ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1; }
ulimit -n "$(ulimit -Hn)"

mkdir -p "$work/bpf" && mount -t bpf bpf "$work/bpf"
cat >"$work/brokkr.yaml" <<YAML
stateDir: $work/state
runDir: $work/run
bpfDir: $work/bpf/brokkr
network:
  bridge: brk-np0
  cidr: 10.213.0.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: iperf-capped, target: 10.213.0.200, guestPort: 5201, hostPort: 20001, mode: nat, maxConns: 256}
  - {name: rate-capped, target: 10.213.0.200, guestPort: 7000, hostPort: 20002, mode: nat, maxConns: 256}
  - {name: rate-uncapped, target: 10.213.0.200, guestPort: 7000, hostPort: 20003, mode: nat, maxConns: 0}
  - {name: iperf-auto, target: 10.213.0.200, guestPort: 5201, hostPort: 21001, mode: auto, maxConns: 256}
  - {name: rate-auto, target: 10.213.0.200, guestPort: 7000, hostPort: 21002, mode: auto, maxConns: 256}
  - {name: iperf-proxy, target: 10.213.0.200, guestPort: 5201, hostPort: 22001, hostAddress: 127.0.0.1, mode: proxy, maxConns: 256}
  - {name: rate-proxy, target: 10.213.0.200, guestPort: 7000, hostPort: 22002, hostAddress: 127.0.0.1, mode: proxy, maxConns: 256}
YAML
# brokkrd's cgroup programs go on a child cgroup of the script's own, never
# the root; host-local callers run inside it.
mkdir -p "$CG"
export BROKKR_CGROUP=$CG
inhost_cg() { nsenter --net=/run/netns/$HO -- sh -c 'echo $$ > "$0/cgroup.procs" && shift && exec "$@"' "$CG" x "$@"; }
start_daemon() {
  # nsenter itself, not through a function: it execs brokkrd, so $! is
  # brokkrd's pid (its CPU is what is measured, and what stop_daemon stops).
  nsenter --net=/run/netns/$HO -- "$work/brokkrd" --config "$work/brokkr.yaml" >>"$work/brokkrd.log" 2>&1 &
  daemon=$!
  for i in $(seq 100); do curl -sf --unix-socket "$work/run/brokkr.sock" http://brokkrd/v1/status >/dev/null 2>&1 && break; sleep 0.1; done
  [ "$(cat /proc/"$daemon"/comm 2>/dev/null)" = brokkrd ] || { echo "natpath.sh: brokkrd did not start" >&2; tail -n 20 "$work/brokkrd.log" >&2; exit 1; }
  sleep 1.5
}
stop_daemon() {
  kill "$daemon"; wait "$daemon" 2>/dev/null || true
  [ ! -e /proc/"$daemon" ] || { echo "natpath.sh: brokkrd did not stop" >&2; exit 1; }
  daemon=""
}
start_daemon
grep -i "nat path\|conntrack events\|socket path" "$work/brokkrd.log" || echo "brokkrd: the BPF nat path and the socket path are in use"

# The guest: a namespace on brokkr's bridge at an address brokkr does not run.
ip -n $HO link add g1p type veth peer name eth0 netns $GU
ip -n $HO link set g1p master brk-np0 up
ip -n $GU addr add 10.213.0.200/24 dev eth0; ip -n $GU link set eth0 up
ip -n $GU route add default via 10.213.0.1
nsenter --net=/run/netns/$GU -- iperf3 -s -p 5201 >"$work/iperf3.log" 2>&1 & pids+=($!)
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve 10.213.0.200:7000 >"$work/serve.log" 2>&1 & pids+=($!)

# A plain nft DNAT rule in a table of its own, beside brokkr's.
inns $HO nft -f - <<'NFT'
table ip plain {
  chain pre { type nat hook prerouting priority -110; policy accept;
    ip daddr 10.99.0.1 tcp dport 30001 dnat to 10.213.0.200:5201
    ip daddr 10.99.0.1 tcp dport 30002 dnat to 10.213.0.200:7000
  }
}
NFT
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 10.99.0.1 -host-port 40001 -container-ip 10.213.0.200 -container-port 5201 3>"$work/dp1.ready" >"$work/dp1.log" 2>&1 & pids+=($!)
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 10.99.0.1 -host-port 40002 -container-ip 10.213.0.200 -container-port 7000 3>"$work/dp2.ready" >"$work/dp2.log" 2>&1 & pids+=($!)
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 127.0.0.1 -host-port 41001 -container-ip 10.213.0.200 -container-port 5201 3>"$work/dp3.ready" >"$work/dp3.log" 2>&1 & pids+=($!)
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 127.0.0.1 -host-port 41002 -container-ip 10.213.0.200 -container-port 7000 3>"$work/dp4.ready" >"$work/dp4.log" 2>&1 & pids+=($!)
sleep 1

declare -A IPERF=( [direct]=10.213.0.200:5201 [plain-nft]=10.99.0.1:30001 [nat-capped]=10.99.0.1:20001 [docker-proxy]=10.99.0.1:40001 )
declare -A RATE=( [direct]=10.213.0.200:7000 [plain-nft]=10.99.0.1:30002 [nat-capped]=10.99.0.1:20002 [nat-uncapped]=10.99.0.1:20003 [docker-proxy]=10.99.0.1:40002 )
gbps() {
  local a=${1%:*} p=${1#*:}
  for try in 1 2 3; do
    sleep 0.5
    if out=$(inns $CL iperf3 -c "$a" -p "$p" -t "$DUR" -P "$2" -f g 2>/dev/null); then
      echo "$out" | awk '/receiver/ {v=$(NF-2)} END {print v}'; return
    fi
  done
  echo nan
}
ticks() {
  [ -r /proc/"$1"/stat ] || { echo "natpath.sh: brokkrd (pid $1) is gone; its log is kept in /tmp/brk-np-brokkrd.log" >&2; tail -n 20 "$work/brokkrd.log" >&2; exit 1; }
  awk '{print $14+$15}' /proc/"$1"/stat
}
hz=$(getconf CLK_TCK)
# rec ROUND PATH METRIC VALUE: one figure, for the summary at the end.
rec() { echo "$1 $2 $3 $4" >>"$work/results.txt"; }
# rotate R WORDS...: the words rotated by R, so each round measures the
# paths in another order (no path always comes after the others' load).
rotate() { local r=$1; shift; local a=("$@") n=$#; for ((i = 0; i < n; i++)); do echo "${a[$(((i + r) % n))]}"; done; }

echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); rounds=$ROUNDS, ${SECS}s rate runs, ${DUR}s iperf3"
for r in $(seq "$ROUNDS"); do
  for path in $(rotate "$r" direct plain-nft nat-capped docker-proxy); do
    p1=$(gbps "${IPERF[$path]}" 1); p8=$(gbps "${IPERF[$path]}" 8)
    rec "$r" "$path" p1 "$p1"; rec "$r" "$path" p8 "$p8"
    echo "round=$r path=$path iperf3 P1=$p1 P8=$p8"
  done
  for path in $(rotate "$r" direct plain-nft nat-capped nat-uncapped docker-proxy); do
    t0=$(ticks "$daemon")
    rate=$(inns $CL "$work/connrate" -rate "${RATE[$path]}" -c 8 -d "${SECS}s")
    t1=$(ticks "$daemon")
    n=$(echo "$rate" | sed -E 's/.*\(([0-9]+) ok.*/\1/')
    cpu=$(awk -v d=$((t1 - t0)) -v hz="$hz" -v n="$n" 'BEGIN { if (n > 0) printf "%.2f", d / hz * 1e6 / n; else print "nan" }')
    lat=$(inns $CL "$work/connrate" -rate "${RATE[$path]}" -c 1 -d "${SECS}s")
    rec "$r" "$path" rate "$(echo "$rate" | awk '{print $1}')"; rec "$r" "$path" cpu "$cpu"
    rec "$r" "$path" p50 "$(echo "$lat" | sed -E 's/.*p50=([0-9]+)us.*/\1/')"; rec "$r" "$path" p99 "$(echo "$lat" | sed -E 's/.*p99=([0-9]+)us.*/\1/')"
    echo "round=$r path=$path rate: $rate | brokkrd CPU per conn: ${cpu}us | 1 connector: $lat"
  done
  # docker-proxy in the same namespace, brokkrd stopped then running.
  stop_daemon
  off=$(inns $CL "$work/connrate" -rate "${RATE[docker-proxy]}" -c 8 -d "${SECS}s")
  start_daemon
  on=$(inns $CL "$work/connrate" -rate "${RATE[docker-proxy]}" -c 8 -d "${SECS}s")
  rec "$r" dp-stopped rate "$(echo "$off" | awk '{print $1}')"; rec "$r" dp-running rate "$(echo "$on" | awk '{print $1}')"
  echo "round=$r docker-proxy with brokkrd stopped: $off | running: $on"
done

# The socket path, from the host itself.
declare -A LIPERF=( [local-direct]=10.213.0.200:5201 [socket]=127.0.0.1:21001 [brokkr-proxy]=127.0.0.1:22001 [local-docker]=127.0.0.1:41001 )
declare -A LRATE=( [local-direct]=10.213.0.200:7000 [socket]=127.0.0.1:21002 [brokkr-proxy]=127.0.0.1:22002 [local-docker]=127.0.0.1:41002 )
lgbps() {
  local a=${1%:*} p=${1#*:}
  for try in 1 2 3; do
    sleep 0.5
    if out=$(inhost_cg iperf3 -c "$a" -p "$p" -t "$DUR" -P "$2" -f g 2>/dev/null); then
      echo "$out" | awk '/receiver/ {v=$(NF-2)} END {print v}'; return
    fi
  done
  echo nan
}
for r in $(seq "$ROUNDS"); do
  for path in $(rotate "$r" local-direct socket brokkr-proxy local-docker); do
    p1=$(lgbps "${LIPERF[$path]}" 1); p8=$(lgbps "${LIPERF[$path]}" 8)
    rec "$r" "$path" p1 "$p1"; rec "$r" "$path" p8 "$p8"
    echo "round=$r local path=$path iperf3 P1=$p1 P8=$p8"
  done
  for path in $(rotate "$r" local-direct socket brokkr-proxy local-docker); do
    t0=$(ticks "$daemon")
    rate=$(inhost_cg "$work/connrate" -rate "${LRATE[$path]}" -c 8 -d "${SECS}s")
    t1=$(ticks "$daemon")
    n=$(echo "$rate" | sed -E 's/.*\(([0-9]+) ok.*/\1/')
    cpu=$(awk -v d=$((t1 - t0)) -v hz="$hz" -v n="$n" 'BEGIN { if (n > 0) printf "%.2f", d / hz * 1e6 / n; else print "nan" }')
    lat=$(inhost_cg "$work/connrate" -rate "${LRATE[$path]}" -c 1 -d "${SECS}s")
    rec "$r" "$path" rate "$(echo "$rate" | awk '{print $1}')"; rec "$r" "$path" cpu "$cpu"
    rec "$r" "$path" p50 "$(echo "$lat" | sed -E 's/.*p50=([0-9]+)us.*/\1/')"; rec "$r" "$path" p99 "$(echo "$lat" | sed -E 's/.*p99=([0-9]+)us.*/\1/')"
    echo "round=$r local path=$path rate: $rate | brokkrd CPU per conn: ${cpu}us | 1 connector: $lat"
  done
done

# What the programs cost per run, under the short-connection load of each
# kernel path (the kernel's run-time statistics, on only while bpfcost runs).
for path in nat-capped socket; do
  "$work/bpfcost" -d "$((SECS + 1))s" >"$work/bpfcost.txt" & bp=$!
  sleep 0.5
  if [ "$path" = socket ]; then
    load=$(inhost_cg "$work/connrate" -rate "${LRATE[socket]}" -c 8 -d "${SECS}s")
  else
    load=$(inns $CL "$work/connrate" -rate "${RATE[nat-capped]}" -c 8 -d "${SECS}s")
  fi
  wait $bp
  echo "bpf cost under $path load ($load):"
  sed 's/^/  /' "$work/bpfcost.txt"
done

# A netplane pass with 0 and 200,000 unrelated conntrack entries: the mean of
# brokkr_converge_duration_seconds{engine="netplane"} over 10 s of passes.
pass() {
  local m1 m2
  m1=$(curl -s --unix-socket "$work/run/brokkr.sock" http://brokkrd/metrics | awk '/^brokkr_converge_duration_seconds_(sum|count)\{engine="netplane"\}/ {print $2}' | paste -sd' ')
  sleep 10
  m2=$(curl -s --unix-socket "$work/run/brokkr.sock" http://brokkrd/metrics | awk '/^brokkr_converge_duration_seconds_(sum|count)\{engine="netplane"\}/ {print $2}' | paste -sd' ')
  awk -v a="$m1" -v b="$m2" 'BEGIN { split(a, x, " "); split(b, y, " "); printf "%.3f ms (%d passes)", (y[1]-x[1]) / (y[2]-x[2]) * 1000, y[2]-x[2] }'
}
p0=$(pass)
"$work/ctfill" -ns /run/netns/$HO -n "${CT_ENTRIES:-200000}" >/dev/null
echo "conntrack entries in the host namespace: $(inns $HO cat /proc/sys/net/netfilter/nf_conntrack_count)"
p1=$(pass)
echo "netplane pass: 0 unrelated entries $p0 | ${CT_ENTRIES:-200000} unrelated entries $p1"
rate=$(inns $CL "$work/connrate" -rate "${RATE[nat-capped]}" -c 8 -d "${SECS}s")
echo "nat-capped with ${CT_ENTRIES:-200000} unrelated entries: $rate"
echo "brokkrd's warnings and errors:"; grep -i '"level":"\(WARN\|ERROR\)"\|level=\(WARN\|ERROR\)' "$work/brokkrd.log" | cut -c1-300 || echo "(none)"

# Summary: per path the median over rounds of each figure, and the median of
# the per-round ratios to a baseline measured in the same round.
echo
echo "# summary (median over $ROUNDS rounds; ratios are medians of per-round ratios)"
awk '
  { v[$1, $2, $3] = $4; paths[$2] = 1; rounds[$1] = 1; metrics[$3] = 1 }
  function median(a, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
  function med(p, m,   r, a, n) { n = 0; for (r in rounds) if ((r, p, m) in v && v[r, p, m] != "nan") a[++n] = v[r, p, m]; return n ? median(a, n) : "nan" }
  function ratio(p, b, m,   r, a, n) { n = 0; for (r in rounds) if ((r, p, m) in v && (r, b, m) in v && v[r, b, m] > 0) a[++n] = v[r, p, m] / v[r, b, m]; return n ? sprintf("%.2f", median(a, n)) : "nan" }
  END {
    printf "%-13s %8s %8s %9s %8s %8s %9s | ratios\n", "path", "P1Gb/s", "P8Gb/s", "conns/s", "p50us", "p99us", "cpu/conn"
    split("direct plain-nft nat-capped nat-uncapped docker-proxy", rem, " ")
    for (i = 1; i <= 5; i++) { p = rem[i]; if (!(p in paths)) continue
      printf "%-13s %8s %8s %9s %8s %8s %9s | vs plain-nft: P1 %s P8 %s conns %s p50 %s p99 %s; vs direct: conns %s\n", p, med(p, "p1"), med(p, "p8"), med(p, "rate"), med(p, "p50"), med(p, "p99"), med(p, "cpu"),
        ratio(p, "plain-nft", "p1"), ratio(p, "plain-nft", "p8"), ratio(p, "plain-nft", "rate"), ratio(p, "plain-nft", "p50"), ratio(p, "plain-nft", "p99"), ratio(p, "direct", "rate") }
    split("local-direct socket brokkr-proxy local-docker", loc, " ")
    for (i = 1; i <= 4; i++) { p = loc[i]; if (!(p in paths)) continue
      printf "%-13s %8s %8s %9s %8s %8s %9s | vs local-direct: P1 %s P8 %s conns %s p50 %s; vs docker-proxy: P1 %s P8 %s conns %s\n", p, med(p, "p1"), med(p, "p8"), med(p, "rate"), med(p, "p50"), med(p, "p99"), med(p, "cpu"),
        ratio(p, "local-direct", "p1"), ratio(p, "local-direct", "p8"), ratio(p, "local-direct", "rate"), ratio(p, "local-direct", "p50"), ratio(p, "local-docker", "p1"), ratio(p, "local-docker", "p8"), ratio(p, "local-docker", "rate") }
    printf "docker-proxy with brokkrd running / stopped: conns %s\n", ratio("dp-running", "dp-stopped", "rate")
  }' "$work/results.txt"
