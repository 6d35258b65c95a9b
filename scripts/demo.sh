#!/usr/bin/env bash
# brokkr demo: boots one VM under brokkrd in network namespaces of its own,
# publishes a guest port, shows it answering from a client namespace, shows
# the connection cap refusing a caller, prints `brokkr status` and the pinned
# counter map, suspends the VM to disk and shows its first caller waking it,
# and removes everything on exit (also on failure or Ctrl-C).
#
#   brk-demo-client (192.0.2.2) --veth-- brk-demo-host (192.0.2.1, brokkrd,
#                                         bridge brk-demo0, tap, QEMU guest)
#
# Run as root from the repository (make demo builds and fetches first).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin="$repo/bin"
guest="$repo/.cache/guest"
host_ns=brk-demo-host
client_ns=brk-demo-client
bpf_dir=/sys/fs/bpf/brk-demo
# The socket path's cgroup programs attach to a cgroup of the demo's own, and
# the host-local callers run inside it: the demo never touches the root cgroup.
cgroup=/sys/fs/cgroup/unified/brk-demo
host_ip=192.0.2.1
client_ip=192.0.2.2
host_ip6=2001:db8:9::1 client_ip6=2001:db8:9::2

[ "$(id -u)" = 0 ] || { echo "demo: run as root (it creates network namespaces and a VM)" >&2; exit 1; }
for f in "$bin/brokkrd" "$bin/brokkr" "$guest/vmlinuz" "$guest/initramfs.cpio.gz"; do
  [ -e "$f" ] || { echo "demo: $f is missing: run 'make demo' (it builds and makes the guest image first)" >&2; exit 1; }
done

tmp=$(mktemp -d /tmp/brk-demo.XXXXXX)
daemon_pid=""
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
in_host() { nsenter --net=/run/netns/$host_ns -- "$@"; }
in_client() { nsenter --net=/run/netns/$client_ns -- "$@"; }
# A host-local caller: in the host namespace and in the demo's cgroup.
in_host_cg() { nsenter --net=/run/netns/$host_ns -- sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cgroup" "$@"; }

cleanup() {
  rc=$?
  trap - EXIT INT TERM
  step "cleaning up"
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$daemon_pid" 2>/dev/null || true
  fi
  # brokkrd leaves VMs running by design (they outlive the daemon): the demo
  # kills its own VM by the pidfile the QEMU backend wrote.
  for pf in "$tmp"/run/vms/*/qemu.pid; do
    [ -f "$pf" ] || continue
    pid=$(cat "$pf" 2>/dev/null || true)
    [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true
  done
  # Anything else still inside the namespaces belongs to the demo.
  for ns in $host_ns $client_ns; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "$bpf_dir"
  if [ -d "$cgroup" ]; then
    for pid in $(cat "$cgroup/cgroup.procs" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    sleep 0.2
    rmdir "$cgroup" 2>/dev/null || true
  fi
  rm -rf "$tmp"
  echo "removed namespaces $host_ns $client_ns, $cgroup, $bpf_dir and $tmp"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "namespaces: $client_ns ($client_ip) <-veth-> $host_ns ($host_ip)"
for ns in $host_ns $client_ns; do
  ip netns delete "$ns" 2>/dev/null || true
  ip netns add "$ns"
  ip -n "$ns" link set lo up
done
ip -n $host_ns link add brk-demo-h type veth peer name brk-demo-c netns $client_ns
ip -n $host_ns addr add $host_ip/24 dev brk-demo-h
ip -n $host_ns link set brk-demo-h up
ip -n $client_ns addr add $client_ip/24 dev brk-demo-c
ip -n $client_ns link set brk-demo-c up
# dual-stack, as real hosts are
ip -n $host_ns addr add $host_ip6/64 dev brk-demo-h nodad
ip -n $client_ns addr add $client_ip6/64 dev brk-demo-c nodad

mkdir -p "$tmp/state" "$tmp/run"
[ -d /sys/fs/cgroup/unified ] || { echo "demo: no cgroup v2 hierarchy at /sys/fs/cgroup/unified" >&2; exit 1; }
mkdir -p "$cgroup"
cat > "$tmp/brokkr.yaml" <<YAML
# The demo's config: one VM from the test guest image (QEMU; TCG here),
# its HTTP port published on 8080 and its echo port on 7000 with a cap of 2.
stateDir: $tmp/state
runDir: $tmp/run
bpfDir: $bpf_dir
network:
  bridge: brk-demo0
  cidr: 10.213.0.1/24
hypervisor:
  kind: qemu
vms:
  - name: demo
    cpus: 1
    memory: 256M
    kernel: $guest/vmlinuz
    initramfs: $guest/initramfs.cpio.gz
    cmdline: "console=ttyS0 brokkr.name=demo"
exposures:
  - name: demo-http
    vm: demo
    guestPort: 8080
    hostPort: 8080
  - name: demo-echo
    vm: demo
    guestPort: 7000
    hostPort: 7000
    maxConns: 2
YAML
echo "config: $tmp/brokkr.yaml"
"$bin/brokkr" validate -f "$tmp/brokkr.yaml"

step "starting brokkrd in $host_ns (nsenter --net keeps /sys/fs/bpf visible)"
BROKKR_CGROUP=$cgroup in_host "$bin/brokkrd" --config "$tmp/brokkr.yaml" >"$tmp/brokkrd.log" 2>&1 &
daemon_pid=$!
export BROKKR_SOCKET="$tmp/run/brokkr.sock"
for _ in $(seq 100); do [ -S "$BROKKR_SOCKET" ] && break; sleep 0.1; done
[ -S "$BROKKR_SOCKET" ] || { echo "demo: brokkrd did not start:"; cat "$tmp/brokkrd.log"; exit 1; }
echo "brokkrd pid $daemon_pid, socket $BROKKR_SOCKET, log $tmp/brokkrd.log"

step "waiting for the VM to boot and the exposures to become active"
if ! "$bin/brokkr" apply -f "$tmp/brokkr.yaml" --wait --timeout 3m; then
  echo "demo: the VM did not come up; brokkrd's log:"; tail -n 40 "$tmp/brokkrd.log"
  "$bin/brokkr" vm console demo --no-follow 2>/dev/null | tail -n 20 || true
  exit 1
fi

step "the guest answers through the published port, from $client_ns"
echo "\$ curl http://$host_ip:8080/"
# (the guest leases its address a moment before its services listen)
in_client curl -sS --max-time 5 --retry 30 --retry-delay 1 --retry-all-errors "http://$host_ip:8080/"
echo "\$ echo hello | socat - TCP:$host_ip:7000"
echo hello | in_client socat -t 2 - "TCP:$host_ip:7000,connect-timeout=5"

step "the same port over IPv6 (no hostAddress: every address of both families), to the guest's SLAAC address"
echo "\$ curl -6 http://[$host_ip6]:8080/"
# (the guest takes its default route from the host's router advertisements;
# wait for it, so that no unanswered SYN holds a place of the cap)
guest6=$("$bin/brokkr" status -o json | sed -n 's/.*"address6": *"\([^"]*\)".*/\1/p' | head -n 1)
ip -n $client_ns -6 route add fd00:6272:6b72::/64 via $host_ip6
for _ in $(seq 60); do in_client curl -gs --max-time 1 -o /dev/null "http://[$guest6]:8080/" && break; sleep 0.5; done
in_client curl -gsS --max-time 5 --retry 30 --retry-delay 1 --retry-all-errors "http://[$host_ip6]:8080/"
echo "\$ conntrack -L -f ipv6 -p tcp --orig-dst $host_ip6 --orig-port-dst 8080   (on the host: the guest answered the caller's own address)"
in_host conntrack -L -f ipv6 -p tcp --orig-dst $host_ip6 --orig-port-dst 8080 2>/dev/null | head -n 1

step "auto mode: a caller on the host itself is sent to the guest when it connects (socket path)"
echo "\$ curl http://127.0.0.1:8080/   (inside $host_ns, in $cgroup)"
in_host_cg curl -sS --max-time 5 "http://127.0.0.1:8080/"
echo "(no proxy listens on 127.0.0.1:8080: $(in_host ss -Htln 'sport = :8080' | wc -l) listening sockets)"

step "one cap across paths: demo-echo takes 2 connections, whoever calls"
# One caller from outside (nat path) and one on the host's loopback (socket
# path) hold their connections open (they stay until clean-up).
in_client socat -u "EXEC:sleep 60" "TCP:$host_ip:7000" 2>/dev/null &
disown
in_host_cg socat -u "EXEC:sleep 60" "TCP:127.0.0.1:7000" 2>/dev/null &
disown
sleep 1
echo "\$ echo third | socat - TCP:$host_ip:7000   (from $client_ns; one nat and one socket-path connection are open)"
if out=$(echo third | in_client socat -t 2 - "TCP:$host_ip:7000,connect-timeout=5" 2>&1) && [ "$out" = third ]; then
  echo "demo: the third connection was carried: the cap did not hold" >&2
  exit 1
fi
echo "refused: ${out:-connection closed}"
echo "\$ echo fourth | socat - TCP:127.0.0.1:7000   (on the host)"
if out=$(echo fourth | in_host_cg socat -t 2 - "TCP:127.0.0.1:7000,connect-timeout=5" 2>&1) && [ "$out" = fourth ]; then
  echo "demo: the host-local caller was carried: the cap did not hold across paths" >&2
  exit 1
fi
echo "refused: ${out:-connection closed}"

step "brokkr status"
"$bin/brokkr" status

step "a port a host program holds is not taken from it"
# A host program on 9090 in the host namespace; an exposure of the same
# port is refused before anything changes, and the ports brokkr publishes
# cannot be bound by host programs.
nsenter --net=/run/netns/$host_ns -- socat TCP4-LISTEN:9090,fork,reuseaddr SYSTEM:"echo squatter" &
squat_pid=$!
for _ in $(seq 50); do in_host ss -Htln "sport = :9090" | grep -q . && break; sleep 0.1; done
{ cat "$tmp/brokkr.yaml"; printf '  - {name: demo-squat, vm: demo, guestPort: 8080, hostPort: 9090, mode: nat}\n'; } > "$tmp/squat.yaml"
echo "\$ brokkr apply -f squat.yaml --dry-run   (demo-squat on 9090, where socat pid $squat_pid listens)"
"$bin/brokkr" apply -f "$tmp/squat.yaml" --dry-run 2>&1 | tee "$tmp/squat.out"
grep -q "9090/tcp is in use by pid $squat_pid (socat)" "$tmp/squat.out" || { echo "demo: the squatted port was not reported" >&2; exit 1; }
kill "$squat_pid"; wait "$squat_pid" 2>/dev/null || true
echo "\$ socat TCP4-LISTEN:8080,reuseaddr -   (a host program binding the port demo-http publishes)"
rc=0; timeout 2 nsenter --net=/run/netns/$host_ns -- socat -u "TCP4-LISTEN:8080,reuseaddr" - </dev/null 2>"$tmp/bind.err" || rc=$?
[ "$rc" = 1 ] || { echo "demo: a host program bound a published port (exit $rc)" >&2; exit 1; }
grep -o "Address already in use" "$tmp/bind.err" | head -n 1

step "bpftool: the pinned map exposure_stats_v2, with named fields (daemon or not)"
# The array has 131072 entries (a full dump takes bpftool seconds): brokkr
# stats names the occupied slots, bpftool looks one up by its slot number.
echo "\$ brokkr stats --bpf-dir $bpf_dir"
"$bin/brokkr" stats --bpf-dir "$bpf_dir"
slot=$("$bin/brokkr" stats --bpf-dir "$bpf_dir" | awk '$1 == "demo-http" { print $2 }')
[ -n "$slot" ] || { echo "demo: demo-http has no slot in brokkr stats" >&2; exit 1; }
key="$((slot & 255)) $((slot >> 8 & 255)) $((slot >> 16 & 255)) 0"
echo "\$ bpftool map lookup pinned $bpf_dir/exposure_stats_v2 key $key   (demo-http's slot, $slot)"
bpftool map lookup pinned "$bpf_dir/exposure_stats_v2" key $key

step "scale to zero: brokkr vm suspend saves the guest to disk and ends its process"
"$bin/brokkr" vm suspend demo --wait --timeout 2m
"$bin/brokkr" vm ls demo
echo "hypervisor processes of demo: $(pgrep -f -- "$tmp/run/vms/demo/" | wc -l)"
"$bin/brokkr" expose ls demo-http

step "its first caller wakes it: the SYN asks the kernel for the wake, its retransmission reaches the resumed guest"
echo "\$ curl http://$host_ip:8080/   (from $client_ns, the VM suspended)"
t0=$(date +%s%N)
in_client curl -sS --max-time 30 "http://$host_ip:8080/"
t1=$(date +%s%N)
echo "answered after $(( (t1 - t0) / 1000000 )) ms (a cold boot takes several seconds here)"
"$bin/brokkr" vm ls demo

step "brokkr stats (reads the pinned map directly)"
"$bin/brokkr" stats --bpf-dir "$bpf_dir"

step "nft list table inet brokkr (in $host_ns)"
# Listed to a file first: piping into head would SIGPIPE nft on a long table.
in_host nft list table inet brokkr > "$tmp/nft.txt"
head -n 80 "$tmp/nft.txt"
[ "$(wc -l < "$tmp/nft.txt")" -le 80 ] || echo "... ($(wc -l < "$tmp/nft.txt") lines in all)"

echo
echo "demo: OK"
