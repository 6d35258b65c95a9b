#!/usr/bin/env bash
# make soak: brokkr's reliability harness (issue 10). Builds the binaries,
# creates its own brk-soak-* namespaces, a private bpffs, a child cgroup for
# the socket path (never the root) and a small tmpfs for stateDir, then runs
# the phases of tests/soak (faults, load, disk full, bad input, permissions,
# faults with real QEMU guests),
# each printing one measured figure per line. Everything it made is removed
# on exit, also on failure. Knobs (defaults fit in ~20 min on 2 cores):
#   SOAK_MINUTES  overall budget in minutes (20); phases stop early when it runs out
#   SOAK_KILLS    SIGKILLs of brokkrd during converges (50)
#   SOAK_EXPOSURES exposures at most in one converge (1000)
#   SOAK_VMS      fake cloud-hypervisor VMs at most (8)
#   SOAK_CONNS    concurrent connections per load wave (10000)
#   SOAK_WAVES    load waves (3)
#   SOAK_FUZZTIME go test -fuzztime per Fuzz target (10s; 10m in a full soak)
#   SOAK_FUZZ_GO  the Go toolchain that runs the fuzzers (go1.27.3: 1.26's fuzz
#                 coordinator can fail on its own deadline, golang/go#75804)
#   SOAK_QEMU_KILLS, SOAK_QEMU_EXPOSURES, SOAK_QEMU_VMS
#                 the qemu phase: the faults phase again with real QEMU guests (10, 200, 3)
#   SOAK_PHASES   which phases (faults,load,disk,fuzz,perm,qemu)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" = 0 ] || { echo "soak: needs root" >&2; exit 1; }
export PATH=/usr/local/go/bin:$PATH
SOAK_MINUTES=${SOAK_MINUTES:-20}
work=$(mktemp -d /tmp/brk-soak.XXXXXX)
CG=/sys/fs/cgroup/unified/brk-soak-$$
NSS="brk-soak-host brk-soak-cli brk-soak-tgt"
cleanup() {
  rc=$?
  set +e
  [ -f "$work/soak.pid" ] && kill "$(cat "$work/soak.pid")" 2>/dev/null
  # Every process in our namespaces (brokkrd, servers) and every fake VMM
  # started under our work dir; nothing else.
  for n in $NSS; do ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
  for p in $(pgrep -f "$work/" 2>/dev/null); do [ "$p" != $$ ] && kill -9 "$p" 2>/dev/null; done
  sleep 0.3
  for n in $NSS; do ip netns delete "$n" 2>/dev/null; done
  if [ -d "$CG" ]; then
    find "$CG" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null
    while read -r p; do echo "$p" > /sys/fs/cgroup/unified/cgroup.procs; done < "$CG/cgroup.procs" 2>/dev/null
    rmdir "$CG" 2>/dev/null
  fi
  umount "$work/state" 2>/dev/null
  umount "$work/bpf" 2>/dev/null
  rm -rf "$work"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

go build -o "$work/bin/" ./cmd/brokkrd ./cmd/brokkr ./tests/chfake/cmd/chfake ./tests/soak/cmd/soak
mkdir -p "$work/bpf" "$work/state" "$CG"
mount -t bpf bpf "$work/bpf"
# A small tmpfs so the disk-full phase can fill it during an apply.
mount -t tmpfs -o size=${SOAK_STATE_SIZE:-32m},mode=0755 tmpfs "$work/state"
for n in $NSS; do ip netns delete "$n" 2>/dev/null || true; ip netns add "$n"; ip -n "$n" link set lo up; done
ip -n brk-soak-cli link add eth0 type veth peer name vh-cli netns brk-soak-host
ip -n brk-soak-cli addr add 10.99.50.2/24 dev eth0; ip -n brk-soak-cli link set eth0 up
ip -n brk-soak-cli route add default via 10.99.50.1
ip -n brk-soak-host addr add 10.99.50.1/24 dev vh-cli; ip -n brk-soak-host link set vh-cli up
for n in $NSS; do ip netns exec "$n" sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000" net.core.somaxconn=65535; done
ulimit -n "$(ulimit -Hn)"

SOAK_WORK=$work SOAK_CGROUP=$CG SOAK_MINUTES=$SOAK_MINUTES "$work/bin/soak" &
echo $! > "$work/soak.pid"
wait "$(cat "$work/soak.pid")"
