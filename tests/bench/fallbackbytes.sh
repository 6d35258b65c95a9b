#!/usr/bin/env bash
# A/B of what the set-based cap's byte counting costs per packet (the nat
# path's fallback, Debian 12's 6.1): marked DNAT to one guest, with and
# without brokkr's byte chains (forward, input and output at priority 10,
# each two rules looking a packet's ct mark up in a set of per-element
# counters, as `nft list table inet brokkr` shows them under that cap). The
# chains' table is loaded or deleted between runs, alternating the order
# each round. iperf3 -P1 and -P8, short connections/s (8 connectors).
# Standalone as root; creates and deletes its own brk-fbb-* namespaces.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "fallbackbytes.sh: needs root" >&2; exit 1; }
export PATH=/usr/local/go/bin:$PATH
P=brk-fbb; CL=$P-cli HO=$P-host GU=$P-g1
ROUNDS=${ROUNDS:-6} DUR=${DUR:-4}
work=$(mktemp -d /tmp/brk-fbb.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $CL $HO $GU; do ip netns pids $n 2>/dev/null | xargs -r kill -9 2>/dev/null; ip netns delete $n 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
go build -o "$work/" ./tests/bench/connrate
for n in $CL $HO $GU; do ip netns delete $n 2>/dev/null || true; ip netns add $n; ip -n $n link set lo up; done
ip -n $CL link add eth0 type veth peer name vh-cli netns $HO
ip -n $CL addr add 10.99.0.2/24 dev eth0; ip -n $CL link set eth0 up; ip -n $CL route add default via 10.99.0.1
ip -n $HO addr add 10.99.0.1/24 dev vh-cli; ip -n $HO link set vh-cli up
ip -n $HO link add br0 type bridge; ip -n $HO addr add 10.213.0.1/24 dev br0; ip -n $HO link set br0 up
ip -n $HO link add g1p type veth peer name eth0 netns $GU; ip -n $HO link set g1p master br0 up
ip -n $GU addr add 10.213.0.11/24 dev eth0; ip -n $GU link set eth0 up; ip -n $GU route add default via 10.213.0.1
ip netns exec $HO sysctl -qw net.ipv4.ip_forward=1
for n in $CL $HO; do ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000"; done
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve 10.213.0.11:7000 >/dev/null 2>&1 & pids+=($!)
nsenter --net=/run/netns/$GU -- iperf3 -s -p 5201 >/dev/null 2>&1 & pids+=($!)
nsenter --net=/run/netns/$HO nft -f - <<NFT
table ip brk-fbb {
  chain pre { type nat hook prerouting priority -100; policy accept;
    tcp dport 31001 ct mark set 0x20000001 dnat to 10.213.0.11:5201
    tcp dport 31002 ct mark set 0x20000001 dnat to 10.213.0.11:7000
  }
}
NFT
cat >"$work/bytes.nft" <<'NFT'
table inet brk-fbb-bytes {
  set exp-bytes-orig { type mark; counter; elements = { 0x20000001 } }
  set exp-bytes-reply { type mark; counter; elements = { 0x20000001 } }
  chain bytes-forward { type filter hook forward priority 10; policy accept;
    ct direction original ct mark & 0x3fffffff @exp-bytes-orig
    ct direction reply ct mark & 0x3fffffff @exp-bytes-reply
  }
  chain bytes-input { type filter hook input priority 10; policy accept;
    ct direction original ct mark & 0x3fffffff @exp-bytes-orig
    ct direction reply ct mark & 0x3fffffff @exp-bytes-reply
  }
  chain bytes-output { type filter hook output priority 10; policy accept;
    ct direction original ct mark & 0x3fffffff @exp-bytes-orig
    ct direction reply ct mark & 0x3fffffff @exp-bytes-reply
  }
}
NFT
# Short connections leave TIME_WAIT entries; keep the table from filling.
ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1
gb() { sleep 0.5; nsenter --net=/run/netns/$CL iperf3 -c 10.99.0.1 -p 31001 -t "$DUR" -P "$1" -f g 2>/dev/null | awk '/receiver/ {v=$(NF-2)} END {print v}'; }
cr() { nsenter --net=/run/netns/$CL "$work/connrate" -rate "10.99.0.1:31002" -c 8 -d "${DUR}s" | awk '{print $1}'; }
counted() { nsenter --net=/run/netns/$HO nft list set inet brk-fbb-bytes exp-bytes-orig | grep -o 'bytes [0-9][0-9]*' | head -1; }
echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds, ${DUR}s runs"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="plain bytes"; else order="bytes plain"; fi
  for v in $order; do
    nsenter --net=/run/netns/$HO nft delete table inet brk-fbb-bytes 2>/dev/null || true
    [ $v = bytes ] && nsenter --net=/run/netns/$HO nft -f "$work/bytes.nft"
    line="round=$r $v P1=$(gb 1) P8=$(gb 8) conns=$(cr)"
    [ $v = bytes ] && line="$line counted=$(counted | cut -d' ' -f2)"
    echo "$line"
  done
done | tee "$work/ab.txt"
awk '{ split($3, a, "="); split($4, b, "="); split($5, c, "="); k = $1; v[k, $2, "P1"] = a[2]; v[k, $2, "P8"] = b[2]; v[k, $2, "conns"] = c[2]; r[k] = 1 }
  function med(x, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t } return n % 2 ? x[(n + 1) / 2] : (x[n / 2] + x[n / 2 + 1]) / 2 }
  END { split("P1 P8 conns", ms, " "); for (m = 1; m <= 3; m++) { n = 0; delete q; for (k in r) if (v[k, "plain", ms[m]] > 0) q[++n] = v[k, "bytes", ms[m]] / v[k, "plain", ms[m]]
    printf "bytes / plain %s: median of per-round ratios %.2f over %d rounds\n", ms[m], med(q, n), n } }' "$work/ab.txt"
