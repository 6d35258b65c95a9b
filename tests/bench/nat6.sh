#!/usr/bin/env bash
# The nat path for IPv6 (issue 26, item 6), and the IPv4 nat path against
# the binary before it. In one run, in interleaved rounds, the same caller
# (a client namespace) reaches the same guest server (a namespace on the
# host's bridge at fd00:6272:6b72::c8, an address brokkr does not run, as
# with target6:) through:
#   direct6      routed to the guest's IPv6 address, no NAT
#   plain6       one hand-written `dnat ip6 to` rule
#   nat6         brokkr's table for one exposure of both families (netplane/
#                nft's own compiler and Converge: exp-any6, dispatch6,
#                publish6's `dnat ip6 to ct mark map @exp-target6`) with the
#                nat-path programs loaded by tests/bench/natcost, cap $CAP
#   docker6      docker-proxy on [::]:port to the guest's IPv6 address
#   plain4, nat4 the same for IPv4 (the exposure's other family)
#   plain4-old, nat4-old  IPv4 again with the nat-path programs of the old
#                binary (natcost built from OLD_REV: by default the first
#                parent of main's "merge h-nat6", the tree before the IPv6
#                nat path; OLD_REV=none skips them)
# The programs of one binary are loaded at a time (the old and the new
# would both run on every packet): each round loads the new ones, measures
# their paths, removes them, then the same for the old ones; the order of
# the two phases alternates and the paths within a phase rotate. The nft
# table is the same in both phases (the old tree's compiler emits the same
# IPv4 rules), so plain4/plain4-old and nat4/nat4-old differ only in the
# programs.
# Measured per path: iperf3 -P1 (single stream, DUR s), short connections/s
# (connect + 1 byte each way + close, 8 connectors, SECS s) and p50/p99 of the
# same with 1 connector; for nat6 and nat4, the slot's admitted count over
# the 8-connector run against the connections made (the programs counted
# every one). Ratios are medians of per-round ratios; spread is min..max.
# Then COSTROUNDS rounds of the programs' own cost per run (tests/bench/
# bpfcost, only the programs our pinned links run) under nat6, nat4 and
# nat4-old load: the per-packet price, without the machine's noise.
#
# PATHS="plain6 nat6" measures only those paths (a longer A/B of two).
#
# Run as root: tests/bench/nat6.sh  (env: ROUNDS=7 SECS=4 DUR=4 CAP=100000 COSTROUNDS=3 PATHS=""
# OLD_REV=<rev>|none; BENCH_OUT=dir for the CSV). Creates and deletes its own
# brk-n6-* namespaces and its own bpffs mount (trap); touches nothing else.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "nat6.sh: needs root" >&2; exit 1; }
export PATH=/usr/local/go/bin:$PATH
command -v iperf3 >/dev/null || { echo "nat6.sh: iperf3 missing (make deps)" >&2; exit 1; }
P=brk-n6
CL=$P-cli HO=$P-host GU=$P-g1
ROUNDS=${ROUNDS:-7} SECS=${SECS:-4} DUR=${DUR:-4} CAP=${CAP:-100000} COSTROUNDS=${COSTROUNDS:-3}
OUT=${BENCH_OUT:-tests/bench/out/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/brk-n6.XXXXXX)
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

# --- binaries: this tree's, and natcost of the tree before the IPv6 nat path --
go build -o "$work/" ./tests/bench/connrate ./tests/bench/natcost ./tests/bench/natscale ./tests/bench/bpfcost
if [ -z "${OLD_REV:-}" ]; then
  m=$(git log --merges --format=%H --grep='^merge h-nat6' -1 2>/dev/null || true)
  OLD_REV=none
  [ -n "$m" ] && OLD_REV=$(git rev-parse "$m^1")
fi
if [ "$OLD_REV" != none ]; then
  mkdir "$work/oldsrc"
  git archive "$OLD_REV" | tar -x -C "$work/oldsrc"
  (cd "$work/oldsrc" && go build -o "$work/old-natcost" ./tests/bench/natcost)
  OLD_DESC=$(git log -1 --format='%h %s' "$OLD_REV" | cut -c1-100)
fi
DPDIR=.cache/docker-proxy
DP=$DPDIR/usr/sbin/docker-proxy
if [ ! -x "$DP" ]; then
  # As proxy.sh: Debian's docker.io downloaded and unpacked, never installed.
  (cd "$work" && { apt-get download docker.io 2>/dev/null || { apt-get update -qq && apt-get download docker.io; }; } \
    && dpkg -x docker.io_*.deb dx && mkdir -p "$OLDPWD/$DPDIR/usr/sbin" && cp dx/usr/sbin/docker-proxy "$OLDPWD/$DP" \
    && dpkg-deb -f docker.io_*.deb Version >"$OLDPWD/$DPDIR/VERSION") || echo "nat6.sh: docker-proxy not available: docker6 is not measured" >&2
fi
DPVER=$(cat "$DPDIR/VERSION" 2>/dev/null || echo unknown)

# --- topology (tests/bench/topo6.sh) -----------------------------------------------
. tests/bench/topo6.sh
topo6 $CL $HO $GU
ulimit -n "$(ulimit -Hn)"

# --- guest services (both families on one socket) -----------------------------------
nsenter --net=/run/netns/$GU -- iperf3 -s -p 5201 >"$work/iperf3.log" 2>&1 & pids+=($!)
nsenter --net=/run/netns/$GU -- "$work/connrate" -serve "[::]:7000" >"$work/serve.log" 2>&1 & pids+=($!)

# --- nft: brokkr's table for the exposures, and the plain rules beside it -----------
# Exposure e0 20001 -> 5201 (iperf3), e1 20002 -> 7000 (connrate), every
# host address, both families; mark ids 1 and 2 = the programs' slots 0 and 1.
"$work/natscale" apply -ns /run/netns/$HO -guest 10.213.0.11 -guest6 fd00:6272:6b72::c8 \
  -map 20001:5201,20002:7000 -cap "$CAP" -marksonly
inns $HO nft -f - <<'NFT'
table inet plain {
  chain pre { type nat hook prerouting priority -110; policy accept;
    ip daddr 10.99.0.1 tcp dport 30001 dnat ip to 10.213.0.11:5201
    ip daddr 10.99.0.1 tcp dport 30002 dnat ip to 10.213.0.11:7000
    ip6 daddr fd00:99::1 tcp dport 30001 dnat ip6 to [fd00:6272:6b72::c8]:5201
    ip6 daddr fd00:99::1 tcp dport 30002 dnat ip6 to [fd00:6272:6b72::c8]:7000
  }
}
NFT
# Short connections leave TIME_WAIT entries: keep the host's table from filling.
ip netns exec $HO sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=1
echo "# brokkr's IPv6 part for the exposures (nft list, host namespace):"
inns $HO nft list table inet brokkr | grep -E 'dnat ip6|exp-any6|exp-target6|: 0x2|fd00:6272' | sed 's/^[[:space:]]*/  /' || true

# --- docker-proxy on [::] -----------------------------------------------------------
# It reports readiness on fd 3 and then closes it: give it one.
if [ -x "$DP" ]; then
  nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip :: -host-port 40001 -container-ip fd00:6272:6b72::c8 -container-port 5201 \
    3>"$work/dp1.ready" >"$work/dp1.log" 2>&1 & pids+=($!)
  nsenter --net=/run/netns/$HO -- "$DP" -proto tcp -host-ip :: -host-port 40002 -container-ip fd00:6272:6b72::c8 -container-port 7000 \
    3>"$work/dp2.ready" >"$work/dp2.log" 2>&1 & pids+=($!)
fi
listening() { [ -n "$(ip netns exec "$1" ss -Hltn "sport = :$2")" ]; }
ports="$GU:5201 $GU:7000"; V6PATHS="direct6 plain6 nat6"
if [ -x "$DP" ]; then ports="$ports $HO:40001 $HO:40002"; V6PATHS="direct6 plain6 nat6 docker6"; fi
for a in $ports; do
  for i in $(seq 100); do listening "${a%:*}" "${a#*:}" && break; sleep 0.1; done
  listening "${a%:*}" "${a#*:}" || { echo "nat6.sh: ${a#*:} never listened in ${a%:*}" >&2; cat "$work"/*.log >&2; exit 1; }
done

# --- the nat-path programs, one binary's at a time --------------------------------------
mkdir -p "$work/bpf"; mount -t bpf bpf "$work/bpf"; mkdir "$work/bpf/new" "$work/bpf/old"
declare -A BIN=( [new]="$work/natcost" [old]="$work/old-natcost" )
declare -A EXTRA=( [new]="-guests6 fd00:6272:6b72::/64" [old]="" )
load() { # new|old: both slots, each checked against the table's mark
  local s m want
  for s in 0 1; do
    # shellcheck disable=SC2086 # EXTRA is a list of flags
    m=$("${BIN[$1]}" load -pins "$work/bpf/$1" -ns /run/netns/$HO -bridge br0 -guests 10.213.0.0/24 ${EXTRA[$1]} -slot e$s -cap "$CAP")
    want=$(printf '0x%x' $((0x20000001 + s)))
    [ "$m" = "$want" ] || { echo "nat6.sh: $1 programs gave slot e$s the mark $m, the table has $want" >&2; exit 1; }
  done
}
unload() { "${BIN[$1]}" remove -pins "$work/bpf/$1" -ns /run/netns/$HO -bridge br0; }
admitted() { "$work/natcost" stats -pins "$work/bpf/new" -slot e1 | sed -E 's/accepted=([0-9]+).*/\1/'; }

# --- the paths ----------------------------------------------------------------------
# iperf3: "address port family"; connrate: address:port
declare -A IPERF=( [direct6]="fd00:6272:6b72::c8 5201 -6" [plain6]="fd00:99::1 30001 -6" [nat6]="fd00:99::1 20001 -6"
  [docker6]="fd00:99::1 40001 -6" [plain4]="10.99.0.1 30001 -4" [nat4]="10.99.0.1 20001 -4"
  [plain4-old]="10.99.0.1 30001 -4" [nat4-old]="10.99.0.1 20001 -4" )
declare -A RATE=( [direct6]="[fd00:6272:6b72::c8]:7000" [plain6]="[fd00:99::1]:30002" [nat6]="[fd00:99::1]:20002"
  [docker6]="[fd00:99::1]:40002" [plain4]="10.99.0.1:30002" [nat4]="10.99.0.1:20002"
  [plain4-old]="10.99.0.1:30002" [nat4-old]="10.99.0.1:20002" )
gbps() { # address port family
  local out try
  for try in 1 2 3; do
    sleep 0.5
    if out=$(inns $CL iperf3 -c "$1" -p "$2" "$3" -t "$DUR" -f g 2>/dev/null); then
      echo "$out" | awk '/receiver/ {v=$(NF-2)} END {print v}'; return
    fi
  done
  echo nan
}
rec() { echo "$1 $2 $3 $4" >>"$work/results.txt"; }
rotate() { local r=$1; shift; local a=("$@") n=$#; for ((i = 0; i < n; i++)); do echo "${a[$(((i + r) % n))]}"; done; }
measure() { # round path
  local r=$1 p=$2 g rate lat a0 a1 ok
  # shellcheck disable=SC2086 # IPERF holds three words
  g=$(gbps ${IPERF[$p]})
  case $p in nat6 | nat4) a0=$(admitted) ;; esac
  rate=$(inns $CL "$work/connrate" -rate "${RATE[$p]}" -c 8 -d "${SECS}s")
  ok=$(echo "$rate" | sed -E 's/.*\(([0-9]+) ok.*/\1/')
  local adm=""
  case $p in nat6 | nat4)
    a1=$(admitted)
    adm=" | admitted by the programs: $((a1 - a0)) of $ok"
    rec "$r" "$p" admitted "$(awk -v a=$((a1 - a0)) -v n="$ok" 'BEGIN { printf "%.3f", (n > 0 ? a / n : 0) }')" ;;
  esac
  lat=$(inns $CL "$work/connrate" -rate "${RATE[$p]}" -c 1 -d "${SECS}s")
  rec "$r" "$p" p1 "$g"; rec "$r" "$p" rate "$(echo "$rate" | awk '{print $1}')"
  rec "$r" "$p" p50 "$(echo "$lat" | sed -E 's/.*p50=([0-9]+)us.*/\1/')"
  rec "$r" "$p" p99 "$(echo "$lat" | sed -E 's/.*p99=([0-9]+)us.*/\1/')"
  echo "round=$r path=$p iperf3 -P1 ${g} Gbit/s | 8 connectors: $rate$adm | 1 connector: $lat"
}

echo "# $(date -u +%FT%TZ) kernel $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); rounds=$ROUNDS, ${SECS}s rate runs, ${DUR}s iperf3, cap $CAP"
echo "# new: this tree ($(git log -1 --format=%h HEAD)$(git diff --quiet HEAD -- bpf tests/bench netplane || echo ', with uncommitted changes')); old: ${OLD_DESC:-none (OLD_REV=none)}; docker-proxy: $( [ -x "$DP" ] && echo "docker.io $DPVER" || echo "not available")"
for r in $(seq "$ROUNDS"); do
  # The IPv4 pairs of the two phases are measured next to each other: odd
  # rounds new (IPv6 paths, then IPv4) then old, even rounds old then new
  # (IPv4, then IPv6 paths); each list rotates.
  pair4=$(rotate "$r" plain4 nat4 | paste -sd,); pair4old=$(rotate "$r" plain4-old nat4-old | paste -sd,)
  if [ $((r % 2)) = 1 ]; then
    seq_="new:$(rotate "$r" $V6PATHS | paste -sd,),$pair4 old:$pair4old"
  else
    seq_="old:$pair4old new:$pair4,$(rotate "$r" $V6PATHS | paste -sd,)"
  fi
  for step in $seq_; do
    ph=${step%%:*}
    [ $ph = old ] && [ "$OLD_REV" = none ] && continue
    IFS=, read -r -a all <<<"${step#*:}"
    steps=()
    for p in "${all[@]}"; do [ -z "${PATHS:-}" ] || [[ " $PATHS " == *" $p "* ]] && steps+=("$p"); done
    [ ${#steps[@]} = 0 ] && continue
    load $ph
    sleep 1
    for p in "${steps[@]}"; do measure "$r" "$p"; done
    unload $ph
    sleep 1 # the last run's TIME_WAIT entries expire before the next programs load
  done
  for n in $CL $HO $GU; do
    [ -e /run/netns/$n ] || { echo "nat6.sh: namespace $n vanished mid-run (scripts/clean-ns.sh from another run?)" >&2; exit 1; }
  done
done
cp "$work/results.txt" "$OUT/nat6.txt"

# What the programs cost per run under each capped path's 8-connector load:
# the kernel's run-time statistics (on only while bpfcost runs) of the
# programs our pinned links run, not of any other brk_* program on the
# machine. The figures include the statistics' own clock reads.
progids() { for f in "$work/bpf/$1"/*link*; do bpftool -j link show pinned "$f" | sed -E 's/.*"prog_id":([0-9]+).*/\1/'; done | sort -u | paste -sd,; }
echo
echo "# program cost per run (bpfcost), $COSTROUNDS rounds, under the 8-connector load of:"
for c in $(seq "$COSTROUNDS"); do
  for pp in new:nat6 new:nat4 old:nat4-old; do
    ph=${pp%%:*} p=${pp#*:}
    [ $ph = old ] && [ "$OLD_REV" = none ] && continue
    load $ph; sleep 1
    ids=$(progids $ph)
    "$work/bpfcost" -ids "$ids" -d "$((SECS + 1))s" >"$work/bpfcost.txt" & bp=$!
    sleep 0.5
    load_=$(inns $CL "$work/connrate" -rate "${RATE[$p]}" -c 8 -d "${SECS}s")
    wait $bp
    unload $ph; sleep 1
    echo "cost=$c path=$p ($(echo "$load_" | awk '{print $1, $2}')): $(grep -E 'brk_nat_(pre|out)' "$work/bpfcost.txt" | sed -E 's/^bpf //; s/ per run//' | paste -sd';')"
    sed -nE "s/^bpf (brk_nat_pre|brk_nat_out): ([0-9]+) runs, ([0-9]+) ns/$c $p \1 \3/p" "$work/bpfcost.txt" >>"$work/cost.txt"
  done
done
if [ -s "$work/cost.txt" ]; then
  cp "$work/cost.txt" "$OUT/nat6-cost.txt"
  echo "program cost, ns per run, median [min..max] over $COSTROUNDS rounds:"
  awk '{ k = $2 " " $3; n[k]++; v[k, n[k]] = $4 }
    END { for (k in n) { m = n[k]; for (i = 1; i <= m; i++) a[i] = v[k, i]
      for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
      printf "  %-24s %s [%s..%s]\n", k, (m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2), a[1], a[m] } }' "$work/cost.txt" | sort
fi

# --- summary ------------------------------------------------------------------------
echo
echo "# summary: medians over $ROUNDS rounds [min..max]; ratios are medians of per-round ratios [min..max]"
awk -v csv="$OUT/nat6.csv" '
  { v[$1, $2, $3] = $4; paths[$2] = 1; rounds[$1] = 1 }
  function median(a, n,   i, j, t) { for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    lo = a[1]; hi = a[n]; return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
  function med(p, m,   r, a, n, x) { n = 0; for (r in rounds) if ((r, p, m) in v && v[r, p, m] != "nan") a[++n] = v[r, p, m]
    if (!n) return "nan"; x = median(a, n); return sprintf(m == "p1" || m == "admitted" ? "%.2f [%.2f..%.2f]" : "%.0f [%.0f..%.0f]", x, lo, hi) }
  function ratio(p, b, m,   r, a, n, x) { n = 0; for (r in rounds) if ((r, p, m) in v && (r, b, m) in v && v[r, b, m] > 0 && v[r, p, m] != "nan") a[++n] = v[r, p, m] / v[r, b, m]
    if (!n) { rv = "nan"; return "nan" } x = median(a, n); rv = x; return sprintf("%.2f [%.2f..%.2f]", x, lo, hi) }
  # the new/old ratio with the plain4 of each phase taken out, per round
  function ratio2(m,   r, a, n, x) { n = 0; for (r in rounds) if (v[r, "plain4", m] > 0 && v[r, "nat4-old", m] > 0 && v[r, "plain4-old", m] > 0) a[++n] = (v[r, "nat4", m] / v[r, "plain4", m]) / (v[r, "nat4-old", m] / v[r, "plain4-old", m])
    if (!n) return "nan"; x = median(a, n); return sprintf("%.2f [%.2f..%.2f]", x, lo, hi) }
  function target(what, p, b, m, op, lim,   s, ok) { s = ratio(p, b, m); ok = (rv == "nan") ? "not measured" : ((op == ">=" ? rv >= lim : rv <= lim) ? "met" : "MISSED")
    printf "  %-38s %-20s target %s %.2f: %s\n", what, s, op, lim, ok }
  END {
    printf "%-11s %-22s %-22s %-20s %-20s %s\n", "path", "iperf3 -P1 Gbit/s", "conns/s (8)", "p50 us (1)", "p99 us (1)", "admitted/conns"
    split("direct6 plain6 nat6 docker6 plain4 nat4 plain4-old nat4-old", order, " ")
    for (i = 1; i <= 8; i++) { p = order[i]; if (!(p in paths)) continue
      printf "%-11s %-22s %-22s %-20s %-20s %s\n", p, med(p, "p1"), med(p, "rate"), med(p, "p50"), med(p, "p99"), (p == "nat6" || p == "nat4") ? med(p, "admitted") : "" }
    print ""
    print "ratios against plain6 (IPv6) and plain4 of the same phase (IPv4):"
    split("direct6 nat6 docker6", v6, " ")
    for (i = 1; i <= 3; i++) { p = v6[i]; if (!(p in paths)) continue
      printf "  %-9s / plain6: -P1 %s  conns %s  p50 %s  p99 %s\n", p, ratio(p, "plain6", "p1"), ratio(p, "plain6", "rate"), ratio(p, "plain6", "p50"), ratio(p, "plain6", "p99") }
    printf "  %-9s / plain4: -P1 %s  conns %s  p50 %s  p99 %s\n", "nat4", ratio("nat4", "plain4", "p1"), ratio("nat4", "plain4", "rate"), ratio("nat4", "plain4", "p50"), ratio("nat4", "plain4", "p99")
    if ("nat4-old" in paths) {
      printf "  %-9s / plain4-old: -P1 %s  conns %s  p50 %s  p99 %s\n", "nat4-old", ratio("nat4-old", "plain4-old", "p1"), ratio("nat4-old", "plain4-old", "rate"), ratio("nat4-old", "plain4-old", "p50"), ratio("nat4-old", "plain4-old", "p99")
      printf "  nat4 / nat4-old (new programs / old):  -P1 %s  conns %s  p50 %s  p99 %s\n", ratio("nat4", "nat4-old", "p1"), ratio("nat4", "nat4-old", "rate"), ratio("nat4", "nat4-old", "p50"), ratio("nat4", "nat4-old", "p99")
      printf "  (nat4/plain4) / (nat4-old/plain4-old):  -P1 %s  conns %s  p50 %s  p99 %s\n", ratio2("p1"), ratio2("rate"), ratio2("p50"), ratio2("p99")
      printf "  plain4 / plain4-old (the phases):     -P1 %s  conns %s  p50 %s  p99 %s\n", ratio("plain4", "plain4-old", "p1"), ratio("plain4", "plain4-old", "rate"), ratio("plain4", "plain4-old", "p50"), ratio("plain4", "plain4-old", "p99")
    }
    print ""
    print "targets (issue 26, item 6):"
    target("nat6 / plain6 conns/s", "nat6", "plain6", "rate", ">=", 0.95)
    target("nat6 / plain6 iperf3 -P1", "nat6", "plain6", "p1", ">=", 0.95)
    target("nat6 / plain6 p99", "nat6", "plain6", "p99", "<=", 1.2)
    target("nat4 / nat4-old conns/s", "nat4", "nat4-old", "rate", ">=", 0.95)
    target("nat4 / nat4-old iperf3 -P1", "nat4", "nat4-old", "p1", ">=", 0.95)
    target("nat4 / nat4-old p99 (1/0.95)", "nat4", "nat4-old", "p99", "<=", 1 / 0.95)
    print "round,path,metric,value" > csv
    for (k in v) { split(k, f, SUBSEP); print f[1] "," f[2] "," f[3] "," v[k] > csv }
  }' "$work/results.txt"
echo "per-round figures: $OUT/nat6.txt, $OUT/nat6.csv"
