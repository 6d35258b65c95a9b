#!/usr/bin/env bash
# Proxy benchmark: brokkr's userspace proxy against direct routing,
# docker-proxy, haproxy (TCP mode, splice) and socat, all in ONE run on the
# same topology:
#
#   brk-px-client (10.77.1.2) --veth-- brk-px-host (10.77.1.1 | 10.77.2.1) --veth-- brk-px-guest (10.77.2.2)
#
# The proxies listen in the host namespace; "direct" routes client -> guest
# through it. Measured: iperf3 -P1 and -P8 throughput, short-connection rate
# (connect, 1-byte exchange, close; 8 connectors, and 1 connector for the
# latency a proxy adds), and RSS per idle held connection. The proxies that
# write a PROXY protocol header (brokkr, its variants, haproxy) are measured
# once more with one (v2, to a guest echo that reads it: ports 73xx), as
# "conns/s, PROXY v2".
# Each figure is the median of $ROUNDS runs; ratios are to direct (and to
# docker-proxy) from the same run.
#
# Run as root: tests/bench/proxy.sh   (env: ROUNDS=3 SECS=4 HOLD=1000 KEEP=FILE)
#
# A/B of a proxy change: VARIANTS="NAME=ENV:BINARY ..." adds brokkr proxies
# to the run, each a proxyrun binary started with ENV ("-" for none), e.g.
#   go build -o /tmp/old ./tests/bench/proxyrun   # at the commit before
#   VARIANTS="old=-:/tmp/old gmp1=GOMAXPROCS=1:/tmp/old" tests/bench/proxy.sh
# They are measured like every other path, in the same rotating order.
# Everything it creates is named brk-px-* and removed on exit, also on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-4}
HOLD=${HOLD:-1000}
P=brk-px
CL=$P-client HO=$P-host GU=$P-guest
work=$(mktemp -d /tmp/$P-bench.XXXXXX)
pids=()

cleanup() {
  # KEEP=FILE keeps the raw results ("round path metric value" lines), also
  # those of a run that failed half-way.
  [ -n "${KEEP:-}" ] && [ -e "$work/results" ] && cp "$work/results" "$KEEP"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  for n in $CL $HO $GU; do ip netns delete "$n" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || { echo "proxy.sh: needs root (creates network namespaces)"; exit 1; }
for t in iperf3 haproxy socat; do command -v $t >/dev/null || { echo "proxy.sh: $t missing (make deps)"; exit 1; }; done
export PATH=/usr/local/go/bin:$PATH

# --- binaries: brokkr's proxy runner, the load client, docker-proxy ---------
go build -o "$work/" ./tests/bench/proxyrun ./tests/bench/connrate
DPDIR=.cache/docker-proxy
DP=$DPDIR/usr/sbin/docker-proxy
if [ ! -x "$DP" ]; then
  # Debian's docker.io, downloaded and unpacked only: never installed, no service.
  # (A fresh machine may have no package lists yet: update once and retry.)
  (cd "$work" && { apt-get download docker.io 2>/dev/null || { apt-get update -qq && apt-get download docker.io; }; } \
    && dpkg -x docker.io_*.deb dx)
  mkdir -p "$DPDIR/usr/sbin"
  cp "$work/dx/usr/sbin/docker-proxy" "$DP"
  dpkg-deb -f "$work"/docker.io_*.deb Version >"$DPDIR/VERSION"
fi
DPVER=$(cat "$DPDIR/VERSION" 2>/dev/null || echo unknown)

# --- topology ----------------------------------------------------------------
for n in $CL $HO $GU; do ip netns delete "$n" 2>/dev/null || true; ip netns add "$n"; ip -n "$n" link set lo up; done
ip -n $CL link add c0 type veth peer name h0 netns $HO
ip -n $HO link add h1 type veth peer name g0 netns $GU
ip -n $CL addr add 10.77.1.2/24 dev c0; ip -n $CL link set c0 up
ip -n $HO addr add 10.77.1.1/24 dev h0; ip -n $HO link set h0 up
ip -n $HO addr add 10.77.2.1/24 dev h1; ip -n $HO link set h1 up
ip -n $GU addr add 10.77.2.2/24 dev g0; ip -n $GU link set g0 up
ip -n $CL route add default via 10.77.1.1
ip -n $GU route add default via 10.77.2.1
# Per-namespace sysctls, inside our own namespaces only.
ip netns exec $HO sysctl -qw net.ipv4.ip_forward=1
for n in $CL $HO; do
  ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000"
done
ulimit -n "$(ulimit -Hn)"

inns() { local n=$1; shift; nsenter --net=/run/netns/$n -- "$@"; }
# Background servers start as nsenter itself (it execs the command), never
# through a function: then $! is the server's own pid and cleanup kills it.

# --- guest services ------------------------------------------------------------
nsenter --net=/run/netns/$GU -- iperf3 -s -p 5201 >"$work/iperf3.log" 2>&1 &
pids+=($!)
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve 10.77.2.2:7000 >"$work/serve.log" 2>&1 &
pids+=($!)
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve-pp 10.77.2.2:7001 >"$work/servepp.log" 2>&1 &
pids+=($!)

# --- proxies in the host namespace ----------------------------------------------
# port pairs: iperf3 via 62xx, connection rate via 72xx
nsenter --net=/run/netns/$HO -- "$work/proxyrun" -e 10.77.1.1:6201=10.77.2.2:5201 -e 10.77.1.1:7201=10.77.2.2:7000 \
  -e ppv2:10.77.1.1:7301=10.77.2.2:7001 >"$work/brokkr.log" 2>&1 &
pids+=($!); BROKKR=$!
# docker-proxy reports readiness on fd 3 and then closes it: give it one, or
# it closes whatever socket landed on fd 3 (its own listener).
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 10.77.1.1 -host-port 6202 -container-ip 10.77.2.2 -container-port 5201 3>"$work/dp1.ready" >"$work/dp1.log" 2>&1 &
pids+=($!); DOCKER_IPERF=$!
nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip 10.77.1.1 -host-port 7202 -container-ip 10.77.2.2 -container-port 7000 3>"$work/dp2.ready" >"$work/dp2.log" 2>&1 &
pids+=($!); DOCKER=$!
cat >"$work/haproxy.cfg" <<EOF
global
  maxconn 4000
defaults
  mode tcp
  option splice-auto
  timeout connect 5s
  timeout client 1m
  timeout server 1m
frontend iperf
  bind 10.77.1.1:6203
  default_backend iperf
backend iperf
  server g 10.77.2.2:5201
frontend rate
  bind 10.77.1.1:7203
  default_backend rate
backend rate
  server g 10.77.2.2:7000
frontend ratepp
  bind 10.77.1.1:7303
  default_backend ratepp
backend ratepp
  server g 10.77.2.2:7001 send-proxy-v2
EOF
nsenter --net=/run/netns/$HO -- haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!); HAPROXY=$!
nsenter --net=/run/netns/$HO -- socat TCP-LISTEN:6204,bind=10.77.1.1,fork,reuseaddr TCP:10.77.2.2:5201 >/dev/null 2>&1 &
pids+=($!)
nsenter --net=/run/netns/$HO -- socat TCP-LISTEN:7204,bind=10.77.1.1,fork,reuseaddr TCP:10.77.2.2:7000 >/dev/null 2>&1 &
pids+=($!)

# A/B variants: port pairs 62NN/72NN/73NN from 10 on.
declare -A VPID=() VIPERF=() VRATE=() VRATEPP=()
vnames=() vi=10
for v in ${VARIANTS:-}; do
  name=${v%%=*} rest=${v#*=}
  envs=${rest%%:*} bin=${rest#*:}
  [ "$envs" = - ] && envs=
  [ -x "$bin" ] || { echo "proxy.sh: variant $name: $bin is not an executable" >&2; exit 1; }
  # shellcheck disable=SC2086 # ENV is a list of assignments
  env $envs nsenter --net=/run/netns/$HO -- "$bin" -e 10.77.1.1:62$vi=10.77.2.2:5201 \
    -e 10.77.1.1:72$vi=10.77.2.2:7000 -e ppv2:10.77.1.1:73$vi=10.77.2.2:7001 >"$work/variant-$name.log" 2>&1 &
  pids+=($!); VPID[$name]=$! VIPERF[$name]=10.77.1.1:62$vi VRATE[$name]=10.77.1.1:72$vi VRATEPP[$name]=10.77.1.1:73$vi
  vnames+=("$name"); vi=$((vi + 1))
done

# wait until every port listens (a probe connection would use up an iperf3 test)
for a in $GU/10.77.2.2:5201 $GU/10.77.2.2:7000 $GU/10.77.2.2:7001 $HO/10.77.1.1:7301 $HO/10.77.1.1:7303 $HO/10.77.1.1:6201 $HO/10.77.1.1:7201 $HO/10.77.1.1:6202 \
         $HO/10.77.1.1:7202 $HO/10.77.1.1:6203 $HO/10.77.1.1:7203 $HO/10.77.1.1:6204 $HO/10.77.1.1:7204 \
         $(for n in "${vnames[@]}"; do echo "$HO/${VIPERF[$n]} $HO/${VRATE[$n]} $HO/${VRATEPP[$n]}"; done); do
  for i in $(seq 100); do
    [ -n "$(ip netns exec "${a%%/*}" ss -Hltn "sport = :${a##*:}")" ] && break
    sleep 0.1
    [ "$i" = 100 ] && { echo "proxy.sh: ${a#*/} never listened"; cat "$work"/*.log; exit 1; }
  done
done

declare -A IPERF=( [direct]=10.77.2.2:5201 [brokkr]=10.77.1.1:6201 [docker-proxy]=10.77.1.1:6202 [haproxy]=10.77.1.1:6203 [socat]=10.77.1.1:6204 )
declare -A RATE=( [direct]=10.77.2.2:7000 [brokkr]=10.77.1.1:7201 [docker-proxy]=10.77.1.1:7202 [haproxy]=10.77.1.1:7203 [socat]=10.77.1.1:7204 )
declare -A RATEPP=( [brokkr]=10.77.1.1:7301 [haproxy]=10.77.1.1:7303 )
paths=(direct brokkr docker-proxy haproxy socat)
for n in "${vnames[@]}"; do IPERF[$n]=${VIPERF[$n]} RATE[$n]=${VRATE[$n]} RATEPP[$n]=${VRATEPP[$n]}; paths+=("$n"); done

# iperf3 receiver throughput in Gbit/s
tput() { # addr streams
  inns $CL iperf3 -c "${1%:*}" -p "${1#*:}" -P "$2" -t "$SECS" -f g 2>&1 \
    | awk '/receiver/ { for (i = 2; i <= NF; i++) if ($i == "Gbits/sec") v = $(i-1) } END { print v + 0 }'
}
# CPU seconds a process used (utime + stime), to divide by what it moved:
# CPU per byte is steadier than throughput on a shared machine.
cpus() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' /proc/$1/stat; }
declare -A PID=( [brokkr]=$BROKKR [docker-proxy]=$DOCKER_IPERF [haproxy]=$HAPROXY )
declare -A PID2=( [brokkr]=$BROKKR [docker-proxy]=$DOCKER [haproxy]=$HAPROXY )
for n in "${vnames[@]}"; do PID[$n]=${VPID[$n]} PID2[$n]=${VPID[$n]}; done
crate() { inns $CL "$work/connrate" -rate "$1" -c "${2:-8}" -d "${SECS}s" | awk '{ print $1 }'; }
median() { sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }

# Every measurement is one line "round path metric value" in $work/results.
# The path order rotates each round so no path always runs first or last.
for round in $(seq "$ROUNDS"); do
  order=("${paths[@]:$(( (round - 1) % ${#paths[@]} ))}" "${paths[@]:0:$(( (round - 1) % ${#paths[@]} ))}")
  for p in "${order[@]}"; do
    for st in 1 8; do
      c0=0; [ -n "${PID[$p]:-}" ] && c0=$(cpus "${PID[$p]}")
      g=$(tput "${IPERF[$p]}" $st)
      echo "$round $p p$st $g" >>"$work/results"
      if [ -n "${PID[$p]:-}" ]; then # CPU seconds per GB carried
        echo "$round $p cpu$st $(awk -v c0="$c0" -v c1="$(cpus "${PID[$p]}")" -v g="$g" -v s="$SECS" \
          'BEGIN { gb = g * s / 8; printf "%.3f", (gb > 0 ? (c1 - c0) / gb : 0) }')" >>"$work/results"
      fi
    done
    c0=0; [ -n "${PID2[$p]:-}" ] && c0=$(cpus "${PID2[$p]}")
    r=$(crate "${RATE[$p]}")
    echo "$round $p rate $r" >>"$work/results"
    if [ -n "${PID2[$p]:-}" ]; then # CPU microseconds per connection carried
      echo "$round $p cpuconn $(awk -v c0="$c0" -v c1="$(cpus "${PID2[$p]}")" -v r="$r" -v s="$SECS" \
        'BEGIN { n = r * s; printf "%.1f", (n > 0 ? (c1 - c0) * 1e6 / n : 0) }')" >>"$work/results"
    fi
    # One connector at a time: the machine is mostly idle, so this is the
    # latency a proxy adds to each short connection (µs = 1e6 / rate).
    r1=$(crate "${RATE[$p]}" 1)
    echo "$round $p lat $(awk -v r="$r1" 'BEGIN { printf "%.0f", (r > 0 ? 1e6 / r : 0) }')" >>"$work/results"
    if [ -n "${RATEPP[$p]:-}" ]; then # the same with a PROXY v2 header to the guest
      c0=$(cpus "${PID2[$p]}")
      r=$(crate "${RATEPP[$p]}")
      echo "$round $p ratepp $r" >>"$work/results"
      echo "$round $p cpuconnpp $(awk -v c0="$c0" -v c1="$(cpus "${PID2[$p]}")" -v r="$r" -v s="$SECS" \
        'BEGIN { n = r * s; printf "%.1f", (n > 0 ? (c1 - c0) * 1e6 / n : 0) }')" >>"$work/results"
    fi
  done
  for n in $CL $HO $GU; do
    [ -e /run/netns/$n ] || { echo "proxy.sh: namespace $n vanished mid-run (scripts/clean-ns.sh from another run?)" >&2; exit 1; }
  done
  echo "round $round done" >&2
done

# --- memory and descriptors per idle held connection --------------------------------
rss() { awk '/^VmRSS/ { print $2 }' /proc/$1/status; }
fds() { ls /proc/$1/fd | wc -l; }
holdrss() { # pid addr -> rss_before rss_after fds_before fds_after
  local before after fb fa
  before=$(rss "$1"); fb=$(fds "$1")
  coproc HOLDER { inns $CL "$work/connrate" -hold "$2" -n "$HOLD"; }
  if ! read -r line <&"${HOLDER[0]}"; then
    echo "proxy.sh: holding $HOLD connections through $2 failed" >&2
    exit 1
  fi
  sleep 1
  after=$(rss "$1"); fa=$(fds "$1")
  eval "exec ${HOLDER[1]}>&-"
  wait "$HOLDER_PID" 2>/dev/null || true
  echo "$before $after $fb $fa"
}
declare -A RSS
RSS[brokkr]=$(holdrss $BROKKR 10.77.1.1:7201)
RSS[docker-proxy]=$(holdrss $DOCKER 10.77.1.1:7202)
RSS[haproxy]=$(holdrss $HAPROXY 10.77.1.1:7203)

# --- splice proof: syscalls of brokkr's proxy during a 2 s single stream ----------
strace -f -qq -c -e trace=splice,read,write -p $BROKKR -o "$work/strace.txt" &
ST=$!
sleep 0.5
inns $CL iperf3 -c 10.77.1.1 -p 6201 -t 2 >/dev/null 2>&1 || true
kill -INT $ST; wait $ST 2>/dev/null || true

# --- report -------------------------------------------------------------------------
# Medians of the values, and medians of the per-round ratios (each ratio is
# taken between runs of the same round, minutes apart at most).
report() {
  awk -v paths="${paths[*]}" -v rounds="$ROUNDS" '
    function median(arr, n,   i, j, t) {
      for (i = 2; i <= n; i++) for (j = i; j > 1 && arr[j-1] > arr[j]; j--) { t = arr[j]; arr[j] = arr[j-1]; arr[j-1] = t }
      return n % 2 ? arr[(n + 1) / 2] : (arr[n / 2] + arr[n / 2 + 1]) / 2
    }
    function med(p, m,   r, a) { for (r = 1; r <= rounds; r++) a[r] = v[r, p, m]; return median(a, rounds) }
    function medratio(p, q, m,   r, a, n) {
      n = 0
      for (r = 1; r <= rounds; r++) if (v[r, q, m] > 0) a[++n] = v[r, p, m] / v[r, q, m]
      return n ? median(a, n) : 0
    }
    { v[$1, $2, $3] = $4 }
    END {
      np = split(paths, P, " ")
      print "| path | iperf3 -P1 Gbit/s | × direct | iperf3 -P8 Gbit/s | × direct | conns/s (8 connectors) | × direct | µs per connection (1 connector) | × direct |"
      print "|---|---|---|---|---|---|---|---|---|"
      for (i = 1; i <= np; i++) {
        p = P[i]
        printf "| %s | %.2f | %.2f | %.2f | %.2f | %.0f | %.2f | %.0f | %.2f |\n", p, med(p, "p1"), medratio(p, "direct", "p1"),
          med(p, "p8"), medratio(p, "direct", "p8"), med(p, "rate"), medratio(p, "direct", "rate"), med(p, "lat"), medratio(p, "direct", "lat")
      }
      printf "\nbrokkr / docker-proxy (median of per-round ratios): -P1 %.2f×, -P8 %.2f×, conns/s %.2f×, latency %.2f× (< 1 is faster)\n",
        medratio("brokkr", "docker-proxy", "p1"), medratio("brokkr", "docker-proxy", "p8"), medratio("brokkr", "docker-proxy", "rate"), medratio("brokkr", "docker-proxy", "lat")
      print "\nproxy CPU (its own utime+stime) per unit carried, medians; lower is better:"
      print "| proxy | CPU s per GB, -P1 | CPU s per GB, -P8 | CPU µs per connection |"
      print "|---|---|---|---|"
      for (i = 1; i <= np; i++) {
        p = P[i]
        if ((1, p, "cpu1") in v) printf "| %s | %.3f | %.3f | %.1f |\n", p, med(p, "cpu1"), med(p, "cpu8"), med(p, "cpuconn")
      }
      printf "brokkr / docker-proxy CPU (median of per-round ratios): per GB -P1 %.2f×, -P8 %.2f×; per connection %.2f×\n",
        medratio("brokkr", "docker-proxy", "cpu1"), medratio("brokkr", "docker-proxy", "cpu8"), medratio("brokkr", "docker-proxy", "cpuconn")
      print "\nagainst haproxy (median of per-round ratios; conns/s and -P1 higher is better, CPU lower):"
      print "| proxy | conns/s | × haproxy | CPU µs/conn | × haproxy | conns/s, PROXY v2 | × haproxy | CPU µs/conn, PROXY v2 | × haproxy | -P1 × haproxy |"
      print "|---|---|---|---|---|---|---|---|---|---|"
      for (i = 1; i <= np; i++) {
        p = P[i]
        if (!((1, p, "ratepp") in v)) continue
        printf "| %s | %.0f | %.2f | %.1f | %.2f | %.0f | %.2f | %.1f | %.2f | %.2f |\n", p, med(p, "rate"), medratio(p, "haproxy", "rate"),
          med(p, "cpuconn"), medratio(p, "haproxy", "cpuconn"), med(p, "ratepp"), medratio(p, "haproxy", "ratepp"),
          med(p, "cpuconnpp"), medratio(p, "haproxy", "cpuconnpp"), medratio(p, "haproxy", "p1")
      }
      print "\nevery round (-P1 Gbit/s | -P8 Gbit/s | conns/s | µs per connection | CPU µs/conn | conns/s, PROXY v2 | CPU µs/conn, PROXY v2):"
      for (i = 1; i <= np; i++) {
        p = P[i]; a = ""; b = ""; c = ""; d = ""; e = ""; f = ""; g = ""
        for (r = 1; r <= rounds; r++) { a = a " " v[r, p, "p1"]; b = b " " v[r, p, "p8"]; c = c " " v[r, p, "rate"]; d = d " " v[r, p, "lat"]
          e = e " " v[r, p, "cpuconn"]; f = f " " v[r, p, "ratepp"]; g = g " " v[r, p, "cpuconnpp"] }
        printf "  %-12s%s |%s |%s |%s |%s |%s |%s\n", p, a, b, c, d, e, f, g
      }
    }' "$work/results"
}
echo
echo "proxy benchmark $(date -u +%FT%TZ), $(nproc) CPUs, kernel $(uname -r), $ROUNDS rounds x ${SECS}s per measurement; docker-proxy from docker.io $DPVER"
echo
report
[ -n "${DEBUG:-}" ] && cat "$work/results"
echo
echo "| proxy | VmRSS idle kB | VmRSS, $HOLD idle connections held, kB | kB per held connection | fds per held connection |"
echo "|---|---|---|---|---|"
for p in brokkr docker-proxy haproxy; do
  read -r b a fb fa <<<"${RSS[$p]}"
  awk -v p="$p" -v a="$a" -v b="$b" -v fa="$fa" -v fb="$fb" -v n="$HOLD" \
    'BEGIN { printf "| %s | %d | %d | %.1f | %.1f |\n", p, b, a, (a - b) / n, (fa - fb) / n }'
done
echo
echo "splice proof: strace -f -c -e trace=splice,read,write -p <brokkr proxy> during a 2 s iperf3 -P1:"
cat "$work/strace.txt"
