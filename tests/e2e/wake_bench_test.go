package e2e

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
)

// BenchmarkWakeVersusColdBoot is issue 24's benchmark: one brokkrd, the
// test guest (256 MiB, TCG), callers from the client namespace. Each round
// (BROKKR_WAKE_RUNS, default 5) measures, interleaved:
//   - wake through the nat path, and again through an uncapped proxy
//     exposure: the VM suspended (vm suspend --wait), then one caller, from
//     its connect (its first SYN) to the first byte of its answer;
//   - cold: the VM stopped (vm stop --wait), then vm start and the guest's
//     address dialled from the host every 50 ms (300 ms timeouts, past
//     every exposure's counters): from the start to the first answer.
//
// While suspended it also reads what the VM holds on the host: its
// hypervisor processes (none: 0 bytes of RSS) and how much of its state
// file sits in the page cache (mincore).
//
//	go test -run '^$' -bench WakeVersusColdBoot -benchtime 1x ./tests/e2e/
func BenchmarkWakeVersusColdBoot(b *testing.B) {
	runs := 5
	if v, err := strconv.Atoi(os.Getenv("BROKKR_WAKE_RUNS")); err == nil && v > 0 {
		runs = v
	}
	e := benchEnv(b)
	st0 := e.status() // the counters before the rounds (benchEnv's polls while booting)
	x0, _ := exposure(st0, "web-proxy")
	n0, _ := exposure(st0, "web-nat")
	var natWakes, proxyWakes, colds []float64
	var rss, cached, state []int64
	for i := range runs {
		for _, w := range []struct {
			addr string
			into *[]float64
		}{{hostIP + ":8080", &natWakes}, {hostIP + ":8180", &proxyWakes}} {
			e.must("vm", "suspend", vmName, "--wait", "--timeout", "2m")
			r, c, s := e.suspendedFootprint()
			rss, cached, state = append(rss, r), append(cached, c), append(state, s)
			_, first, err := getSlowly(e.client, w.addr)
			if err != nil {
				b.Fatalf("round %d: the waking caller through %s: %v", i, w.addr, err)
			}
			*w.into = append(*w.into, first.Seconds())
			e.waitPhase("running")
		}

		// cold boot
		addr := vm(e.status(), vmName).Address + ":8080"
		e.must("vm", "stop", vmName, "--wait", "--timeout", "2m")
		t0 := time.Now()
		e.must("vm", "start", vmName)
		for {
			if body, err := getQuick(e.host, addr); err == nil && strings.Contains(body, "brokkr-guest") {
				break
			}
			if time.Since(t0) > 2*time.Minute {
				b.Fatalf("round %d: the cold-booted guest never answered", i)
			}
			time.Sleep(50 * time.Millisecond)
		}
		colds = append(colds, time.Since(t0).Seconds())
		e.waitPhase("running")
	}
	st := e.status()
	x, _ := exposure(st, "web-proxy")
	n, _ := exposure(st, "web-nat")
	med := func(v []float64) float64 { s := slices.Clone(v); slices.Sort(s); return s[len(s)/2] }
	spread := func(v []float64) string {
		s := slices.Clone(v)
		slices.Sort(s)
		return fmt.Sprintf("%.2f–%.2f", s[0], s[len(s)-1])
	}
	b.Logf("wake, nat (first SYN → answer):   median %.2f s (%s), n=%d: %.2f", med(natWakes), spread(natWakes), runs, natWakes)
	b.Logf("wake, proxy (connect → answer):   median %.2f s (%s), n=%d: %.2f", med(proxyWakes), spread(proxyWakes), runs, proxyWakes)
	b.Logf("cold boot (vm start → answer):    median %.2f s (%s), n=%d: %.2f", med(colds), spread(colds), runs, colds)
	b.Logf("wake / cold boot: nat %.2f, proxy %.2f", med(natWakes)/med(colds), med(proxyWakes)/med(colds))
	b.Logf("while suspended: hypervisor RSS %v bytes, state in page cache %v bytes, state on disk %v bytes", rss, cached, state)
	b.Logf("during the rounds: web-nat accepted %d, refused %d, dropped %d; web-proxy accepted %d, refused %d, dropped %d",
		n.Accepted-n0.Accepted, n.Refused-n0.Refused, n.Dropped-n0.Dropped, x.Accepted-x0.Accepted, x.Refused-x0.Refused, x.Dropped-x0.Dropped)
	b.ReportMetric(med(natWakes), "wake-nat-s-median")
	b.ReportMetric(med(proxyWakes), "wake-proxy-s-median")
	b.ReportMetric(med(colds), "cold-s-median")
	b.ReportMetric(float64(x.Refused-x0.Refused+n.Refused-n0.Refused), "refused")
	b.ReportMetric(float64(slices.Max(rss)), "suspended-rss-bytes")
}

// benchEnv is newEnv for a benchmark: its own daemon with web-proxy,
// booted and serving.
func benchEnv(b *testing.B) *env {
	b.Helper()
	guest := requireVM(b)
	e := &env{t: b, fixture: newFixture(b, "e2w")}
	e.guest = guest
	b.Cleanup(e.logOnFailure)
	if err := os.WriteFile(e.cfgPath, []byte(e.config(allExposures+webProxy)), 0o600); err != nil {
		b.Fatal(err)
	}
	e.startDaemon()
	out, errs, code := e.brokkr("apply", "-f", e.cfgPath, "--wait", "--timeout", "4m")
	if code != 0 {
		b.Fatalf("apply --wait: %s %s", out, errs)
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		if body, err := httpGet(e.client, hostIP+":8180"); err == nil && strings.Contains(body, "brokkr-guest") {
			return e
		}
		if time.Now().After(deadline) {
			b.Fatal("the guest never answered")
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (e *env) must(args ...string) {
	e.t.Helper()
	out, errs, code := e.brokkr(args...)
	if code != 0 {
		e.t.Fatalf("brokkr %v: %s %s", args, out, errs)
	}
}

func (e *env) waitPhase(phase string) {
	e.t.Helper()
	e.waitStatus("the VM "+phase, 2*time.Minute, func(st api.Status) bool { return vm(st, vmName).Phase == phase })
}

// getQuick is one GET with short timeouts (a poll while the guest boots).
func getQuick(ns *nstest.NS, addr string) (string, error) {
	c, err := dial(ns, addr, 300*time.Millisecond)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: guest\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// suspendedFootprint is what a suspended VM holds on the host: the RSS of
// its hypervisor processes (there should be none), the bytes of its state
// file in the page cache, and the state's size on disk.
func (e *env) suspendedFootprint() (rss, cached, onDisk int64) {
	for _, pid := range e.vmmPIDs() {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
		if f := strings.Fields(string(b)); len(f) > 1 {
			pages, _ := strconv.ParseInt(f[1], 10, 64)
			rss += pages * int64(os.Getpagesize())
		}
	}
	dir := filepath.Join(e.state, "vms", vmName, "suspend")
	ents, _ := os.ReadDir(dir)
	for _, ent := range ents {
		p := filepath.Join(dir, ent.Name())
		fi, err := os.Stat(p)
		if err != nil || fi.Size() == 0 {
			continue
		}
		onDisk += fi.Size()
		cached += residentBytes(p, fi.Size())
	}
	return rss, cached, onDisk
}

// residentBytes is how much of the file at p is in the page cache
// (mincore over a read-only mapping, which itself faults nothing in).
func residentBytes(p string, size int64) int64 {
	f, err := os.Open(p)
	if err != nil {
		return 0
	}
	defer f.Close()
	m, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0
	}
	defer unix.Munmap(m)
	page := os.Getpagesize()
	vec := make([]byte, (len(m)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return 0
	}
	var n int64
	for _, v := range vec {
		if v&1 != 0 {
			n += int64(page)
		}
	}
	return n
}
