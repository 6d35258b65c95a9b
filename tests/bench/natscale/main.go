// Command natscale drives netplane/nft for the nat benchmark (tests/bench/nat.sh):
//
//	natscale apply  -ns HOSTNS -guest IP -map HOSTPORT:GUESTPORT[,...] [-cap N]
//	natscale connrate -ns CLIENTNS -addr IP:PORT -n N
//	natscale serve  -ns GUESTNS -addr :7000   (accepts and closes, until killed)
//	natscale scale  -ns HOSTNS -client CLIENTNS -guest IP -guestport P -hostaddr IP
//
// It only ever touches namespaces named on its command line.
package main

import (
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
	return nft.Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"), Gateway: netip.MustParseAddr("10.213.0.1"),
		Masquerade: true, DHCP: true}
}

func apply(args []string) error {
	fs := flag.NewFlagSet("apply", flag.ExitOnError)
	ns := fs.String("ns", "", "host namespace path")
	guest := fs.String("guest", "", "guest address")
	maps := fs.String("map", "", "hostport:guestport,...")
	capN := fs.Int("cap", 0, "maxConns per exposure")
	_ = fs.Parse(args)
	g := netip.MustParseAddr(*guest)
	r := baseRules(g)
	for i, m := range strings.Split(*maps, ",") {
		hp, gp, _ := strings.Cut(m, ":")
		h, _ := strconv.Atoi(hp)
		gg, _ := strconv.Atoi(gp)
		r.Exposures = append(r.Exposures, nft.Exposure{Name: fmt.Sprintf("e%d", i), Protocol: "tcp",
			HostPort: uint16(h), GuestAddr: g, GuestPort: uint16(gg), MaxConns: *capN})
	}
	t, err := nft.Open(*ns, nft.WithoutCapWatcher())
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

// scale: apply 1, 100, 1,000, 10,000 exposures (one Converge each, timed),
// then one more exposure at each size (timed), then connect latency to the
// first and the last exposure at the largest size; then the same latency
// for a linear one-rule-per-exposure chain (the anchor) in a separate table
// of the bench namespace.
func scale(args []string) error {
	fs := flag.NewFlagSet("scale", flag.ExitOnError)
	ns := fs.String("ns", "", "host namespace path")
	client := fs.String("client", "", "client namespace path")
	guest := fs.String("guest", "10.213.0.11", "guest address")
	gport := fs.Int("guestport", 7000, "guest port")
	hostAddr := fs.String("hostaddr", "10.99.0.1", "host address the client dials")
	sizes := fs.String("sizes", "1,10,100,1000,10000", "")
	n := fs.Int("n", 2000, "connections per latency sample")
	withLat := fs.Bool("latency", true, "also measure first/last latency and the linear anchor")
	cpuProf := fs.String("cpuprofile", "", "write a CPU profile of the applies to this file")
	_ = fs.Parse(args)
	if *cpuProf != "" {
		f, err := os.Create(*cpuProf)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	g := netip.MustParseAddr(*guest)
	t, err := nft.Open(*ns, nft.WithoutCapWatcher())
	if err != nil {
		return err
	}
	defer t.Close()
	exps := func(k int) []nft.Exposure {
		out := make([]nft.Exposure, k)
		for i := range out {
			out[i] = nft.Exposure{Name: fmt.Sprintf("x%05d", i), Protocol: "tcp", HostPort: uint16(20000 + i),
				GuestAddr: g, GuestPort: uint16(*gport), MaxConns: 0}
		}
		return out
	}
	var last int
	for _, s := range strings.Split(*sizes, ",") {
		k, _ := strconv.Atoi(s)
		if err := t.Delete(); err != nil {
			return err
		}
		r := baseRules(g)
		r.Exposures = exps(k)
		t0 := time.Now()
		if _, err := t.Converge(r); err != nil {
			return err
		}
		applyT := time.Since(t0)
		// One more change: add the (k+1)th exposure, median of 5.
		var ch []time.Duration
		for i := 0; i < 5; i++ {
			r.Exposures = exps(k + 1)
			t0 = time.Now()
			if _, err := t.Converge(r); err != nil {
				return err
			}
			ch = append(ch, time.Since(t0))
			r.Exposures = exps(k)
			if _, err := t.Converge(r); err != nil {
				return err
			}
		}
		sort.Slice(ch, func(i, j int) bool { return ch[i] < ch[j] })
		fmt.Printf("map n=%d apply=%v one-more=%v\n", k, applyT.Round(time.Microsecond), ch[2].Round(time.Microsecond))
		last = k
	}
	if !*withLat {
		return nil
	}
	lat := func(label, port string) error {
		return inNS(*client, func() error {
			l, err := connLatency(*hostAddr+":"+port, *n)
			if err != nil {
				return err
			}
			mean, p50 := stats(l)
			fmt.Printf("%s mean=%v p50=%v\n", label, mean.Round(time.Microsecond), p50.Round(time.Microsecond))
			return nil
		})
	}
	// Interleave first/last twice to even out machine noise.
	for round := 0; round < 2; round++ {
		if err := lat(fmt.Sprintf("map n=%d first(20000)", last), "20000"); err != nil {
			return err
		}
		if err := lat(fmt.Sprintf("map n=%d last(%d)", last, 20000+last-1), strconv.Itoa(20000+last-1)); err != nil {
			return err
		}
	}
	// Anchor: the same exposures as one DNAT rule each in a linear chain.
	if err := t.Delete(); err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "table ip linear {\n chain pre { type nat hook prerouting priority dstnat; policy accept;\n")
	for i := 0; i < last; i++ {
		fmt.Fprintf(&b, "  tcp dport %d fib daddr type local dnat to %s:%d\n", 20000+i, g, *gport)
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
	if out, err := exec.Command("nsenter", "--net="+*ns, "nft", "-f", f.Name()).CombinedOutput(); err != nil {
		return fmt.Errorf("linear anchor: %v: %s", err, out)
	}
	fmt.Printf("linear n=%d apply(nft -f)=%v\n", last, time.Since(t0).Round(time.Microsecond))
	for round := 0; round < 2; round++ {
		if err := lat(fmt.Sprintf("linear n=%d first(20000)", last), "20000"); err != nil {
			return err
		}
		if err := lat(fmt.Sprintf("linear n=%d last(%d)", last, 20000+last-1), strconv.Itoa(20000+last-1)); err != nil {
			return err
		}
	}
	_ = exec.Command("nsenter", "--net="+*ns, "nft", "delete", "table", "ip", "linear").Run()
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
