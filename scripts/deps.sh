#!/usr/bin/env bash
# Installs the Debian packages brokkr's build, tests, demo and benchmarks use.
# (prometheus is for promtool: daemon tests lint the metrics and test dist/brokkr.rules.yml.)
# (systemd and dbus-daemon: tests/systemd runs a user-mode systemd, whose session bus is a dbus-daemon.)
# (iptables: a bpf test holds packets with the NFQUEUE target, which this kernel has
#  only as an xtables target, not as nft's queue expression.)
# (kmod: make test-kernels indexes the test kernels' modules with depmod, and its VMs load
#  them with modprobe.)
# Idempotent and quiet when everything is already there.
set -euo pipefail
pkgs=(clang-14 llvm-14 libbpf-dev linux-libc-dev bpftool nftables iproute2 conntrack
      iperf3 socat haproxy wrk busybox-static cpio qemu-system-x86 strace util-linux
      ca-certificates curl prometheus etcd-client systemd dbus-daemon iptables kmod)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
