// Package nstest gives tests and benchmarks network namespaces of their own,
// named brk-*, deleted on cleanup (also when the test fails), so nothing ever
// touches the root namespace's links, routes, nftables or sysctls.
package nstest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/brokkr/brokkr/internal/nlsafe"
	"github.com/brokkr/brokkr/internal/procfs"
	"golang.org/x/sys/unix"
)

// NS is one named network namespace under /run/netns.
type NS struct {
	Name string
	Path string
}

// Privileged reports whether tests may use root: as root, and unless
// BROKKR_TEST_UNPRIVILEGED is set (the fast lane, make test-unit, runs the
// pure tests alone).
func Privileged() bool {
	return os.Geteuid() == 0 && os.Getenv("BROKKR_TEST_UNPRIVILEGED") == ""
}

// PrivateBPFFS mounts a bpffs of the test's own on a temp dir (unmounted at
// cleanup), so pins never touch the host's /sys/fs/bpf. Skips without root.
func PrivateBPFFS(t testing.TB) string {
	t.Helper()
	if !Privileged() {
		t.Skip("needs root: mounts a bpffs and creates BPF maps")
	}
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, ""); err != nil {
		t.Fatalf("mount bpffs on %s: %v", dir, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// SmallTmpfs mounts a tmpfs of size bytes of the test's own (a disk that
// fills up) on a temporary directory, unmounted when the test ends.
func SmallTmpfs(t testing.TB, size int64) string {
	t.Helper()
	if !Privileged() {
		t.Skip("needs root: mounts a tmpfs")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, fmt.Sprintf("size=%d,mode=0700", size)); err != nil {
		t.Fatalf("mount tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// RequireRoot skips the test when not running as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if !Privileged() {
		t.Skip("needs root: creates network namespaces")
	}
}

// Name derives a short, unique namespace name from the test name and a role:
// brk-<hash>-<role>. netns names become file names and device-free, but short
// names keep `ip netns list` readable.
func Name(t testing.TB, role string) string {
	// The package directory (go test runs each package's binary there)
	// keeps equal test names in two packages, or two checkouts running at
	// once, apart; the test name keeps tests apart.
	wd, _ := os.Getwd()
	sum := sha256.Sum256([]byte(wd + "/" + filepath.Base(os.Args[0]) + "/" + t.Name()))
	return "brk-" + hex.EncodeToString(sum[:4]) + "-" + role
}

// New creates the namespace brk-<hash>-<role> with lo up, and deletes it when
// the test ends.
func New(t testing.TB, role string) *NS {
	t.Helper()
	RequireRoot(t)
	name := Name(t, role)
	_ = exec.Command("ip", "netns", "delete", name).Run() // a leftover of a killed run
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	n := &NS{Name: name, Path: "/run/netns/" + name}
	t.Cleanup(func() { n.Delete() })
	n.MustRun(t, "ip", "link", "set", "lo", "up")
	return n
}

// Delete removes the namespace. Processes still inside keep it alive until
// they exit, so callers kill their children first.
func (n *NS) Delete() {
	_ = exec.Command("ip", "netns", "delete", n.Name).Run()
}

// Command builds a command that runs inside the namespace. It enters only the
// network namespace (nsenter --net), unlike `ip netns exec`, so the caller's
// mount namespace and with it /sys/fs/bpf stay visible.
func (n *NS) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"--net=" + n.Path, "--", name}, args...)...)
}

// Run runs a command in the namespace and returns its combined output.
func (n *NS) Run(name string, args ...string) (string, error) {
	out, err := n.Command(name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s (in %s): %w: %s", name, strings.Join(args, " "), n.Name, err, out)
	}
	return string(out), nil
}

// MustRun is Run that fails the test on error.
func (n *NS) MustRun(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := n.Run(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Do runs fn on a locked OS thread switched into the namespace. Sockets made
// inside fn belong to the namespace and stay there after Do returns. If the
// thread cannot be switched back it is left locked so the runtime discards it.
func (n *NS) Do(fn func() error) error { return nlsafe.Do(n.Path, fn) }

// Link joins two namespaces with a veth pair and addresses both ends
// (CIDR form, e.g. "10.99.0.1/24"); either address may be "".
func Link(t testing.TB, a *NS, aIf, aAddr string, b *NS, bIf, bAddr string) {
	t.Helper()
	// Created from inside a, so the pair never appears in the root namespace.
	if _, err := a.Run("ip", "link", "add", aIf, "type", "veth", "peer", "name", bIf, "netns", b.Name); err != nil {
		t.Fatalf("veth %s/%s: %v", aIf, bIf, err)
	}
	for _, e := range []struct {
		ns        *NS
		ifc, cidr string
	}{{a, aIf, aAddr}, {b, bIf, bAddr}} {
		if e.cidr != "" {
			e.ns.MustRun(t, "ip", "addr", "add", e.cidr, "dev", e.ifc)
		}
		e.ns.MustRun(t, "ip", "link", "set", e.ifc, "up")
	}
}

// ServeTCP answers every connection to addr (network tcp, tcp4 or tcp6)
// inside the namespace with handle, each in a goroutine of its own, until
// the test ends. At cleanup the listener and every connection still open
// are closed (a test that fails with a caller's connection open must not
// wait on it for ever) and the handlers are waited for.
func (n *NS) ServeTCP(t testing.TB, network, addr string, handle func(net.Conn)) {
	t.Helper()
	var ln net.Listener
	if err := n.Do(func() (err error) { ln, err = net.Listen(network, addr); return err }); err != nil {
		t.Fatalf("server on %s %s in %s: %v", network, addr, n.Name, err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]struct{}{}
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Go(func() {
				handle(c)
				c.Close()
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			})
		}
	})
}

// AnswerPort is a ServeTCP handler: it writes the port the connection came
// in on, one line, and keeps the connection until the caller closes.
func AnswerPort(c net.Conn) {
	_, _ = c.Write([]byte(strconv.Itoa(c.LocalAddr().(*net.TCPAddr).Port) + "\n"))
	_, _ = c.Read(make([]byte, 1))
}

// ServeEcho runs TCP and UDP echo servers on addr (IPv4, or IPv6 in
// brackets) inside the namespace until the test ends: a guest service for
// tests of the data paths.
func (n *NS) ServeEcho(t testing.TB, addr string) {
	t.Helper()
	tcp, udp := "tcp4", "udp4"
	if ap, err := netip.ParseAddrPort(addr); err == nil && ap.Addr().Is6() {
		tcp, udp = "tcp6", "udp6" // an IPv6 address ("[::]:7000")
	}
	n.ServeTCP(t, tcp, addr, func(c net.Conn) { _, _ = io.Copy(c, c) })
	var pc net.PacketConn
	if err := n.Do(func() (err error) { pc, err = net.ListenPacket(udp, addr); return err }); err != nil {
		t.Fatalf("echo server on %s in %s: %v", addr, n.Name, err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 65536)
		for {
			k, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:k], from)
		}
	}()
}

// LiveProcs lists the processes whose command line contains every one of
// words, zombies left out: how tests find the VMMs a daemon started (by
// their runDir or binary) without a daemon to ask.
func LiveProcs(words ...string) []int {
	var pids []int
	for _, p := range procfs.FindProcs(func(cmd []byte) bool {
		for _, w := range words {
			if !bytes.Contains(cmd, []byte(w)) {
				return false
			}
		}
		return true
	}) {
		pids = append(pids, p.PID)
	}
	return pids
}

// JoinCgroup creates a child cgroup of the test's own under the cgroup v2
// hierarchy mounted at root, moves this test process into it (the socket
// path's programs attach there, never to the root), and at cleanup moves
// it back and removes the child. It returns the child's path.
func JoinCgroup(t testing.TB, root string) string {
	t.Helper()
	orig := ""
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			orig = p
		}
	}
	if orig == "" {
		t.Fatal("this process has no cgroup v2 path")
	}
	dir := filepath.Join(root, Name(t, "cg"))
	_ = os.Remove(dir) // a leftover of a killed run
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	t.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(root, orig, "cgroup.procs"), pid, 0); err != nil {
			t.Errorf("moving back to %s: %v", orig, err)
		}
		if err := os.Remove(dir); err != nil {
			t.Errorf("removing cgroup %s: %v", dir, err)
		}
	})
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0); err != nil {
		t.Fatal(err)
	}
	return dir
}
