#!/bin/sh
# make bench-kernels, inside the kernel-matrix VM (tests/kernels/run.sh with
# BENCH=1; also runs on a host, in namespaces of its own): short connections
# per second from a client namespace to a guest namespace on brokkr's bridge
# through three paths, interleaved round by round (the order rotates):
#   nat     brokkrd's capped nat exposure (on 6.1: the tc programs; 5.10: the fallback)
#   plain   one plain nft DNAT rule to the same guest port
#   direct  the guest's address, routed through the host namespace
# and brokkrd's CPU time over its nat rounds per connection served. One line
# a measurement:
#   BENCH kernel=K round=R path=P conns_s=N ok=N failed=N p99_us=N cpu_us_per_conn=X busy_us_per_conn=Y
# (cpu: brokkrd's; busy: the whole machine's, /proc/stat less idle and iowait;
# under TCG both are emulated time, their ratio is what says something), and
# per round an idle line (path=idle: no callers for DUR) with brokkrd's CPU
# then (cpu_us), which the nat line's cpu_us less is what callers cost it.
# POSIX sh (the VM has busybox). BIN holds brokkrd, brokkr and connrate.
set -eu
# In the VM, make bench-kernels' ROUNDS and DUR come in this file.
[ -f /etc/brk-bench.env ] && . /etc/brk-bench.env
BIN=${BIN:-/tests/bin}
ROUNDS=${ROUNDS:-7}
DUR=${DUR:-6}
CONNS=${CONNS:-8}
# The real tools, not busybox's applets of the same names (its ash runs
# those before looking in PATH, and its ip has no netns).
tool() {
  for d in /usr/sbin /usr/bin /sbin /bin; do
    if [ -x "$d/$1" ] && [ "$(readlink -f "$d/$1")" != /bin/busybox ]; then echo "$d/$1"; return; fi
  done
  echo "BENCH-ERROR $1 is not installed" >&2; exit 1
}
IP=$(tool ip) NFT=$(tool nft) NSENTER=$(tool nsenter) SYSCTL=$(tool sysctl)
P=brk-kb
CL=$P-cli HO=$P-host GU=$P-g
work=$(mktemp -d /tmp/brk-kb.XXXXXX)
daemon=""
guest=""
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null || true
  [ -n "$guest" ] && kill "$guest" 2>/dev/null || true
  for n in $CL $HO $GU; do
    for pid in $("$IP" netns pids $n 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    "$IP" netns delete $n 2>/dev/null || true
  done
  rm -rf "$work" "/sys/fs/bpf/$P"
}
trap cleanup EXIT INT TERM
in_ns() { n=$1; shift; "$NSENTER" --net=/run/netns/$n -- "$@"; }

for n in $CL $HO $GU; do "$IP" netns delete $n 2>/dev/null || true; "$IP" netns add $n; "$IP" -n $n link set lo up; done
"$IP" -n $CL link add eth0 type veth peer name vh-cli netns $HO
"$IP" -n $CL addr add 192.0.2.2/24 dev eth0
"$IP" -n $CL link set eth0 up
"$IP" -n $CL route add default via 192.0.2.1
"$IP" -n $HO addr add 192.0.2.1/24 dev vh-cli
"$IP" -n $HO link set vh-cli up
for n in $CL $HO; do
  in_ns $n "$SYSCTL" -qw net.ipv4.tcp_tw_reuse=1
  in_ns $n "$SYSCTL" -qw net.ipv4.ip_local_port_range="1024 65000"
done

mkdir -p "$work/state" "$work/run"
cat > "$work/brokkr.yaml" <<YAML
stateDir: $work/state
runDir: $work/run
bpfDir: /sys/fs/bpf/$P
network:
  bridge: brk-kb0
  cidr: 10.213.0.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: kb-nat, target: 10.213.0.11, guestPort: 7000, hostPort: 7100, mode: nat, maxConns: 4096}
YAML
BROKKR_CGROUP=off "$NSENTER" --net=/run/netns/$HO -- "$BIN/brokkrd" --config "$work/brokkr.yaml" >"$work/brokkrd.log" 2>&1 &
daemon=$!
export BROKKR_SOCKET="$work/run/brokkr.sock"
i=0
until "$IP" -n $HO link show brk-kb0 >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -lt 300 ] || { echo "BENCH-ERROR brokkrd made no bridge"; cat "$work/brokkrd.log"; exit 1; }
  sleep 0.1
done

"$IP" -n $HO link add gp type veth peer name eth0 netns $GU
"$IP" -n $HO link set gp master brk-kb0 up
"$IP" -n $GU addr add 10.213.0.11/24 dev eth0
"$IP" -n $GU link set eth0 up
"$IP" -n $GU route add default via 10.213.0.1
"$NSENTER" --net=/run/netns/$GU -- "$BIN/connrate" -serve 10.213.0.11:7000 >/dev/null 2>&1 &
guest=$!

# The plain rule, in a table of its own beside brokkr's: the baseline.
in_ns $HO "$NFT" -f - <<NFT
table ip brk-plain {
  chain pre { type nat hook prerouting priority dstnat - 10; policy accept;
    ip daddr 192.0.2.1 tcp dport 7200 dnat to 10.213.0.11:7000
  }
}
NFT
"$IP" -n $CL route add 10.213.0.0/24 via 192.0.2.1

i=0
until "$BIN/brokkr" status -o json 2>/dev/null | grep -q '"state": *"active"'; do
  i=$((i + 1)); [ $i -lt 300 ] || { echo "BENCH-ERROR the exposure did not become active"; "$BIN/brokkr" status; tail -n 20 "$work/brokkrd.log"; exit 1; }
  sleep 0.1
done
# Each path answers before the rounds begin.
for a in 192.0.2.1:7100 192.0.2.1:7200 10.213.0.11:7000; do
  out=$(in_ns $CL "$BIN/connrate" -rate $a -c 1 -d 1s)
  case "$out" in *" 0 ok"*|"") echo "BENCH-ERROR $a does not answer: $out"; exit 1 ;; esac
done

# cpuns: brokkrd's time on a CPU so far, in ns, all its threads
# (/proc/PID/task/*/schedstat's first field: clock ticks, 10 ms here, are
# too coarse for what one connection costs).
cpuns() { cat /proc/$daemon/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f\n", s }'; }
busyticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
kernel=$(uname -r)
r=1
while [ $r -le "$ROUNDS" ]; do
  case $((r % 3)) in
    0) order="nat plain direct" ;;
    1) order="plain direct nat" ;;
    2) order="direct nat plain" ;;
  esac
  # idle: no caller for DUR, what brokkrd spends on its own (its passes,
  # the counters' reads): the nat rounds' CPU less this is what callers
  # cost it.
  for p in $order idle; do
    case $p in
      nat) a=192.0.2.1:7100 ;;
      plain) a=192.0.2.1:7200 ;;
      direct) a=10.213.0.11:7000 ;;
    esac
    t0=$(cpuns) b0=$(busyticks)
    if [ $p = idle ]; then
      sleep "$DUR"
      out="0 conns/s (0 ok, 0 failed) p50=0us p99=0us"
    else
      out=$(in_ns $CL "$BIN/connrate" -rate $a -c "$CONNS" -d "${DUR}s")
    fi
    t1=$(cpuns) b1=$(busyticks)
    # "N conns/s (OK ok, F failed) p50=Xus p99=Yus"
    echo "$out" | awk -v k="$kernel" -v r=$r -v p=$p -v dt=$((t1 - t0)) -v db=$((b1 - b0)) -v hz="$hz" '{
      ok = $3; sub(/^\(/, "", ok); f = $5; p99 = $8; sub(/^p99=/, "", p99); sub(/us$/, "", p99)
      cpu = (ok > 0) ? dt / 1e3 / ok : 0; busy = (ok > 0) ? db * 1e6 / hz / ok : 0
      printf "BENCH kernel=%s round=%d path=%s conns_s=%s ok=%s failed=%s p99_us=%s cpu_us_per_conn=%.1f busy_us_per_conn=%.1f cpu_us=%.0f\n", k, r, p, $1, ok, f, p99, cpu, busy, dt / 1e3 }'
  done
  r=$((r + 1))
done
# What the status said of the nat path (the fallback names itself there).
"$BIN/brokkr" status -o json | tr ',' '\n' | grep -i "nat path" | head -n 3 | sed 's/^/BENCH-NOTE /' || true
