package daemon

import (
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
)

// SocketPath is the eBPF socket path (bpf.SockLB): auto exposures'
// host-local callers are sent to the guest when their socket connects, so
// no loopback proxy is needed.
type SocketPath interface {
	SetTarget(host netip.Addr, proto uint32, hostPort uint16, t bpf.SockTarget) error
	DeleteTarget(host netip.Addr, proto uint32, hostPort uint16) error
	SetLocalAddrs(addrs []netip.Addr) error
	// CloseStale closes the callers' sockets whose translation no longer
	// holds (the socket path's counterpart of the conntrack flush).
	CloseStale() (int, error)
}

type sockKey struct {
	host  netip.Addr
	proto uint32
	port  uint16
}

// sockPath is what the control loop put into the socket path: the
// translations and the counter slots it holds for them.
type sockPath struct {
	lb        SocketPath
	store     *bpf.Store
	slots     map[string]*bpf.Slot
	have      map[sockKey]bpf.SockTarget // what each translation was set to
	localAddr func() ([]netip.Addr, error)
}

func newSockPath(lb SocketPath, store *bpf.Store) *sockPath {
	return &sockPath{lb: lb, store: store, slots: map[string]*bpf.Slot{}, have: map[sockKey]bpf.SockTarget{}, localAddr: interfaceAddrs}
}

// interfaceAddrs lists the daemon's namespace's own addresses.
func interfaceAddrs() ([]netip.Addr, error) {
	as, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range as {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out, nil
}

// converge makes the translations match c: one per auto exposure, to the
// guest's current address (refusing at once while it has none), and for
// IPv6 callers to its IPv6 address where lookup6 has one. It returns each
// exposure's part for the status.
func (p *sockPath) converge(m *spec.Desired, lookup, lookup6 func(vm string) (netip.Addr, bool)) (map[string]part, error) {
	var errs []error
	if addrs, err := p.localAddr(); err != nil {
		errs = append(errs, fmt.Errorf("socket path: local addresses: %w", err))
	} else if err := p.lb.SetLocalAddrs(addrs); err != nil {
		errs = append(errs, err)
	}
	parts := map[string]part{}
	want := map[sockKey]bpf.SockTarget{}
	stale := false // a translation moved or went: its callers' sockets must follow
	wantSlots := map[string]bool{}
	for _, e := range m.Exposures {
		if !e.UsesSocketPath() {
			continue
		}
		proto := bpf.ProtoNumber(string(e.Proto))
		sl := p.slots[e.Name]
		if sl == nil {
			var err error
			if sl, err = p.store.Attach(e.Name, proto, e.HostPort); err != nil {
				parts[e.Name] = part{"socket", spec.StateFailed, err.Error()}
				continue
			}
			p.slots[e.Name] = sl
		}
		wantSlots[e.Name] = true
		sl.SetCap(uint32(e.MaxConns))
		t := bpf.SockTarget{Slot: sl.Index()}
		g := e.Target.Addr
		t.Guest6 = e.Target.Addr6
		if e.Target.IsVM() {
			g, _ = lookup(e.Target.VM) // the zero Addr while it has none
			t.Guest6, _ = lookup6(e.Target.VM)
		}
		if !g.Is4() {
			// No IPv4 address yet: its callers are refused at once
			// rather than left to time out; with no address at all,
			// every caller is.
			g = netip.IPv4Unspecified()
			t.Down = !t.Guest6.IsValid()
		}
		// A wildcard of either family, or of both, is the one wildcard key:
		// host-local callers of both families are served (docs/ARCHITECTURE.md,
		// "The socket path").
		host := e.HostAddr
		if e.Wildcard() {
			host = netip.IPv4Unspecified()
		}
		// One translation per port: a range's, each to its guest port, all
		// in the one slot (the connect hook looks up the port dialled).
		var setErr error
		for _, port := range e.HostPorts() {
			t.Guest = netip.AddrPortFrom(g, e.GuestPortOf(port))
			k := sockKey{host, proto, port}
			want[k] = t
			if old, ok := p.have[k]; ok && old != t {
				stale = true
			}
			if err := p.lb.SetTarget(k.host, k.proto, k.port, t); err != nil {
				setErr = err
				break
			}
		}
		if setErr != nil {
			parts[e.Name] = part{"socket", spec.StateFailed, setErr.Error()}
			continue
		}
		if t.Down {
			parts[e.Name] = part{"socket", spec.StatePending, ""}
		} else {
			parts[e.Name] = part{"socket", spec.StateActive, ""}
		}
	}
	for k, t := range p.have {
		if _, ok := want[k]; ok {
			continue
		}
		if err := p.lb.DeleteTarget(k.host, k.proto, k.port); err != nil {
			errs = append(errs, err)
			want[k] = t // try again next pass
			continue
		}
		stale = true
	}
	p.have = want
	if stale {
		if _, err := p.lb.CloseStale(); err != nil {
			errs = append(errs, err)
		}
	}
	for name, sl := range p.slots {
		if !wantSlots[name] {
			sl.Release(false) // Prune frees it once no path holds it
			delete(p.slots, name)
		}
	}
	return parts, errors.Join(errs...)
}
