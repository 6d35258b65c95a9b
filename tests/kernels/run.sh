#!/usr/bin/env bash
# make test-kernels: boots each kernel of the matrix (Debian's cloud kernels,
# downloaded and unpacked, never installed) in a QEMU VM whose root
# filesystem is an initramfs built here: busybox, the host's own nft, ip,
# bpftool, conntrack (with their libraries), the kernel package's modules,
# and the `go test -c` binaries of the kernel-touching packages. The VM runs
# them as root (each package in its directory, like go test) and writes
# their -test.v output to its second serial port; then the same binaries run
# on this host. One line per kernel:
#   kernel 6.1.0-57-cloud-amd64: N passed, M failed, K skipped
# and a last "kernel-matrix: N passed, M failed, K skipped" for them all.
#
# KERNELS="5.10 6.1 6.12" (default) picks the kernel lines; HOST=0 leaves
# the host's run out; KERNELS_REFRESH=1 asks the archive for newer packages
# (otherwise a kernel line downloaded once is reused: no network).
# KERNELS_SUITE runs only the test binaries and flags it names (see suite).
# KERNELS_TIMEOUT (minutes per VM, 60) bounds a boot. Logs stay under
# .cache/kernels/run-<line>/ (console.log, results.log).
# BENCH=1 (make bench-kernels) runs tests/kernels/bench-vm.sh in each VM
# instead of the tests, then on the host, and prints per kernel the medians
# of the per-round ratios (capped brokkr nat against plain nft DNAT and
# against direct) and brokkrd's CPU per connection.
# The whole script is one block, read before it runs: editing the file
# while a run goes on does not change that run.
{
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache="$repo/.cache/kernels"
export PATH=/usr/local/go/bin:$PATH
KERNELS=${KERNELS:-"5.10 6.1 6.12"}
HOST=${HOST:-1}
BENCH=${BENCH:-0}
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-60}
mkdir -p "$cache"

# The suite each kernel line comes from.
suite_of() {
  case "$1" in
    5.10) echo bullseye ;;
    6.1) echo bookworm ;;
    6.12) echo trixie ;;
    *) echo "test-kernels: unknown kernel line $1 (5.10, 6.1, 6.12)" >&2; return 1 ;;
  esac
}

# apt with a state of its own per suite: the host's sources and status are
# never read or changed.
kapt() {
  local suite=$1; shift
  local d="$cache/apt-$suite"
  "$@" -o Dir::Etc::SourceList="$d/sources.list" -o Dir::Etc::SourceParts=- \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" -o Dir::State::status=/dev/null \
    -o APT::Sandbox::User=root
}

# apt_sources SUITE: kapt's state directory and sources list for SUITE.
apt_sources() {
  local suite=$1 d="$cache/apt-$1"
  mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main"
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite-updates main"
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian-security $suite-security main"
  } > "$d/sources.list"
}

# fetch_kernel LINE: downloads and unpacks the line's newest cloud kernel
# into $cache/LINE (once; again only with KERNELS_REFRESH=1).
fetch_kernel() {
  local line=$1 suite k
  suite=$(suite_of "$line")
  k="$cache/$line"
  if [ -f "$k/.done" ] && [ "${KERNELS_REFRESH:-0}" != 1 ]; then return 0; fi
  apt_sources "$suite"
  echo "test-kernels: $line: asking the archive for $suite's linux-image-cloud-amd64"
  kapt "$suite" apt-get -qq update >/dev/null
  local kpkg kver
  kpkg=$(kapt "$suite" apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
  [ -n "$kpkg" ] || { echo "test-kernels: $suite has no linux-image-cloud-amd64" >&2; return 1; }
  kver=$(kapt "$suite" apt-cache policy "$kpkg" | awk '/Candidate:/{print $2}')
  if [ -f "$k/.done" ] && [ "$(cat "$k/package")" = "$kpkg=$kver" ]; then return 0; fi
  echo "test-kernels: $line: downloading $kpkg $kver"
  local w; w=$(mktemp -d "$cache/fetch.XXXXXX")
  (cd "$w" && kapt "$suite" apt-get -qq download "$kpkg=$kver" >/dev/null)
  dpkg -x "$w"/*.deb "$w/x"
  local rel; rel=$(basename "$(ls -d "$w"/x/boot/vmlinuz-*)" | sed 's/^vmlinuz-//')
  local mods="$w/x/lib/modules/$rel"; [ -d "$mods" ] || mods="$w/x/usr/lib/modules/$rel"
  # Modules: the whole tree less what a headless VM never loads; depmod
  # gives modprobe (the kernel's autoloader) its index.
  rm -rf "$w/m"; mkdir -p "$w/m/lib/modules"
  cp -a "$mods" "$w/m/lib/modules/$rel"
  rm -rf "$w/m/lib/modules/$rel/kernel/drivers/"{gpu,media,infiniband,scsi,md,hid,input,usb,nvme,thermal,platform,hwmon} \
         "$w/m/lib/modules/$rel/kernel/sound" "$w/m/lib/modules/$rel/kernel/fs/"{btrfs,xfs,ocfs2,nfs,nfsd,ceph,f2fs,gfs2,jfs,cifs,smb}
  depmod -b "$w/m" "$rel"
  (cd "$w/m" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) > "$w/modules.cpio"
  rm -rf "$k"; mkdir -p "$k"
  cp "$w/x/boot/vmlinuz-$rel" "$k/vmlinuz"
  mv "$w/modules.cpio" "$k/modules.cpio"
  echo "$rel" > "$k/release"
  echo "$kpkg=$kver" > "$k/package"
  rm -rf "$w"
  touch "$k/.done"
}

# The nft a kernel line's VM runs when the host's cannot drive that kernel:
# Debian 12's nft 1.0.6 puts a one-byte byteorder expression on `meta
# l4proto` in an interval concatenation (the port-range dispatch rules),
# which 6.12 refuses with EOPNOTSUPP; trixie's nft, the one that kernel
# ships with, does not emit it. brokkr itself never runs nft (its rules go
# over netlink), so only the tests' nft -f of golden text is affected.
nft_suite_of() {
  case "$1" in
    6.12) echo trixie ;;
    *) ;;
  esac
}

# fetch_nft LINE: the line's own nft and the libraries it loads, unpacked
# under /opt/nft with /usr/sbin/nft a wrapper that runs it with its own
# loader, into $cache/LINE/nft.cpio (once; appended to the VM's initramfs
# after the payload, so its /usr/sbin/nft replaces the host's).
fetch_nft() {
  local line=$1 suite k w pkgs
  suite=$(nft_suite_of "$line")
  k="$cache/$line"
  rm -f "$k/nft.cpio.tmp"
  [ -n "$suite" ] || { rm -f "$k/nft.cpio"; return 0; }
  if [ -f "$k/nft.cpio" ] && [ "${KERNELS_REFRESH:-0}" != 1 ]; then return 0; fi
  apt_sources "$suite"
  w=$(mktemp -d "$cache/fetch.XXXXXX")
  local deps=(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts
    --no-breaks --no-replaces --no-enhances nftables)
  pkgs=$(kapt "$suite" "${deps[@]}" 2>/dev/null | grep -v '^[ <]' | sort -u) || true
  if [ -z "$pkgs" ]; then
    kapt "$suite" apt-get -qq update >/dev/null
    pkgs=$(kapt "$suite" "${deps[@]}" | grep -v '^[ <]' | sort -u)
  fi
  echo "test-kernels: $line: downloading $suite's nftables and its libraries"
  # shellcheck disable=SC2086
  (cd "$w" && kapt "$suite" apt-get -qq download $pkgs >/dev/null)
  mkdir -p "$w/root/opt/nft"
  local f; for f in "$w"/*.deb; do dpkg -x "$f" "$w/root/opt/nft"; done
  mkdir -p "$w/root/usr/sbin"
  cat > "$w/root/usr/sbin/nft" <<'WRAP'
#!/bin/sh
l=/opt/nft/usr/lib/x86_64-linux-gnu
exec $l/ld-linux-x86-64.so.2 --library-path $l /opt/nft/usr/sbin/nft "$@"
WRAP
  chmod 0755 "$w/root/usr/sbin/nft"
  rm -rf "$w/root/opt/nft/usr/share/doc" "$w/root/opt/nft/usr/share/man" "$w/root/opt/nft/usr/share/locale" \
    "$w/root/opt/nft/usr/lib/x86_64-linux-gnu/gconv"
  (cd "$w/root" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) > "$k/nft.cpio.tmp"
  mv "$k/nft.cpio.tmp" "$k/nft.cpio"
  rm -rf "$w"
}

# What the VM runs: "binary dir [flags...]", one package a line (dir is the
# package's directory, where go test would run it). KERNELS_SUITE replaces
# it (lines of the same form, e.g. "e2e tests/e2e -test.run ^TestKernelMatrixIPv6"),
# to run one test on the kernels while working on it.
suite() {
  if [ -n "${KERNELS_SUITE:-}" ]; then
    printf '%s\n' "$KERNELS_SUITE"
    return
  fi
  cat <<'SUITE'
kernelfeat internal/kernelfeat
bpf bpf
netplane netplane
conntrack netplane/conntrack
link netplane/link
nft netplane/nft
compile netplane/nft/compile
dhcp netplane/dhcp
ipam netplane/ipam
e2e tests/e2e -test.run ^TestKernelMatrix|^TestNatPath
SUITE
}

# Userspace for the VM: the host's binaries and the libraries they load.
tools=(nft ip bridge conntrack bpftool nsenter ss sysctl socat iptables kmod)

build_payload() {
  local p=$1
  rm -rf "$p"; mkdir -p "$p"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,run,var/run,root,tests,src}
  cp /bin/busybox "$p/bin/busybox"
  for a in $(/bin/busybox --list); do
    [ "$a" = busybox ] || [ -e "$p/bin/$a" ] || ln -s busybox "$p/bin/$a"
  done
  local t f lib
  for t in "${tools[@]}"; do
    f=$(command -v "$t") || { echo "test-kernels: $t is not installed (scripts/deps.sh)" >&2; return 1; }
    f=$(readlink -f "$f")
    mkdir -p "$p/$(dirname "$f")"; cp -L "$f" "$p/$f"
    for lib in $(ldd "$f" | grep -o '/[^ ]*'); do
      mkdir -p "$p/$(dirname "$lib")"; cp -Ln "$lib" "$p/$lib" 2>/dev/null || true
    done
    # Its own name in PATH, not busybox's applet of that name.
    rm -f "$p/bin/$t"
    case "$f" in /usr/sbin/"$t" | /usr/bin/"$t" | /sbin/"$t" | /bin/"$t") ;; *) ln -sf "$f" "$p/usr/sbin/$t" ;; esac
  done
  # iptables' matches and targets (libxt_tcp.so for --dport, NFQUEUE, ...):
  # it loads them by dlopen, so ldd does not name them.
  local xt
  for xt in /usr/lib/x86_64-linux-gnu/xtables /usr/lib/xtables; do
    [ -d "$xt" ] || continue
    mkdir -p "$p/$xt"; cp -aL "$xt/." "$p/$xt/"
    for f in "$xt"/*.so; do
      for lib in $(ldd "$f" 2>/dev/null | grep -o '/[^ ]*'); do
        mkdir -p "$p/$(dirname "$lib")"; cp -Ln "$lib" "$p/$lib" 2>/dev/null || true
      done
    done
  done
  for a in modprobe insmod lsmod depmod rmmod modinfo; do rm -f "$p/bin/$a"; ln -sf "$(readlink -f "$(command -v kmod)")" "$p/sbin/$a"; done
  # nft and iproute2 read these; libnftables its rt tables.
  cp /etc/protocols /etc/services "$p/etc/"
  [ -d /etc/iproute2 ] && cp -a /etc/iproute2 "$p/etc/"
  [ -d /usr/share/iproute2 ] && { mkdir -p "$p/usr/share"; cp -a /usr/share/iproute2 "$p/usr/share/"; }
  echo "root:x:0:0:root:/root:/bin/sh" > "$p/etc/passwd"
  echo "root:x:0:" > "$p/etc/group"
  install -m 0755 "$here/init" "$p/init"
  suite > "$p/etc/brk-suite"
  if [ "$BENCH" = 1 ]; then
    install -m 0755 "$here/bench-vm.sh" "$p/etc/brk-bench"
    : > "$p/etc/brk-bench.env"
    [ -n "${ROUNDS:-}" ] && echo "ROUNDS=$ROUNDS" >> "$p/etc/brk-bench.env"
    [ -n "${DUR:-}" ] && echo "DUR=$DUR" >> "$p/etc/brk-bench.env"
    (cd "$repo" && go build -ldflags='-s -w' -o "$p/tests/bin/" ./cmd/brokkrd ./cmd/brokkr ./tests/bench/connrate)
    (cd "$p" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) > "$p.cpio"
    return 0
  fi
  # The test binaries, and the repository's files they read (testdata,
  # scripts) at the same paths relative to their package.
  (cd "$repo" && go test -c -ldflags='-s -w' -o "$p/tests/" ./internal/kernelfeat ./bpf/... ./netplane/... ./tests/e2e >/dev/null)
  (cd "$repo" && go build -ldflags='-s -w' -o "$p/tests/bin/" ./cmd/brokkrd ./cmd/brokkr)
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard | grep -zv '\.o$' | xargs -0 cp --parents -t "$p/src/" 2>/dev/null || true)
  (cd "$p" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0) > "$p.cpio"
}

# count FILE: passed failed skipped of one -test.v stream (subtests count
# too), plus one failure per package binary that exited non-zero without a
# --- FAIL line (a panic, a timeout, a binary that did not start).
count() {
  awk '
    /^[[:space:]]*--- PASS:/ { p++ }
    /^[[:space:]]*--- FAIL:/ { f++; pf[pkg]++ }
    /^[[:space:]]*--- SKIP:/ { s++ }
    /^BRK-BEGIN / { pkg=$2 }
    /^BRK-END / { if ($3 != 0 && !pf[$2]) f++ }
    /^BRK-DONE/ { done=1 }
    END { if (!done) f++; printf "%d passed, %d failed, %d skipped\n", p, f, s }' "$1"
}

# details FILE: the failed tests, and the skipped ones grouped by the
# reason they gave (go test -v prints a test's log before its --- line).
details() {
  awk '
    /^BRK-BEGIN / { pkg=$2; next }
    /^BRK-END / { if ($3 != 0) print "    " pkg ": exit " $3; next }
    /^BRK-NOMOD / { print "    module " $2 " did not load"; next }
    /^BRK-NFT / { sub(/^BRK-NFT /, ""); print "    with " $0; next }
    /^=== (RUN|CONT|NAME)/ { cur=$3; next }
    /^[[:space:]]+[A-Za-z0-9_]+\.go:[0-9]+: / { l=$0; sub(/^[[:space:]]+[A-Za-z0-9_]+\.go:[0-9]+: /, "", l); said[cur]=l; next }
    /^[[:space:]]*--- FAIL:/ { l=$0; sub(/^[[:space:]]*--- FAIL: /, "", l); print "    " pkg ": FAIL " l; next }
    /^[[:space:]]*--- SKIP:/ {
      l=$0; sub(/^[[:space:]]*--- SKIP: /, "", l); sub(/ \(.*$/, "", l)
      k=pkg ": " said[l]; if (!(k in n)) order[++m]=k; n[k]++; if (n[k] <= 2) names[k]=names[k] (n[k]>1 ? ", " : "") l
    }
    END { for (i=1; i<=m; i++) { k=order[i]; printf "    skipped %d in %s\n        (%s%s)\n", n[k], k, names[k], (n[k] > 2 ? ", ..." : "") } }' "$1"
}

run_vm() {
  local line=$1 k="$cache/$1" r="$cache/run-$1"
  rm -rf "$r"; mkdir -p "$r"
  cat "$k/modules.cpio" "$payload.cpio" > "$r/initrd"
  [ -f "$k/nft.cpio" ] && cat "$k/nft.cpio" >> "$r/initrd"
  local start=$SECONDS
  # TCG: this host's /dev/kvm does not run Debian's kernels. Two vCPUs,
  # one host thread each; no NIC (the tests make their own namespaces).
  timeout --foreground "$((KERNELS_TIMEOUT * 60))" qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max -smp 2 -m 3072 \
    -kernel "$k/vmlinuz" -initrd "$r/initrd" -append "console=ttyS0 panic=-1 quiet" \
    -display none -no-reboot -nic none -monitor none \
    -serial "file:$r/console.log" -serial "file:$r/results.raw" </dev/null >"$r/qemu.log" 2>&1 || true
  rm -f "$r/initrd"
  tr -d '\r' < "$r/results.raw" > "$r/results.log"; rm -f "$r/results.raw"
  echo "$((SECONDS - start))" > "$r/seconds"
}

run_host() {
  local r="$cache/run-host"
  rm -rf "$r"; mkdir -p "$r"
  local start=$SECONDS pkg dir args rc
  {
    echo "BRK-KERNEL $(uname -r)"
    while read -r pkg dir args; do
      echo "BRK-BEGIN $pkg"
      # shellcheck disable=SC2086
      (cd "$repo/$dir" && BROKKR_E2E_BIN="$payload/tests/bin" "$payload/tests/$pkg.test" -test.v -test.count=1 -test.timeout=20m $args 2>&1) && rc=0 || rc=$?
      echo "BRK-END $pkg $rc"
    done < <(suite)
    echo "BRK-DONE"
  } > "$r/results.log"
  echo "$((SECONDS - start))" > "$r/seconds"
}

# bench_report NAME FILE: the BENCH lines of one run as medians of the
# per-round ratios [lowest..highest], and brokkrd's CPU per connection.
bench_report() {
  awk -v name="$1" '
    function med(a, n,   i, j, t) { for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
      return (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    /^BENCH / { for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      c[v["round"], v["path"]] = v["conns_s"]; q[v["round"], v["path"]] = v["p99_us"]
      if (v["path"] == "nat") { cpu[++nc] = v["cpu_us_per_conn"]; busy[nc] = v["busy_us_per_conn"]; share[nc] = (v["busy_us_per_conn"] > 0) ? v["cpu_us_per_conn"] / v["busy_us_per_conn"] : 0 }
      if (v["path"] == "plain") pbusy[++npb] = v["busy_us_per_conn"]
      if (v["path"] == "nat") { ncpu[v["round"]] = v["cpu_us"]; nok[v["round"]] = v["ok"] }
      if (v["path"] == "idle") icpu[v["round"]] = v["cpu_us"]
      if (v["round"] > rounds) rounds = v["round"] }
    /^BENCH-ERROR/ { print "    " $0; bad = 1 }
    /^BENCH-NOTE/ { sub(/^BENCH-NOTE /, ""); note = note "    status: " $0 "\n" }
    END {
      if (rounds == 0) { printf "bench %s: no measurement\n", name; exit 1 }
      for (r = 1; r <= rounds; r++) { rp[r] = c[r, "nat"] / c[r, "plain"]; rd[r] = c[r, "nat"] / c[r, "direct"]; rq[r] = q[r, "nat"] / q[r, "plain"]
        np[r] = c[r, "nat"]; pp[r] = c[r, "plain"]; dp[r] = c[r, "direct"] }
      n = rounds
      lo = 1e9; hi = 0; for (r = 1; r <= n; r++) { if (rp[r] < lo) lo = rp[r]; if (rp[r] > hi) hi = rp[r] }
      printf "bench %s: %d rounds; conns/s medians: nat %.0f, plain nft DNAT %.0f, direct %.0f\n", name, n, med(np, n), med(pp, n), med(dp, n)
      printf "    nat / plain DNAT: %.2f [%.2f..%.2f]; nat / direct: %.2f; p99 nat / plain: %.2f\n", med(rp, n), lo, hi, med(rd, n), med(rq, n)
      printf "    per connection (medians of rounds): brokkrd %.1f us of the machine'"'"'s %.1f us on nat (%.0f%%); the machine %.1f us on plain DNAT\n", med(cpu, nc), med(busy, nc), 100 * med(share, nc), med(pbusy, npb)
      nm = 0; for (r = 1; r <= n; r++) if ((r in icpu) && nok[r] > 0) marg[++nm] = (ncpu[r] - icpu[r]) / nok[r]
      if (nm) { mlo = 1e18; mhi = -1e18; for (i = 1; i <= nm; i++) { if (marg[i] < mlo) mlo = marg[i]; if (marg[i] > mhi) mhi = marg[i] }
        printf "    brokkrd beyond its idle rounds: %.2f us per nat connection [%.2f..%.2f] (nat round less idle round, medians of rounds)\n", med(marg, nm), mlo, mhi }
      printf "%s", note
      if (bad) exit 1 }' "$2"
}

for line in $KERNELS; do fetch_kernel "$line"; fetch_nft "$line"; done
if [ "$BENCH" = 1 ]; then
  payload="$cache/payload"
  echo "bench-kernels: building brokkrd, brokkr, connrate and the VM's userspace"
  build_payload "$payload"
  rc=0
  for line in $KERNELS; do
    echo "bench-kernels: booting $(cat "$cache/$line/release") under QEMU TCG"
    run_vm "$line"
    r="$cache/run-$line"
    grep '^BENCH' "$r/results.log" > "$r/bench.txt" || true
    bench_report "$(awk '/^BRK-KERNEL /{print $2; exit}' "$r/results.log") (TCG)" "$r/bench.txt" || rc=1
  done
  if [ "$HOST" = 1 ]; then
    r="$cache/run-host"; rm -rf "$r"; mkdir -p "$r"
    BIN="$payload/tests/bin" "$here/bench-vm.sh" > "$r/bench.txt" 2>&1 || rc=1
    bench_report "$(uname -r) (host)" "$r/bench.txt" || rc=1
  fi
  rm -rf "$payload" "$payload.cpio"
  exit $rc
fi
payload="$cache/payload"
echo "test-kernels: building the test binaries and the VM's userspace"
build_payload "$payload"

total_p=0 total_f=0 total_s=0
report() {
  local name=$1 log=$2 secs=$3 c
  c=$(count "$log")
  echo "kernel $name: $c (${secs}s)"
  details "$log"
  read -r p _ f _ s _ <<<"$c"
  total_p=$((total_p + p)) total_f=$((total_f + f)) total_s=$((total_s + s))
}
for line in $KERNELS; do
  echo "test-kernels: booting $(cat "$cache/$line/release") under QEMU TCG"
  run_vm "$line"
  r="$cache/run-$line"
  rel=$(awk '/^BRK-KERNEL /{print $2; exit}' "$r/results.log")
  report "${rel:-$(cat "$cache/$line/release") (did not boot: see $r/console.log)}" "$r/results.log" "$(cat "$r/seconds")"
done
if [ "$HOST" = 1 ]; then
  run_host
  report "$(uname -r) (host)" "$cache/run-host/results.log" "$(cat "$cache/run-host/seconds")"
fi
rm -rf "$payload" "$payload.cpio"
echo "kernel-matrix: $total_p passed, $total_f failed, $total_s skipped"
[ "$total_f" = 0 ]
exit
}
