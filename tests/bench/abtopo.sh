# abtopo.sh, sourced by the A/B benchmarks of one DNAT to one guest
# (natab.sh, fallbackbytes.sh): a client, a host with a bridge and one
# guest, each a namespace $P-cli, $P-host, $P-g1 (P set by the script, a
# brk-* name), deleted on exit. The guest serves iperf3 on 5201 and
# connrate on 7000. Needs root and $work/connrate (built by ab_setup).
set -euo pipefail
CL=$P-cli HO=$P-host GU=$P-g1
ROUNDS=${ROUNDS:-6} DUR=${DUR:-4}
work=$(mktemp -d "/tmp/$P.XXXXXX")
pids=()
ab_cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $CL $HO $GU; do ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns delete $n 2>/dev/null || true; done
  umount "$work/bpf" 2>/dev/null || true
  rm -rf "$work"
}
trap ab_cleanup EXIT INT TERM

# ab_setup builds connrate (and any other package named) into $work and
# makes the namespaces.
ab_setup() {
  go build -o "$work/" ./tests/bench/connrate "$@"
  for n in $CL $HO $GU; do ip netns delete $n 2>/dev/null || true; ip netns add $n; ip -n $n link set lo up; done
  ip -n $CL link add eth0 type veth peer name vh-cli netns $HO
  ip -n $CL addr add 10.99.0.2/24 dev eth0; ip -n $CL link set eth0 up; ip -n $CL route add default via 10.99.0.1
  ip -n $HO addr add 10.99.0.1/24 dev vh-cli; ip -n $HO link set vh-cli up
  ip -n $HO link add br0 type bridge; ip -n $HO addr add 10.213.0.1/24 dev br0; ip -n $HO link set br0 up
  ip -n $HO link add g1p type veth peer name eth0 netns $GU; ip -n $HO link set g1p master br0 up
  ip -n $GU addr add 10.213.0.11/24 dev eth0; ip -n $GU link set eth0 up; ip -n $GU route add default via 10.213.0.1
  ip netns exec $HO sysctl -qw net.ipv4.ip_forward=1
  for n in $CL $HO; do ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000"; done
  # Short connections leave TIME_WAIT entries; keep the table from filling.
  ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1 2>/dev/null || true
  nsenter --net=/run/netns/$GU -- "$work/connrate" -serve 10.213.0.11:7000 >/dev/null 2>&1 & pids+=($!)
  nsenter --net=/run/netns/$GU -- iperf3 -s -p 5201 >/dev/null 2>&1 & pids+=($!)
}

# gb PORT STREAMS: iperf3 Gbit/s through the host's PORT; cr PORT: short
# connections/s (8 connectors).
gb() { sleep 0.5; nsenter --net=/run/netns/$CL iperf3 -c 10.99.0.1 -p "$1" -t "$DUR" -P "$2" -f g 2>/dev/null | awk '/receiver/ {v=$(NF-2)} END {print v}'; }
cr() { nsenter --net=/run/netns/$CL "$work/connrate" -rate "10.99.0.1:$1" -c 8 -d "${DUR}s" | awk '{print $1}'; }

# ab_summary FILE A B: from lines "round=N VARIANT P1=x P8=y conns=z ...",
# the median over rounds of B / A for each measure.
ab_summary() {
  awk -v A="$2" -v B="$3" '{ split($3, a, "="); split($4, b, "="); split($5, c, "="); k = $1; v[k, $2, "P1"] = a[2]; v[k, $2, "P8"] = b[2]; v[k, $2, "conns"] = c[2]; r[k] = 1 }
    function med(x, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t } return n % 2 ? x[(n + 1) / 2] : (x[n / 2] + x[n / 2 + 1]) / 2 }
    END { split("P1 P8 conns", ms, " "); for (m = 1; m <= 3; m++) { n = 0; delete q; for (k in r) if (v[k, A, ms[m]] > 0) q[++n] = v[k, B, ms[m]] / v[k, A, ms[m]]
      printf "%s / %s %s: median of per-round ratios %.2f over %d rounds\n", B, A, ms[m], med(q, n), n } }' "$1"
}
