#!/usr/bin/env bash
# brokkr fleet demo: a real three-member etcd and two brokkrd nodes, each in
# network namespaces of its own with one guest VM; one `brokkr fleet apply`
# gives both their VMs and published ports; calls go through both hosts'
# ports; `brokkr fleet status` shows the fleet. Everything is removed on exit
# (also on failure or Ctrl-C).
#
#   brk-fdemo-core: etcd (3 members, etcdrun), the operator's CLI, the caller
#        |-- veth 10.77.1.0/30 -- brk-fdemo-h1 (brokkrd node h1, bridge, VM g1)
#        `-- veth 10.77.2.0/30 -- brk-fdemo-h2 (brokkrd node h2, bridge, VM g2)
#
# Run as root from the repository (make demo-fleet builds and fetches first).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bin="$repo/bin"
guest="$repo/.cache/guest"
core=brk-fdemo-core
nodes=(h1 h2)

[ "$(id -u)" = 0 ] || { echo "demo-fleet: run as root (it creates network namespaces and VMs)" >&2; exit 1; }
for f in "$bin/brokkrd" "$bin/brokkr" "$bin/etcdrun" "$guest/vmlinuz" "$guest/initramfs.cpio.gz"; do
  [ -e "$f" ] || { echo "demo-fleet: $f is missing: run 'make demo-fleet'" >&2; exit 1; }
done

tmp=$(mktemp -d /tmp/brk-fdemo.XXXXXX)
pids=()
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
in_ns() { local ns=$1; shift; nsenter --net=/run/netns/"$ns" -- "$@"; }
ops() { in_ns $core "$bin/brokkr" "$@"; }
export BROKKR_ETCD=http://127.0.0.1:2379,http://127.0.0.1:2380,http://127.0.0.1:2381

cleanup() {
  rc=$?
  trap - EXIT INT TERM
  step "cleaning up"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  # VMs outlive brokkrd by design: the demo kills its own by their pidfiles.
  for pf in "$tmp"/*/run/vms/*/qemu.pid; do
    [ -f "$pf" ] && kill -KILL "$(cat "$pf")" 2>/dev/null || true
  done
  for ns in $core "${nodes[@]/#/brk-fdemo-}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns delete "$ns" 2>/dev/null || true
  done
  for n in "${nodes[@]}"; do rm -rf "/sys/fs/bpf/brk-fdemo-$n"; done
  rm -rf "$tmp"
  echo "removed namespaces $core ${nodes[*]/#/brk-fdemo-}, their pins and $tmp"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step "namespaces: $core linked to ${nodes[*]/#/brk-fdemo-}"
ip netns delete $core 2>/dev/null || true
ip netns add $core
ip -n $core link set lo up
k=0
for n in "${nodes[@]}"; do
  k=$((k + 1)); ns=brk-fdemo-$n
  ip netns delete "$ns" 2>/dev/null || true
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add fl-up type veth peer name "fl-$n" netns $core
  ip -n "$ns" addr add "10.77.$k.2/30" dev fl-up
  ip -n "$ns" link set fl-up up
  ip -n $core addr add "10.77.$k.1/30" dev "fl-$n"
  ip -n $core link set "fl-$n" up
done

step "etcd: three members in $core (go.etcd.io/etcd/server/v3/embed)"
in_ns $core "$bin/etcdrun" -members 3 -dir "$tmp/etcd" -client-host 0.0.0.0 -client-port 2379 >"$tmp/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q ready "$tmp/etcd.log" && break; sleep 0.1; done
cat "$tmp/etcd.log"

step "two brokkrd nodes, each with a fleet: section and nothing else to run"
k=0
for n in "${nodes[@]}"; do
  k=$((k + 1)); d="$tmp/$n"
  mkdir -p "$d/state" "$d/run"
  cat > "$d/brokkr.yaml" <<YAML
stateDir: $d/state
runDir: $d/run
bpfDir: /sys/fs/bpf/brk-fdemo-$n
network: {bridge: brk-fdemo0, cidr: 10.213.$k.1/24}
hypervisor: {kind: qemu}
fleet:
  endpoints: [http://10.77.$k.1:2379, http://10.77.$k.1:2380, http://10.77.$k.1:2381]
  node: $n
YAML
  # No socket path here: its cgroup programs would attach at the host's
  # root cgroup, and the fleet demo's callers are all outside.
  BROKKR_CGROUP=off in_ns "brk-fdemo-$n" "$bin/brokkrd" --config "$d/brokkr.yaml" >"$d/brokkrd.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$d/run/brokkr.sock" ] && break; sleep 0.1; done
  echo "node $n: brokkrd in brk-fdemo-$n, config $d/brokkr.yaml"
done

step "one fleet file for both nodes"
{
  echo "nodes:"
  k=0
  for n in "${nodes[@]}"; do
    k=$((k + 1))
    cat <<YAML
  $n:
    network: {bridge: brk-fdemo0, cidr: 10.213.$k.1/24}
    vms:
      - {name: g$k, memory: 256M, kernel: $guest/vmlinuz, initramfs: $guest/initramfs.cpio.gz, cmdline: "console=ttyS0 brokkr.name=g$k"}
    exposures:
      - {name: g$k-http, vm: g$k, guestPort: 8080, hostPort: 8080}
YAML
  done
} > "$tmp/fleet.yaml"
cat "$tmp/fleet.yaml"
echo "\$ brokkr fleet apply -f fleet.yaml --dry-run"
ops fleet apply -f "$tmp/fleet.yaml" --dry-run
echo "\$ brokkr fleet apply -f fleet.yaml"
ops fleet apply -f "$tmp/fleet.yaml"

step "waiting until both nodes report their VM running and their port active"
ok=""
for _ in $(seq 180); do
  js=$(ops fleet status -o json 2>/dev/null || true)
  if [ "$(grep -c '"converged": true' <<<"$js")" = 2 ] && [ "$(grep -c '"vmsRunning": 1' <<<"$js")" = 2 ] \
     && [ "$(grep -c '"exposuresActive": 1' <<<"$js")" = 2 ]; then ok=1; break; fi
  sleep 1
done
if [ -z "$ok" ]; then
  echo "demo-fleet: the fleet did not converge in 3 minutes:"; ops fleet status || true
  for n in "${nodes[@]}"; do echo "--- $n"; tail -n 20 "$tmp/$n/brokkrd.log"; done
  exit 1
fi

step "calls through both hosts' published ports (from $core)"
k=0
for n in "${nodes[@]}"; do
  k=$((k + 1))
  echo "\$ curl http://10.77.$k.2:8080/   (node $n)"
  in_ns $core curl -sS --max-time 5 --retry 30 --retry-delay 1 --retry-all-errors "http://10.77.$k.2:8080/"
done
sleep 1.5 # the counters are read once per pass and the status written on change

step "brokkr fleet status"
ops fleet status
step "brokkr fleet status --node h1"
ops fleet status --node h1

echo
echo "demo-fleet: OK"
