#!/usr/bin/env bash
# A/B of the nat path's per-packet work: one DNAT rule to the same guest,
# with and without brokkr's mark (the mark is what makes the nat-path
# programs admit, count and release), the programs loaded, alternating the
# order each round. iperf3 -P1 and -P8, short connections/s (8 connectors).
# Standalone as root; creates and deletes its own brk-nab-* namespaces.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "natab.sh: needs root" >&2; exit 1; }
export PATH=/usr/local/go/bin:$PATH
P=brk-nab
. tests/bench/abtopo.sh
ab_setup ./tests/bench/natcost
mkdir -p "$work/bpf"; mount -t bpf bpf "$work/bpf"
mark=$("$work/natcost" load -pins "$work/bpf" -ns /run/netns/$HO)
nsenter --net=/run/netns/$HO nft -f - <<NFT
table ip brk-nab {
  chain pre { type nat hook prerouting priority -100; policy accept;
    tcp dport 30001 dnat to 10.213.0.11:5201
    tcp dport 30002 dnat to 10.213.0.11:7000
    tcp dport 31001 ct mark set $mark dnat to 10.213.0.11:5201
    tcp dport 31002 ct mark set $mark dnat to 10.213.0.11:7000
  }
}
NFT
echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds, ${DUR}s runs"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="plain marked"; else order="marked plain"; fi
  for v in $order; do
    if [ $v = plain ]; then ip=30001 cp=30002; else ip=31001 cp=31002; fi
    echo "round=$r $v P1=$(gb $ip 1) P8=$(gb $ip 8) conns=$(cr $cp)"
  done
done | tee "$work/ab.txt"
ab_summary "$work/ab.txt" plain marked
