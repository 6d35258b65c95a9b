package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane"
)

// kernelRig is a daemon on a real network plane in a host namespace of
// its own, with n nat exposures of a guest at 10.213.0.250 (a namespace on
// the bridge serving echo on :80) on host ports 20001.., converged by one
// pass; callers dial from a client namespace (10.99.0.2) to 10.99.0.1.
// With pinned the counters are a pinned store in a bpffs of its own, as
// brokkrd runs (the BPF nat path loads where the kernel has it); else an
// in-memory store (the nat path's fallback).
func kernelRig(tb testing.TB, n int, role string, pinned bool) (d *Daemon, echo func(addr string) error) {
	tb.Helper()
	host, client := nstest.New(tb, "host"+role), nstest.New(tb, "client"+role)
	nstest.Link(tb, client, "eth0", "10.99.0.2/24", host, "up0", "10.99.0.1/24")
	// Past 40,000 a port of its own for each needs more host addresses:
	// blocks of 40,000 on 10.99.K.1 (10.99.0.1 first, where the client
	// calls), each a local address of the host; as many as the most
	// exposures a host holds need, whatever n (an apply may add more).
	for k := 1; k*exposureBlock < spec.MaxExposures; k++ {
		host.MustRun(tb, "ip", "addr", "add", fmt.Sprintf("10.99.%d.1/32", k), "dev", "up0")
	}
	client.MustRun(tb, "ip", "route", "add", "10.99.0.0/16", "via", "10.99.0.1")
	cfg, err := config.Parse([]byte(exposuresYAML(n)))
	if err != nil {
		tb.Fatal(err)
	}
	cfg.StateDir, cfg.RunDir = tb.TempDir(), shortDirTB(tb)
	store := bpf.NewInMemory("test")
	if pinned {
		if store, err = bpf.Open(nstest.PrivateBPFFS(tb)); err != nil {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() { _ = store.Close() })
	plane, err := netplane.New(netplane.Options{NetNS: host.Path, StateDir: cfg.StateDir, Stats: store})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = plane.Close() })
	c := &calls{}
	addrs := NewAddressBook()
	d, err = New(Options{Host: cfg, Store: store, Supervisor: &recSup{calls: c}, Network: plane,
		Proxy: &recProxy{calls: c, resolve: addrs.Resolve}, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Timeout: time.Minute})
	if err != nil {
		tb.Fatal(err)
	}
	d.Pass(context.Background())

	g := nstest.New(tb, "guest"+role)
	host.MustRun(tb, "ip", "link", "add", "vh-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	host.MustRun(tb, "ip", "link", "set", "vh-g", "master", "brokkr0", "up")
	g.MustRun(tb, "ip", "addr", "add", "10.213.0.250/24", "dev", "eth0")
	g.MustRun(tb, "ip", "link", "set", "eth0", "up")
	g.MustRun(tb, "ip", "route", "add", "default", "via", "10.213.0.1")
	g.ServeEcho(tb, ":80")
	echo = func(addr string) error {
		var conn net.Conn
		if err := client.Do(func() (err error) { conn, err = nstest.DialEcho(addr, "hi"); return err }); err != nil {
			return err
		}
		return conn.Close()
	}
	if err := echo("10.99.0.1:20001"); err != nil {
		tb.Fatal("the first exposure is not served:", err)
	}
	return d, echo
}

// exposureBlock is how many exposures kernelRig puts on one host address.
const exposureBlock = 40000

// exposuresYAML is the exposures: list of kernelRig's n exposures, e-0..,
// each on a host port (and address) of its own, one flow mapping a line.
func exposuresYAML(n int) string {
	return exposuresAs(n, "  - {name: e-%d, target: 10.213.0.250, guestPort: 80, hostAddress: 10.99.%d.1, hostPort: %d, mode: nat}\n")
}

// exposuresBlockYAML is exposuresYAML's document in block style, a line
// per field, as yaml.Marshal and most generators write it.
func exposuresBlockYAML(n int) string {
	return exposuresAs(n, "    - name: e-%d\n      target: 10.213.0.250\n      guestPort: 80\n      hostAddress: 10.99.%d.1\n      hostPort: %d\n      mode: nat\n")
}

// exposuresAs writes the exposures: list with entry, formatted with the
// exposure's number, its host address's block and its host port.
func exposuresAs(n int, entry string) string {
	var y strings.Builder
	y.WriteString("exposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&y, entry, i, i/exposureBlock, 20001+i%exposureBlock)
	}
	return y.String()
}

// BenchmarkApplyToActive is `brokkr apply` of a document of 100,000 nat
// exposures onto a daemon with one (natpath, pinned as brokkrd runs), from
// the request until every exposure is active: POST /v1/apply, the pass it
// wakes (run here at once, as the woken loop runs it), and a caller served
// through the last exposure. Each iteration goes back to the one exposure
// outside the timing. s-p50 is the median; s-request-p50 and s-pass-p50
// the medians of its two parts, the request and the pass.
func BenchmarkApplyToActive(b *testing.B) {
	const n = 100000
	d, echo := kernelRig(b, 1, "apl", true)
	h := d.Handler()
	apply := func(body string) {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("POST", "/v1/apply", strings.NewReader(body)))
		if w.Code != http.StatusOK {
			b.Fatal("apply", w.Code, w.Body.String())
		}
	}
	one := exposuresYAML(1)
	last := fmt.Sprintf("10.99.%d.1:%d", (n-1)/exposureBlock, 20001+(n-1)%exposureBlock)
	for _, doc := range []struct{ format, whole string }{
		{"yaml", exposuresYAML(n)}, {"yaml-block", exposuresBlockYAML(n)}, {"json", exposuresJSON(n)},
	} {
		b.Run(fmt.Sprintf("natpath/exposures=%d/%s", n, doc.format), func(b *testing.B) { applyToActive(b, d, apply, echo, doc.whole, one, last, n) })
	}
}

// exposuresJSON is exposuresYAML's document as JSON, as a program that
// writes 100,000 exposures would send it.
func exposuresJSON(n int) string {
	var y strings.Builder
	y.WriteString(`{"exposures": [`)
	for i := 0; i < n; i++ {
		if i > 0 {
			y.WriteString(",")
		}
		fmt.Fprintf(&y, "\n  {\"name\": \"e-%d\", \"target\": \"10.213.0.250\", \"guestPort\": 80, \"hostAddress\": \"10.99.%d.1\", \"hostPort\": %d, \"mode\": \"nat\"}",
			i, i/exposureBlock, 20001+i%exposureBlock)
	}
	y.WriteString("\n]}\n")
	return y.String()
}

// applyToActive times b.N applies of whole, each back to one after it.
func applyToActive(b *testing.B, d *Daemon, apply func(string), echo func(string) error, whole, one, last string, n int) {
	var took, req, pass []time.Duration
	for i := 0; i < b.N; i++ {
		start := time.Now()
		apply(whole)
		applied := time.Now()
		d.Pass(context.Background())
		req, pass = append(req, applied.Sub(start)), append(pass, time.Since(applied))
		if err := echo(last); err != nil {
			b.Fatal("the last exposure is not served:", err)
		}
		took = append(took, time.Since(start))
		b.StopTimer()
		active := 0
		for _, e := range d.Status().Exposures {
			if e.State == string(spec.StateActive) {
				active++
			}
		}
		if active != n {
			b.Fatalf("%d of %d exposures active", active, n)
		}
		apply(one)
		d.Pass(context.Background())
		b.StartTimer()
	}
	for _, x := range [][]time.Duration{took, req, pass} {
		slices.Sort(x)
	}
	b.ReportMetric(took[len(took)/2].Seconds(), "s-p50")
	b.ReportMetric(took[len(took)-1].Seconds(), "s-max")
	b.ReportMetric(req[len(req)/2].Seconds(), "s-request-p50")
	b.ReportMetric(pass[len(pass)/2].Seconds(), "s-pass-p50")
}

// shortDirTB is shortDir for a benchmark too.
func shortDirTB(tb testing.TB) string {
	dir, err := os.MkdirTemp("", "brk-dm-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// BenchmarkPutToServed is one exposure more through PUT /v1/exposures/{name},
// from the request until a caller outside is served by it (an echo through
// the guest), on the real network plane (needs root), at 10 and at 10,000
// exposures, with the counters pinned as brokkrd runs (natpath) and in
// memory (the nat path's fallback); no pass runs in between. The exposure is removed again outside
// the timing. ms-p50 is the median.
func BenchmarkPutToServed(b *testing.B) {
	for _, tc := range []struct {
		path   string
		pinned bool
		n      int
	}{{"natpath", true, 10}, {"natpath", true, 10000}, {"fallback", false, 10}, {"fallback", false, 10000}} {
		n := tc.n
		d, echo := kernelRig(b, n, fmt.Sprint(n)+tc.path[:1], tc.pinned)
		h := d.Handler()
		call := func(method, path, body string) {
			w := httptest.NewRecorder()
			h.ServeHTTP(w, httptest.NewRequest(method, path, strings.NewReader(body)))
			if w.Code != http.StatusOK {
				b.Fatal(method, path, w.Code, w.Body.String())
			}
		}
		b.Run(fmt.Sprintf("%s/exposures=%d", tc.path, n), func(b *testing.B) { putToServed(b, call, echo) })
	}
}

// BenchmarkPutToServedAtLimit is BenchmarkPutToServed at the most
// exposures a host holds (spec.MaxExposures, 131,072: the counter slot
// map's size), natpath.
func BenchmarkPutToServedAtLimit(b *testing.B) {
	n := spec.MaxExposures - 1
	d, echo := kernelRig(b, n, "lim", true)
	h := d.Handler()
	call := func(method, path, body string) {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(method, path, strings.NewReader(body)))
		if w.Code != http.StatusOK {
			b.Fatal(method, path, w.Code, w.Body.String())
		}
	}
	b.Run(fmt.Sprintf("natpath/exposures=%d", n), func(b *testing.B) { putToServed(b, call, echo) })
}

// BenchmarkChangesPerSecond is changes of one exposure (add, then remove
// again) through the API from 8 concurrent clients, each acknowledged once
// persisted (the journal's fsync) and published to the kernel, on the real
// network plane at 10,000 exposures (natpath): with the control loop
// running as in brokkrd (each change wakes a pass; loop=on), and without
// it (the API's share alone; loop=off). changes/s counts PUTs and DELETEs
// answered.
func BenchmarkChangesPerSecond(b *testing.B) {
	const n, clients = 10000, 8
	d, _ := kernelRig(b, n, "cps", true)
	h := d.Handler()
	for _, loop := range []bool{false, true} {
		b.Run(fmt.Sprintf("natpath/exposures=%d/clients=%d/loop=%s", n, clients, map[bool]string{false: "off", true: "on"}[loop]), func(b *testing.B) {
			if loop {
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { d.Run(ctx); close(done) }()
				defer func() { cancel(); <-done }()
			}
			var wg sync.WaitGroup
			var count atomic.Int64
			b.ResetTimer()
			start := time.Now()
			for c := range clients {
				wg.Go(func() {
					for i := c; i < b.N; i += clients {
						name := fmt.Sprintf("x-%d", c)
						body := fmt.Sprintf(`{"target": "10.213.0.250", "guestPort": 80, "hostPort": %d, "mode": "nat"}`, 40001+c)
						for _, r := range [][3]string{{"PUT", "/v1/exposures/" + name, body}, {"DELETE", "/v1/exposures/" + name, ""}} {
							w := httptest.NewRecorder()
							h.ServeHTTP(w, httptest.NewRequest(r[0], r[1], strings.NewReader(r[2])))
							if w.Code != http.StatusOK {
								b.Error(r[0], r[1], w.Code, w.Body.String())
								return
							}
							count.Add(1)
						}
					}
				})
			}
			wg.Wait()
			b.ReportMetric(float64(count.Load())/time.Since(start).Seconds(), "changes/s")
		})
	}
}

// putToServed times b.N PUTs of one more nat exposure, each from the
// request to a caller served through it (echo), removing it again outside
// the timing, and reports the median.
func putToServed(b *testing.B, call func(method, path, body string), echo func(addr string) error) {
	var took []time.Duration
	for i := 0; i < b.N; i++ {
		start := time.Now()
		call("PUT", "/v1/exposures/extra", `{"target": "10.213.0.250", "guestPort": 80, "hostPort": 19999, "mode": "nat"}`)
		if err := echo("10.99.0.1:19999"); err != nil {
			b.Fatal("not served after the PUT:", err)
		}
		took = append(took, time.Since(start))
		b.StopTimer()
		call("DELETE", "/v1/exposures/extra", "")
		b.StartTimer()
	}
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "ms-p50")
}
