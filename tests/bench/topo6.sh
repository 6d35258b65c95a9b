# topo6.sh, sourced by the dual-stack nat benchmarks (nat6.sh, natprof.sh,
# bpfcostab.sh). topo6 CL HO GU makes three namespaces of those (brk-*)
# names, each with lo up, deleted first if they exist (the sourcing script
# deletes them on exit):
#   client 10.99.0.2, fd00:99::2 --veth-- host 10.99.0.1, fd00:99::1
#     host br0 10.213.0.1/24, fd00:6272:6b72::1/64 --veth on br0-- guest 10.213.0.11, fd00:6272:6b72::c8
# with forwarding on in the host and TIME_WAIT reuse in client and host:
# sysctls inside these namespaces only.

# inns NS CMD...: CMD in namespace NS.
inns() { local n=$1; shift; nsenter --net=/run/netns/$n -- "$@"; }

topo6() {
  local CL=$1 HO=$2 GU=$3 n
  for n in $CL $HO $GU; do ip netns delete $n 2>/dev/null || true; ip netns add $n; ip -n $n link set lo up; done
  ip -n $CL link add eth0 type veth peer name vh-cli netns $HO
  ip -n $CL addr add 10.99.0.2/24 dev eth0; ip -n $CL addr add fd00:99::2/64 dev eth0 nodad
  ip -n $CL link set eth0 up
  ip -n $HO addr add 10.99.0.1/24 dev vh-cli; ip -n $HO addr add fd00:99::1/64 dev vh-cli nodad
  ip -n $HO link set vh-cli up
  ip -n $HO link add br0 type bridge
  ip -n $HO addr add 10.213.0.1/24 dev br0; ip -n $HO addr add fd00:6272:6b72::1/64 dev br0 nodad
  ip -n $HO link set br0 up
  ip -n $HO link add g1p type veth peer name eth0 netns $GU
  ip -n $HO link set g1p master br0 up
  ip -n $GU addr add 10.213.0.11/24 dev eth0; ip -n $GU addr add fd00:6272:6b72::c8/64 dev eth0 nodad
  ip -n $GU link set eth0 up
  ip -n $CL route add default via 10.99.0.1; ip -n $CL -6 route add default via fd00:99::1
  ip -n $GU route add default via 10.213.0.1; ip -n $GU -6 route add default via fd00:6272:6b72::1
  ip netns exec $HO sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1
  for n in $CL $HO; do ip netns exec $n sysctl -qw net.ipv4.tcp_tw_reuse=1 net.ipv4.ip_local_port_range="1024 65000"; done
}
