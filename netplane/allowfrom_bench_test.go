package netplane

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
)

// fillerPrefixes is n masked prefixes that hold 10.99.0.2 (the benchmark's
// caller) in exactly one, a /32 among them: the rest are random IPv4 /32s
// and /24s in 10.0.0.0/8 (so the trie's path to the caller is crowded) and
// IPv6 /64s and /128s in 2001:db8::/32.
func fillerPrefixes(n int) []netip.Prefix {
	caller := netip.MustParsePrefix("10.99.0.2/32")
	out := []netip.Prefix{caller}
	seen := map[netip.Prefix]bool{caller: true}
	r := rand.New(rand.NewPCG(23, uint64(n)))
	for len(out) < n {
		var p netip.Prefix
		switch r.IntN(4) {
		case 0, 1:
			a := netip.AddrFrom4([4]byte{10, byte(r.IntN(256)), byte(r.IntN(256)), byte(r.IntN(256))})
			bits := 32
			if r.IntN(2) == 0 {
				bits = 24
			}
			p, _ = a.Prefix(bits)
		default:
			var b [16]byte
			b[0], b[1], b[2], b[3] = 0x20, 0x01, 0x0d, 0xb8
			for i := 4; i < 16; i++ {
				b[i] = byte(r.IntN(256))
			}
			bits := 64
			if r.IntN(2) == 0 {
				bits = 128
			}
			p, _ = netip.AddrFrom16(b).Prefix(bits)
		}
		if seen[p] || p.Contains(caller.Addr()) {
			continue
		}
		seen[p] = true
		out = append(out, p)
	}
	return out
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkNatAllowFrom: connections/s through the nat path for an
// exposure without allowFrom and with allowFrom lists of 1, 100 and
// 10,000 prefixes (the caller's among them), in one run: the four are
// exposures of one Plane (one port each, to one guest), measured in
// interleaved rounds in a rotated order; medians of conns/s and of the
// per-round ratios to "none". Each connection: connect, 1 byte each way,
// close, by ALLOW_CONNECTORS (4) connectors for ALLOW_SECS (2) s per
// variant per round, ALLOW_ROUNDS (7) rounds. With ALLOW_MODE=concurrent
// the four variants run at the same time in each round (ALLOW_CONNECTORS
// each), so they share the CPU under the same load at the same moment and
// the ratios do not carry the load's drift from one slot to the next. Run
// it once:
//
//	go test ./netplane -run '^$' -bench NatAllowFrom -benchtime 1x -v
func BenchmarkNatAllowFrom(b *testing.B) {
	nstest.RequireRoot(b)
	kernelfeat.Require(b, kernelfeat.NatPath...)
	rounds, secs, conns := envInt("ALLOW_ROUNDS", 7), envInt("ALLOW_SECS", 2), envInt("ALLOW_CONNECTORS", 4)
	concurrent := os.Getenv("ALLOW_MODE") == "concurrent"

	host, client := nstest.New(b, "host"), nstest.New(b, "client")
	nstest.Link(b, client, "eth0", "10.99.0.2/24", host, "up0", "10.99.0.1/24")
	other := nstest.New(b, "other")
	nstest.Link(b, other, "eth0", "10.98.0.2/24", host, "up1", "10.98.0.1/24")
	other.MustRun(b, "ip", "route", "add", "default", "via", "10.98.0.1")
	for _, ns := range []*nstest.NS{client, host} {
		ns.MustRun(b, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1", "net.ipv4.ip_local_port_range=1024 65000")
	}
	// TIME_WAIT conntrack entries for 1 s: at the default 120 s the runs
	// fill nf_conntrack_max and slow whichever variant runs next.
	if _, err := host.Run("sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1"); err != nil {
		host.MustRun(b, "modprobe", "nf_conntrack")
		host.MustRun(b, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_timeout_time_wait=1")
	}
	store, err := bpf.Open(nstest.PrivateBPFFS(b))
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
	p, err := New(Options{NetNS: host.Path, StateDir: b.TempDir(), Stats: store})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	if r := p.Converge(context.Background(), Desired{Network: network()}); r.Err != nil {
		b.Fatal(r.Err)
	}
	g := nstest.New(b, "guest")
	host.MustRun(b, "ip", "link", "add", "vh-g", "type", "veth", "peer", "name", "eth0", "netns", g.Name)
	host.MustRun(b, "ip", "link", "set", "vh-g", "master", "brokkr0", "up")
	g.MustRun(b, "ip", "addr", "add", "10.213.0.250/24", "dev", "eth0")
	g.MustRun(b, "ip", "link", "set", "eth0", "up")
	g.MustRun(b, "ip", "route", "add", "default", "via", "10.213.0.1")
	echo1(b, g, ":80")

	type variant struct {
		name string
		n    int
		port uint16
	}
	vs := []variant{{"none", 0, 8080}, {"allow1", 1, 8081}, {"allow100", 100, 8082}, {"allow10000", 10000, 8083}}
	d := Desired{Network: network()}
	for _, v := range vs {
		e := Exposure{Name: v.name, Target: spec.Target{Addr: mustAddr("10.213.0.250")}, Proto: "tcp", HostPort: v.port, GuestPort: 80, MaxConns: 256}
		if v.n > 0 {
			e.AllowFrom = fillerPrefixes(v.n)
		}
		d.Exposures = append(d.Exposures, e)
	}
	t0 := time.Now()
	rep := p.Converge(context.Background(), d)
	if rep.Err != nil {
		b.Fatal(rep.Err)
	}
	b.Logf("first pass with 10,101 prefixes: %v", time.Since(t0))
	for _, r := range rep.Exposures {
		if r.State != spec.StateActive {
			b.Fatalf("%s: %s %s", r.Name, r.State, r.Reason)
		}
	}
	t0 = time.Now()
	if r := p.Converge(context.Background(), d); r.Err != nil {
		b.Fatal(r.Err)
	}
	b.Logf("a steady pass: %v", time.Since(t0))
	// The lists are in force: a caller outside them is dropped and denied.
	for _, v := range vs[1:] {
		if c, err := dialShort(other, "10.99.0.1:"+strconv.Itoa(int(v.port))); err == nil {
			c.Close()
			b.Fatalf("%s: a caller outside allowFrom was carried", v.name)
		}
		if c, _ := store.Lookup(v.name); c.Denied != 1 {
			b.Fatalf("%s: denied %d, want 1", v.name, c.Denied)
		}
	}

	rate := map[string][]float64{}
	ratio := map[string][]float64{}
	for r := 0; r < rounds; r++ {
		got := map[string]float64{}
		if concurrent {
			var mu sync.Mutex
			var wg sync.WaitGroup
			for _, v := range vs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					n := connRate(b, client, "10.99.0.1:"+strconv.Itoa(int(v.port)), conns, time.Duration(secs)*time.Second)
					mu.Lock()
					got[v.name] = n
					mu.Unlock()
				}()
			}
			wg.Wait()
			for _, v := range vs {
				rate[v.name] = append(rate[v.name], got[v.name])
			}
		} else {
			for i := range vs {
				v := vs[(i+r)%len(vs)]
				got[v.name] = connRate(b, client, "10.99.0.1:"+strconv.Itoa(int(v.port)), conns, time.Duration(secs)*time.Second)
				rate[v.name] = append(rate[v.name], got[v.name])
			}
		}
		for _, v := range vs[1:] {
			ratio[v.name] = append(ratio[v.name], got[v.name]/got["none"])
		}
		b.Logf("round %d: none %.0f, allow1 %.0f, allow100 %.0f, allow10000 %.0f conns/s", r+1,
			got["none"], got["allow1"], got["allow100"], got["allow10000"])
	}
	for _, v := range vs {
		b.ReportMetric(median(rate[v.name]), v.name+"-conns/s")
		if v.n > 0 {
			b.ReportMetric(median(ratio[v.name]), v.name+"/none")
			b.Logf("%s: median %.0f conns/s, median ratio to none %.3f (rounds %s)", v.name, median(rate[v.name]),
				median(ratio[v.name]), fmtRatios(ratio[v.name]))
		}
	}
	for _, v := range vs[1:] {
		if c, _ := store.Lookup(v.name); c.Denied != 1 {
			b.Fatalf("%s: denied %d after the runs: the allowed caller was denied", v.name, c.Denied)
		}
	}
}

func fmtRatios(rs []float64) string {
	s := ""
	for i, r := range rs {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("%.2f", r)
	}
	return s
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// echo1 serves on addr inside ns: one byte back for one byte, then close.
func echo1(tb testing.TB, ns *nstest.NS, addr string) {
	var ln net.Listener
	if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp4", addr); return err }); err != nil {
		tb.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				buf := make([]byte, 1)
				if _, err := io.ReadFull(c, buf); err == nil {
					_, _ = c.Write(buf)
					_, _ = c.Read(buf) // until the caller closes
				}
			}()
		}
	}()
	tb.Cleanup(func() { ln.Close(); wg.Wait() })
}

// connRate runs n connectors in ns against addr for d: connect, 1 byte
// each way, close. Connections per second completed.
func connRate(tb testing.TB, ns *nstest.NS, addr string, n int, d time.Duration) float64 {
	var done, failed atomic.Int64
	var wg sync.WaitGroup
	stop := time.Now().Add(d)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = ns.Do(func() error {
				buf := []byte{'x'}
				for time.Now().Before(stop) {
					c, err := net.DialTimeout("tcp4", addr, 2*time.Second)
					if err != nil {
						failed.Add(1)
						continue
					}
					_ = c.SetDeadline(time.Now().Add(2 * time.Second))
					if _, err := c.Write(buf); err == nil {
						if _, err := io.ReadFull(c, buf); err == nil {
							done.Add(1)
						} else {
							failed.Add(1)
						}
					} else {
						failed.Add(1)
					}
					c.Close()
				}
				return nil
			})
		}()
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		tb.Logf("%s: %d connections failed", addr, f)
	}
	return float64(done.Load()) / d.Seconds()
}
