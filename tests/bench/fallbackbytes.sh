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
P=brk-fbb
. tests/bench/abtopo.sh
ab_setup
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
counted() { nsenter --net=/run/netns/$HO nft list set inet brk-fbb-bytes exp-bytes-orig | grep -o 'bytes [0-9][0-9]*' | head -1; }
echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $ROUNDS rounds, ${DUR}s runs"
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="plain bytes"; else order="bytes plain"; fi
  for v in $order; do
    nsenter --net=/run/netns/$HO nft delete table inet brk-fbb-bytes 2>/dev/null || true
    [ $v = bytes ] && nsenter --net=/run/netns/$HO nft -f "$work/bytes.nft"
    line="round=$r $v P1=$(gb 31001 1) P8=$(gb 31001 8) conns=$(cr 31002)"
    [ $v = bytes ] && line="$line counted=$(counted | cut -d' ' -f2)"
    echo "$line"
  done
done | tee "$work/ab.txt"
ab_summary "$work/ab.txt" plain bytes
