package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/config"
)

// BenchmarkPass measures the daemon's own share of one control-loop pass
// (translating the desired state for the three engines, resolving, merging
// the reports and the counters into the status, pruning slots) with engines
// that answer at once; compare the per-exposure cost at 100 and 10,000
// exposures. The loop runs every second, so this must stay far below that.
func BenchmarkPass(b *testing.B) {
	for _, n := range []int{100, 10000} {
		b.Run(fmt.Sprintf("exposures=%d", n), func(b *testing.B) {
			var y strings.Builder
			y.WriteString("network: {cidr: 10.0.0.1/16}\nvms:\n")
			vms := max(1, n/10)
			for i := 0; i < vms; i++ {
				fmt.Fprintf(&y, "  - {name: vm-%d, kernel: /k}\n", i)
			}
			y.WriteString("exposures:\n")
			for i := 0; i < n; i++ {
				mode := []string{"nat", "proxy", "auto"}[i%3]
				fmt.Fprintf(&y, "  - {name: e-%d, vm: vm-%d, guestPort: 80, hostPort: %d, mode: %s}\n", i, i%vms, 1+i%65000, mode)
			}
			host, err := config.Parse([]byte(y.String()))
			if err != nil {
				b.Fatal(err)
			}
			host.StateDir, host.RunDir = b.TempDir(), b.TempDir()
			c := &calls{}
			addrs := NewAddressBook()
			store := bpf.NewInMemory("bench")
			defer store.Close()
			for i := 0; i < n; i++ {
				s, err := store.Attach(fmt.Sprintf("e-%d", i), bpf.ProtoTCP, uint16(1+i%65000))
				if err != nil {
					b.Fatal(err)
				}
				defer s.Release(false)
			}
			d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: &calls{}}, Network: &recNet{calls: &calls{}, leased: true},
				Proxy: &recProxy{calls: c, resolve: addrs.Resolve}, Addresses: addrs,
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				d.Pass(context.Background())
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/exposure")
		})
	}
}

// BenchmarkStatusRequest measures one GET /v1/status (the merged status,
// the live counters and the JSON) at 1,000 exposures: the soak asks for it
// to stay under 100 ms while the API is under attack.
func BenchmarkStatusRequest(b *testing.B) {
	const n = 1000
	var y strings.Builder
	y.WriteString("network: {cidr: 10.0.0.1/16}\nvms:\n  - {name: vm-0, kernel: /k}\nexposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&y, "  - {name: e-%d, vm: vm-0, guestPort: 80, hostPort: %d, mode: nat}\n", i, 1+i)
	}
	host, err := config.Parse([]byte(y.String()))
	if err != nil {
		b.Fatal(err)
	}
	host.StateDir, host.RunDir = b.TempDir(), b.TempDir()
	addrs := NewAddressBook()
	store := bpf.NewInMemory("bench")
	defer store.Close()
	for i := 0; i < n; i++ {
		s, err := store.Attach(fmt.Sprintf("e-%d", i), bpf.ProtoTCP, uint16(1+i))
		if err != nil {
			b.Fatal(err)
		}
		defer s.Release(false)
	}
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: &calls{}}, Network: &recNet{calls: &calls{}, leased: true},
		Proxy: &recProxy{calls: &calls{}, resolve: addrs.Resolve}, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	d.Pass(context.Background())
	h := d.Handler()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest("GET", "/v1/status", nil))
		if w.Code != 200 {
			b.Fatal(w.Code)
		}
		b.SetBytes(int64(w.Body.Len()))
	}
}

// BenchmarkOneMoreExposure is one exposure more at 10 and at 10,000 through
// PUT /v1/exposures/{name} against the same change through POST /v1/apply
// of the whole document (the only way before), each from the request to
// its answer (the desired state validated, persisted with fsync and swapped
// in; for PUT the one exposure handed to the network plane), with engines
// that answer at once: the daemon's own share, not the kernel's. The
// exposure is removed again outside the timing.
func BenchmarkOneMoreExposure(b *testing.B) {
	for _, n := range []int{10, 10000} {
		oneMoreExposure(b, n)
	}
}

func oneMoreExposure(b *testing.B, n int) {
	doc := natDoc(n)
	more := doc + "  - {name: extra, vm: vm-0, guestPort: 80, hostPort: 65000, mode: nat}\n"
	for _, path := range []string{"put", "apply"} {
		b.Run(fmt.Sprintf("%s/exposures=%d", path, n), func(b *testing.B) {
			d := benchDaemon(b, doc)
			h := d.Handler()
			call := func(method, path, body string) {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest(method, path, strings.NewReader(body)))
				if w.Code != 200 {
					b.Fatal(method, path, w.Code, w.Body.String())
				}
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if path == "put" {
					call("PUT", "/v1/exposures/extra", `{"vm": "vm-0", "guestPort": 80, "hostPort": 65000, "mode": "nat"}`)
					b.StopTimer()
					call("DELETE", "/v1/exposures/extra", "")
				} else {
					call("POST", "/v1/apply", more)
					b.StopTimer()
					call("POST", "/v1/apply", doc)
				}
				b.StartTimer()
			}
		})
	}
}

// BenchmarkChangesPerSecondAPI is BenchmarkChangesPerSecond with engines
// that answer at once (no root): the daemon's share of a change alone —
// checked against the index, journaled with group commit (a real fsync in
// the test's temp dir) and swapped in — at 10 and 10,000 exposures, 8
// clients.
func BenchmarkChangesPerSecondAPI(b *testing.B) {
	for _, n := range []int{10, 10000} {
		changesPerSecondAPI(b, n)
	}
}

func changesPerSecondAPI(b *testing.B, n int) {
	const clients = 8
	d := benchDaemon(b, natDoc(n))
	h := d.Handler()
	b.Run(fmt.Sprintf("exposures=%d/clients=%d", n, clients), func(b *testing.B) {
		var wg sync.WaitGroup
		var count atomic.Int64
		start := time.Now()
		for c := range clients {
			wg.Go(func() {
				for i := c; i < b.N; i += clients {
					name := fmt.Sprintf("x-%d", c)
					body := fmt.Sprintf(`{"vm": "vm-0", "guestPort": 80, "hostPort": %d, "mode": "nat"}`, 40001+c)
					for _, r := range [][3]string{{"PUT", "/v1/exposures/" + name, body}, {"DELETE", "/v1/exposures/" + name, ""}} {
						w := httptest.NewRecorder()
						h.ServeHTTP(w, httptest.NewRequest(r[0], r[1], strings.NewReader(r[2])))
						if w.Code != 200 {
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

// natDoc is a config of n nat exposures over n/10 VMs (at least one), on
// host ports 1.. .
func natDoc(n int) string {
	vms := max(1, n/10)
	var y strings.Builder
	y.WriteString("network: {cidr: 10.0.0.1/16}\nvms:\n")
	for i := 0; i < vms; i++ {
		fmt.Fprintf(&y, "  - {name: vm-%d, kernel: /k}\n", i)
	}
	y.WriteString("exposures:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&y, "  - {name: e-%d, vm: vm-%d, guestPort: 80, hostPort: %d, mode: nat}\n", i, i%vms, 1+i)
	}
	return y.String()
}

// benchDaemon is a daemon on doc with engines that answer at once (an
// updater network plane), after its first pass.
func benchDaemon(b *testing.B, doc string) *Daemon {
	b.Helper()
	host, err := config.Parse([]byte(doc))
	if err != nil {
		b.Fatal(err)
	}
	run, err := os.MkdirTemp("", "brk-b-")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(run) })
	host.StateDir, host.RunDir = b.TempDir(), run
	addrs := NewAddressBook()
	store := bpf.NewInMemory("bench")
	b.Cleanup(func() { store.Close() })
	un := &updNet{recNet: &recNet{calls: &calls{}, leased: true}}
	d, err := New(Options{Host: host, Store: store, Supervisor: &recSup{calls: &calls{}}, Network: un,
		Proxy: &recProxy{calls: &calls{}, resolve: addrs.Resolve}, Addresses: addrs,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	d.Pass(context.Background())
	return d
}
