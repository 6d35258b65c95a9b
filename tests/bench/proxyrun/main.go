// Command proxyrun runs brokkr's proxy.Manager from flags, for the proxy
// benchmark (tests/bench/proxy.sh): each -e publishes host:port to a guest
// address, converged once a second the way the daemon does.
//
//	proxyrun -e 10.77.1.1:6201=10.77.2.2:5201 -e udp:10.77.1.1:6301=10.77.2.2:5301
//	proxyrun -e ppv2:10.77.1.1:7301=10.77.2.2:7001   (a PROXY header, v1 or v2, to the guest)
package main

import (
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/proxy"
)

type exposures []string

func (e *exposures) String() string     { return strings.Join(*e, ",") }
func (e *exposures) Set(v string) error { *e = append(*e, v); return nil }

func main() {
	var es exposures
	flag.Var(&es, "e", "[tcp:|udp:|ppv1:|ppv2:]HOST:PORT=GUEST:PORT (repeatable)")
	maxConns := flag.Int("max", 0, "per-exposure connection cap (0 = unlimited)")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile here until stopped")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fail("%v", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fail("%v", err)
		}
		defer pprof.StopCPUProfile()
	}

	guests := map[string]string{}
	var specs []proxy.Spec
	for i, e := range es {
		proto := "tcp"
		var pp spec.ProxyProtocol
		if p, rest, ok := strings.Cut(e, ":"); ok && (p == "tcp" || p == "udp") {
			proto, e = p, rest
		} else if ok && (p == "ppv1" || p == "ppv2") {
			pp, e = spec.ProxyProtocol(strings.TrimPrefix(p, "pp")), rest
		}
		host, guest, ok := strings.Cut(e, "=")
		if !ok {
			fail("-e %q: want HOST:PORT=GUEST:PORT", e)
		}
		ha, hp := split(host)
		ga, gp := split(guest)
		vm := "g" + strconv.Itoa(i)
		guests[vm] = ga
		var addr netip.Addr // "" (":PORT") is every IPv4 address
		if ha != "" {
			addr, _ = netip.ParseAddr(ha)
		}
		if ha != "" && !addr.IsValid() {
			fail("-e %q: %q is not an IP address", e, ha)
		}
		specs = append(specs, proxy.Spec{Exposure: spec.Exposure{Name: fmt.Sprintf("bench-%d", i), Target: spec.Target{VM: vm}, Proto: spec.Proto(proto), HostPort: uint16(hp), GuestPort: uint16(gp), MaxConns: *maxConns, ProxyProtocol: pp}, Listen: addr})
	}
	m := proxy.NewManager(func(vm string) string { return guests[vm] }, nil)
	defer m.StopAll()
	for _, st := range m.Converge(specs) {
		if st.State != proxy.StateActive {
			fail("%s: %s %s", st.ID, st.State, st.Reason)
		}
		fmt.Println("ready", st.ID, st.BoundAddr)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-sig:
			return
		case <-tick.C:
			m.Converge(specs)
		}
	}
}

func split(hp string) (string, int) {
	h, p, err := net.SplitHostPort(hp)
	if err != nil {
		fail("%q: %v", hp, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		fail("%q: %v", hp, err)
	}
	return h, n
}

func fail(f string, a ...any) {
	fmt.Fprintf(os.Stderr, "proxyrun: "+f+"\n", a...)
	os.Exit(1)
}
