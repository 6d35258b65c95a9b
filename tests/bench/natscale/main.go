// Command natscale drives netplane/nft for the nat benchmark (tests/bench/nat.sh):
//
//	natscale apply  -ns HOSTNS -guest IP [-guest6 IP6 -subnet6 P] -map HOSTPORT:GUESTPORT[,...] [-cap N] [-marksonly]
//	natscale connrate -ns CLIENTNS -addr IP:PORT -n N
//	natscale serve  -ns GUESTNS -addr :7000   (accepts and closes, until killed)
//	natscale scale  -ns HOSTNS -client CLIENTNS -guest IP -guestport P -hostaddrs IP,IP [-csv FILE]
//	natscale changes -ns HOSTNS -guest IP -guestport P -hostaddrs IP,IP [-rounds R] [-csv FILE]
//
// It only ever touches namespaces named on its command line.
package main

import (
	"encoding/csv"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/brokkr/brokkr/netplane/nft"
	"github.com/vishvananda/netns"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: natscale apply|connrate|scale ...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "apply":
		err = apply(os.Args[2:])
	case "connrate":
		err = connrate(os.Args[2:])
	case "scale":
		err = scale(os.Args[2:])
	case "changes":
		err = changes(os.Args[2:])
	case "serve":
		err = serve(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "natscale:", err)
		os.Exit(1)
	}
}

func baseRules(guest netip.Addr) nft.Rules {
	return nft.Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"),
		Masquerade: true, DHCP: true}
}

func apply(args []string) error {
	fs := flag.NewFlagSet("apply", flag.ExitOnError)
	ns := fs.String("ns", "", "host namespace path")
	guest := fs.String("guest", "", "guest address")
	maps := fs.String("map", "", "hostport:guestport,...")
	capN := fs.Int("cap", 0, "maxConns per exposure")
	guest6 := fs.String("guest6", "", "guest IPv6 address: the exposures are published on both families")
	subnet6 := fs.String("subnet6", "fd00:6272:6b72::1/64", "the bridge's IPv6 address and prefix (with -guest6)")
	marksOnly := fs.Bool("marksonly", false, "the table of the BPF nat path (marks and DNAT; the programs hold the cap), not the set-based cap")
	_ = fs.Parse(args)
	g := netip.MustParseAddr(*guest)
	r := baseRules(g)
	var g6 netip.Addr
	if *guest6 != "" {
		g6 = netip.MustParseAddr(*guest6)
		r.Subnet6 = netip.MustParsePrefix(*subnet6)
	}
	// Exposure i has mark id i+1: the nat path's counter slot i.
	for i, m := range strings.Split(*maps, ",") {
		hp, gp, _ := strings.Cut(m, ":")
		h, _ := strconv.Atoi(hp)
		gg, _ := strconv.Atoi(gp)
		r.Exposures = append(r.Exposures, nft.Exposure{Name: fmt.Sprintf("e%d", i), Protocol: "tcp",
			HostPort: uint16(h), GuestAddr: g, GuestAddr6: g6, GuestPort: uint16(gg), MaxConns: *capN, MarkID: uint32(i + 1)})
	}
	if *marksOnly {
		r.Cap = nft.MarksOnly{}
	} else if *capN > 0 {
		// The kernel refuses over the cap by itself (no watcher, no slow
		// path: the rule path alone).
		r.Cap = nft.SetBasedCap{}
	}
	t, err := nft.Open(*ns)
	if err != nil {
		return err
	}
	defer t.Close()
	_, err = t.Converge(r)
	return err
}

// inNS runs fn on a thread in the namespace at path.
func inNS(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		h, err := netns.GetFromPath(path)
		if err != nil {
			errc <- err
			return
		}
		defer h.Close()
		if err := netns.Set(h); err != nil {
			errc <- err
			return
		}
		errc <- fn()
	}()
	return <-errc
}

// connLatency makes n sequential connect+close and returns the sorted
// connect times.
func connLatency(addr string, n int) ([]time.Duration, error) {
	lat := make([]time.Duration, 0, n)
	for i := 0; i < n; i++ {
		t0 := time.Now()
		c, err := net.DialTimeout("tcp4", addr, 2*time.Second)
		if err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(t0))
		c.(*net.TCPConn).SetLinger(0) // RST: no TIME_WAIT pile-up in the client
		c.Close()
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat, nil
}

func stats(l []time.Duration) (mean, p50 time.Duration) {
	var sum time.Duration
	for _, d := range l {
		sum += d
	}
	return sum / time.Duration(len(l)), l[len(l)/2]
}

func connrate(args []string) error {
	fs := flag.NewFlagSet("connrate", flag.ExitOnError)
	ns := fs.String("ns", "", "client namespace path")
	addr := fs.String("addr", "", "ip:port")
	n := fs.Int("n", 3000, "connections")
	_ = fs.Parse(args)
	return inNS(*ns, func() error {
		t0 := time.Now()
		l, err := connLatency(*addr, *n)
		if err != nil {
			return err
		}
		el := time.Since(t0)
		mean, p50 := stats(l)
		fmt.Printf("connrate %s n=%d rate=%.0f/s mean=%v p50=%v\n", *addr, *n, float64(*n)/el.Seconds(), mean.Round(time.Microsecond), p50.Round(time.Microsecond))
		return nil
	})
}

// scale: at each size, one Converge of that many exposures into an emptied
// table (timed), one more exposure (median of 5), and connect latency to the
// last exposure through the table against the guest routed directly,
// interleaved in the same minute. Exposures are in the production mode
// (MarksOnly, marks + DNAT only; no BPF program is needed for the DNAT
// itself). Each size becomes a row of the CSV at -csv, for tests/bench/plot.
// Optionally the linear-chain anchor at one size (-linear).
func scale(args []string) error {
	fs := flag.NewFlagSet("scale", flag.ExitOnError)
	ns := fs.String("ns", "", "host namespace path")
	client := fs.String("client", "", "client namespace path")
	guest := fs.String("guest", "10.213.0.11", "guest address")
	gport := fs.Int("guestport", 7000, "guest port")
	hostAddrs := fs.String("hostaddrs", "10.99.0.1,10.99.1.1", "host addresses the client dials, filled in order, "+
		"55,000 ports each (a port is 16 bits: 100,000 exposures need two addresses)")
	sizes := fs.String("sizes", "10,100,1000,10000,100000", "")
	n := fs.Int("n", 1000, "connections per latency sample (two samples each for direct and nat at every size)")
	withLat := fs.Bool("latency", true, "also measure connect latency at each size")
	linear := fs.Int("linear", 0, "also measure the linear one-rule-per-exposure anchor at this size (0 = no)")
	csvPath := fs.String("csv", "", "write one CSV row per size here")
	cpuProf := fs.String("cpuprofile", "", "write a CPU profile of the applies to this file")
	_ = fs.Parse(args)
	stop, err := cpuProfile(*cpuProf)
	if err != nil {
		return err
	}
	defer stop()
	g := netip.MustParseAddr(*guest)
	var addrs []netip.Addr
	for _, a := range strings.Split(*hostAddrs, ",") {
		addrs = append(addrs, netip.MustParseAddr(a))
	}
	const portBase, perAddr = 10000, 55000 // ports 10000..64999
	// where is the host address and port of exposure i.
	where := func(i int) (netip.Addr, uint16) {
		return addrs[i/perAddr], uint16(portBase + i%perAddr)
	}
	var ks []int
	for _, s := range strings.Split(*sizes, ",") {
		k, err := strconv.Atoi(s)
		if err != nil || k < 1 || k+1 > perAddr*len(addrs) {
			return fmt.Errorf("size %q: 1 .. %d with %d host addresses", s, perAddr*len(addrs)-1, len(addrs))
		}
		ks = append(ks, k)
	}
	var out *csv.Writer
	if *csvPath != "" {
		f, err := os.Create(*csvPath)
		if err != nil {
			return err
		}
		defer f.Close()
		out = csv.NewWriter(f)
		fmt.Fprintf(f, "# natscale scale %s kernel=%s cores=%d n=%d\n", time.Now().UTC().Format(time.RFC3339), kernelRelease(), runtime.NumCPU(), *n)
		out.Write(csvHeader)
	}
	t, err := nft.Open(*ns)
	if err != nil {
		return err
	}
	defer t.Close()
	exps := func(k int) []nft.Exposure {
		out := make([]nft.Exposure, k)
		for i := range out {
			a, p := where(i)
			out[i] = nft.Exposure{Name: fmt.Sprintf("x%06d", i), Protocol: "tcp", HostAddr: a, HostPort: p,
				GuestAddr: g, GuestPort: uint16(*gport), MarkID: uint32(i + 1)}
		}
		return out
	}
	// sample is connect latency to addr from the client namespace.
	sample := func(addr string) ([]time.Duration, error) {
		var l []time.Duration
		err := inNS(*client, func() (err error) { l, err = connLatency(addr, *n); return })
		return l, err
	}
	direct := fmt.Sprintf("%s:%d", g, *gport)
	// Phase 1, timing, before any traffic: the conntrack flush inside every
	// Converge walks the namespace's connections, so a size timed after
	// another size's latency samples pays for their entries (~50 ms per
	// change at 10 exposures here, against <1 ms with none).
	rows := make([]scaleRow, len(ks))
	for j, k := range ks {
		if err := t.Delete(); err != nil {
			return err
		}
		r := baseRules(g)
		r.Cap = nft.MarksOnly{}
		r.Exposures = exps(k)
		runtime.GC() // the previous size's garbage is not this apply's
		t0 := time.Now()
		if _, err := t.Converge(r); err != nil {
			return err
		}
		applyT := time.Since(t0)
		// One more change: add the (k+1)th exposure, median of 5.
		var ch []time.Duration
		more := exps(k + 1)
		for i := 0; i < 5; i++ {
			r.Exposures = more
			t0 = time.Now()
			if _, err := t.Converge(r); err != nil {
				return err
			}
			ch = append(ch, time.Since(t0))
			r.Exposures = more[:k]
			if _, err := t.Converge(r); err != nil {
				return err
			}
		}
		sortDur(ch)
		rows[j] = scaleRow{exposures: k, apply: applyT, oneMore: ch[2]}
		fmt.Printf("map n=%d apply=%v one-more=%v\n", k, us(applyT), us(ch[2]))
	}
	// Phase 2, latency: each size applied again (untimed), then connect
	// latency to its last exposure and to the guest directly.
	for j, k := range ks {
		if !*withLat {
			break
		}
		if err := t.Delete(); err != nil {
			return err
		}
		r := baseRules(g)
		r.Cap = nft.MarksOnly{}
		r.Exposures = exps(k)
		if _, err := t.Converge(r); err != nil {
			return err
		}
		la, lp := where(k - 1)
		last := fmt.Sprintf("%s:%d", la, lp)
		var d, m []time.Duration
		// Two interleaved rounds even out the machine's noise between the
		// two paths.
		for round := 0; round < 2; round++ {
			ld, err := sample(direct)
			if err != nil {
				return err
			}
			lm, err := sample(last)
			if err != nil {
				return fmt.Errorf("%d exposures, last %s: %w", k, last, err)
			}
			d, m = append(d, ld...), append(m, lm...)
		}
		sortDur(d)
		sortDur(m)
		row := &rows[j]
		row.natP50, row.natP99 = pct(m, 50), pct(m, 99)
		row.directP50, row.directP99 = pct(d, 50), pct(d, 99)
		fmt.Printf("map n=%d last=%s p50=%v p99=%v direct p50=%v p99=%v\n", k, last, us(row.natP50), us(row.natP99), us(row.directP50), us(row.directP99))
	}
	if out != nil {
		for _, row := range rows {
			out.Write(row.record())
		}
		out.Flush()
		if err := out.Error(); err != nil {
			return err
		}
	}
	if *withLat && *linear > 0 {
		return linearAnchor(*ns, *client, g, *gport, *hostAddrs, *linear, *n, t)
	}
	return nil
}

// csvHeader is the scale CSV's header; tests/bench/plot reads these names.
var csvHeader = []string{"exposures", "apply_ms", "one_more_ms", "nat_p50_us", "nat_p99_us", "direct_p50_us", "direct_p99_us"}

// scaleRow is one size's measurements (latencies zero without -latency).
type scaleRow struct {
	exposures                            int
	apply, oneMore                       time.Duration
	natP50, natP99, directP50, directP99 time.Duration
}

func (r scaleRow) record() []string {
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 3, 64) }
	u := func(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e3, 'f', 1, 64) }
	return []string{strconv.Itoa(r.exposures), ms(r.apply), ms(r.oneMore), u(r.natP50), u(r.natP99), u(r.directP50), u(r.directP99)}
}

func sortDur(l []time.Duration) { sort.Slice(l, func(i, j int) bool { return l[i] < l[j] }) }

// pct is the p-th percentile (nearest rank) of sorted l.
func pct(l []time.Duration, p int) time.Duration {
	i := (len(l)*p + 99) / 100
	if i < 1 {
		i = 1
	}
	return l[i-1]
}

func us(d time.Duration) time.Duration { return d.Round(time.Microsecond) }

func kernelRelease() string {
	b, err := os.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(b))
}

// linearAnchor: the same k exposures as one DNAT rule each in a linear chain
// of a separate table (brokkr's table deleted first), connect latency to the
// first and the last, two interleaved rounds.
func linearAnchor(ns, client string, g netip.Addr, gport int, hostAddr string, k, n int, t *nft.Table) error {
	addr, _, _ := strings.Cut(hostAddr, ",")
	if k > 55000 {
		return fmt.Errorf("linear anchor: at most 55,000 (one host address)")
	}
	if err := t.Delete(); err != nil {
		return err
	}
	lat := func(label, port string) error {
		return inNS(client, func() error {
			l, err := connLatency(addr+":"+port, n)
			if err != nil {
				return err
			}
			mean, p50 := stats(l)
			fmt.Printf("%s mean=%v p50=%v p99=%v\n", label, us(mean), us(p50), us(pct(l, 99)))
			return nil
		})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "table ip linear {\n chain pre { type nat hook prerouting priority dstnat; policy accept;\n")
	for i := 0; i < k; i++ {
		fmt.Fprintf(&b, "  tcp dport %d fib daddr type local dnat to %s:%d\n", 10000+i, g, gport)
	}
	fmt.Fprintf(&b, " }\n chain post { type nat hook postrouting priority srcnat; policy accept; ct status dnat oifname \"br0\" ip saddr 10.213.0.0/24 masquerade; }\n}\n")
	f, err := os.CreateTemp("", "linear-*.nft")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	f.WriteString(b.String())
	f.Close()
	t0 := time.Now()
	if out, err := exec.Command("nsenter", "--net="+ns, "nft", "-f", f.Name()).CombinedOutput(); err != nil {
		return fmt.Errorf("linear anchor: %v: %s", err, out)
	}
	fmt.Printf("linear n=%d apply(nft -f)=%v\n", k, us(time.Since(t0)))
	defer exec.Command("nsenter", "--net="+ns, "nft", "delete", "table", "ip", "linear").Run()
	for round := 0; round < 2; round++ {
		if err := lat(fmt.Sprintf("linear n=%d first(10000)", k), "10000"); err != nil {
			return err
		}
		if err := lat(fmt.Sprintf("linear n=%d last(%d)", k, 10000+k-1), strconv.Itoa(10000+k-1)); err != nil {
			return err
		}
	}
	return nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	ns := fs.String("ns", "", "namespace path")
	addr := fs.String("addr", ":7000", "listen address")
	_ = fs.Parse(args)
	var ln net.Listener
	if err := inNS(*ns, func() (err error) { ln, err = net.Listen("tcp4", *addr); return }); err != nil {
		return err
	}
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		c.Close()
	}
}

// cpuProfile starts a CPU profile into path ("" none); stop ends it.
func cpuProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
