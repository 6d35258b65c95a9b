package netplane

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// BenchmarkConverge measures the pass the daemon runs every tick with
// nothing to change (steady state), for N guests, and reports the time of
// the first pass that builds the N taps (and the nft table's exposures).
func BenchmarkConverge(b *testing.B) {
	for _, c := range []struct{ n, exps int }{{1, 0}, {10, 0}, {100, 0}, {250, 0}, {10, 100}, {100, 1000}} {
		n := c.n
		name := fmt.Sprintf("guests=%d", n)
		if c.exps > 0 {
			name += fmt.Sprintf(",exposures=%d", c.exps)
		}
		b.Run(name, func(b *testing.B) {
			ns := nstest.New(b, "host")
			p, err := New(Options{NetNS: ns.Path, StateDir: b.TempDir()})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			net := network()
			net.DHCP = false
			d := Desired{Network: net}
			for i := 0; i < n; i++ {
				d.Guests = append(d.Guests, Guest{Name: fmt.Sprintf("vm-%04d", i)})
			}
			for i := 0; i < c.exps; i++ {
				d.Exposures = append(d.Exposures, Exposure{Name: fmt.Sprintf("exp-%05d", i), Target: spec.Target{VM: d.Guests[i%n].Name},
					Proto: "tcp", HostPort: uint16(10000 + i), GuestPort: 80, MaxConns: 16})
			}
			start := time.Now()
			if r := p.Converge(context.Background(), d); r.Err != nil {
				b.Fatal(r.Err)
			}
			first := time.Since(start)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if r := p.Converge(context.Background(), d); r.Err != nil || len(r.Repaired) > 0 {
					b.Fatal(r.Err, r.Repaired)
				}
			}
			b.StopTimer()
			perPass := b.Elapsed() / time.Duration(b.N)
			// Baseline, same namespace, same run: one plain link dump, the
			// least any pass that looks at the kernel must spend.
			const dumps = 20
			t0 := time.Now()
			for i := 0; i < dumps; i++ {
				if _, err := p.links.Links(); err != nil {
					b.Fatal(err)
				}
			}
			dump := time.Since(t0) / dumps
			b.ReportMetric(float64(first.Microseconds())/1000, "first-pass-ms")
			b.ReportMetric(float64(dump.Microseconds())/1000, "linkdump-ms")
			b.ReportMetric(float64(perPass)/float64(dump), "pass/linkdump")
		})
	}
}
