// Package ipam gives each VM a stable IPv4 address (and MAC) in the bridge
// subnet, persisted in stateDir/netplane/leases.json so that a restarted
// daemon hands every guest the same address again.
//
// A lease lives exactly as long as its VM is in the desired state: Reconcile
// keeps the leases of desired VMs, frees the others, and assigns new ones. A
// new VM starts probing at an offset derived from its name, so even a lost
// leases file tends to give the same addresses back, and a freed address is
// not the next one handed out.
package ipam

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"

	"github.com/brokkr/brokkr/internal/atomicfile"
)

// FileName is the leases file inside the pool's directory.
const FileName = "leases.json"

// Lease is one VM's address and MAC.
type Lease struct {
	VM   string
	Addr netip.Addr
	MAC  net.HardwareAddr
}

// Pool is the set of live leases, mirrored on disk.
type Pool struct {
	mu     sync.Mutex
	path   string
	leases map[string]Lease
}

// Open loads dir/leases.json (a missing file is an empty pool). A file that
// does not parse is an error, never silently replaced: it holds the only
// record of which guest has which address.
func Open(dir string) (*Pool, error) {
	p := &Pool{path: filepath.Join(dir, FileName), leases: map[string]Lease{}}
	b, err := os.ReadFile(p.path)
	if errors.Is(err, os.ErrNotExist) {
		return p, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading leases: %w", err)
	}
	ls, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", p.path, err)
	}
	for _, l := range ls {
		p.leases[l.VM] = l
	}
	return p, nil
}

// Leases returns a copy of the live leases by VM name.
func (p *Pool) Leases() map[string]Lease {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]Lease, len(p.leases))
	for k, v := range p.leases {
		out[k] = v
	}
	return out
}

// Request is what Reconcile needs: the subnet (with the bridge's own
// address), the desired VMs, addresses that must never be leased (explicit
// exposure targets), and how to derive a VM's MAC (attempt > 0 on collision).
type Request struct {
	Bridge   netip.Prefix // e.g. 10.213.0.1/24
	VMs      []string
	Reserved []netip.Addr
	MAC      func(vm string, attempt int) net.HardwareAddr
}

// Reconcile makes the leases match req: leases of VMs no longer desired are
// freed, a kept lease whose address left the subnet or became reserved gets a
// new address (its MAC stays), and new VMs get a MAC and an address. The
// result is persisted before it becomes visible; if that fails nothing
// changes. VMs that cannot get an address (subnet full) are in failed.
func (p *Pool) Reconcile(req Request) (leases map[string]Lease, failed map[string]error, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	subnet := req.Bridge.Masked()
	if !subnet.Addr().Is4() {
		return nil, nil, fmt.Errorf("subnet %s is not IPv4", req.Bridge)
	}
	blocked := map[netip.Addr]bool{req.Bridge.Addr(): true}
	for _, a := range req.Reserved {
		blocked[a] = true
	}
	want := map[string]bool{}
	for _, vm := range req.VMs {
		want[vm] = true
	}
	next := map[string]Lease{}
	usedAddr := map[netip.Addr]bool{}
	usedMAC := map[string]bool{}
	keep := sortedKeys(p.leases)
	for _, vm := range keep {
		l := p.leases[vm]
		if !want[vm] {
			continue
		}
		if !usable(subnet, l.Addr) || blocked[l.Addr] || usedAddr[l.Addr] {
			l.Addr = netip.Addr{}
		} else {
			usedAddr[l.Addr] = true
		}
		usedMAC[l.MAC.String()] = true
		next[vm] = l
	}
	failed = map[string]error{}
	vms := append([]string(nil), req.VMs...)
	sort.Strings(vms)
	for _, vm := range vms {
		l, ok := next[vm]
		if !ok {
			l = Lease{VM: vm}
			for attempt := 0; ; attempt++ {
				mac := req.MAC(vm, attempt)
				if !usedMAC[mac.String()] {
					l.MAC = mac
					usedMAC[mac.String()] = true
					break
				}
			}
		}
		if !l.Addr.IsValid() {
			a, ok := pick(subnet, vm, func(a netip.Addr) bool { return blocked[a] || usedAddr[a] })
			if !ok {
				failed[vm] = fmt.Errorf("no free address in %s", subnet)
				continue
			}
			l.Addr = a
			usedAddr[a] = true
		}
		next[vm] = l
	}
	if !equal(next, p.leases) {
		if err := p.save(next); err != nil {
			return nil, nil, err
		}
		p.leases = next
	}
	out := make(map[string]Lease, len(next))
	for k, v := range next {
		out[k] = v
	}
	return out, failed, nil
}

// usable: inside the subnet, neither its network nor its broadcast address.
func usable(subnet netip.Prefix, a netip.Addr) bool {
	if !a.Is4() || !subnet.Contains(a) {
		return false
	}
	first, last := bounds(subnet)
	return a != first && a != last
}

func bounds(subnet netip.Prefix) (netip.Addr, netip.Addr) {
	b := subnet.Addr().As4()
	n := binary.BigEndian.Uint32(b[:])
	size := uint32(1) << (32 - subnet.Bits())
	return u32Addr(n), u32Addr(n + size - 1)
}

func u32Addr(n uint32) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], n)
	return netip.AddrFrom4(b)
}

// pick probes the subnet's host addresses from an offset derived from the
// VM's name and returns the first one not taken.
func pick(subnet netip.Prefix, vm string, taken func(netip.Addr) bool) (netip.Addr, bool) {
	if subnet.Bits() > 30 {
		return netip.Addr{}, false
	}
	first, _ := bounds(subnet)
	base := binary.BigEndian.Uint32(first.AsSlice())
	hosts := uint32(1)<<(32-subnet.Bits()) - 2
	sum := sha256.Sum256([]byte(vm))
	start := binary.BigEndian.Uint32(sum[:4]) % hosts
	for i := uint32(0); i < hosts; i++ {
		a := u32Addr(base + 1 + (start+i)%hosts)
		if !taken(a) {
			return a, true
		}
	}
	return netip.Addr{}, false
}

func sortedKeys(m map[string]Lease) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func equal(a, b map[string]Lease) bool {
	if len(a) != len(b) {
		return false
	}
	for k, x := range a {
		y, ok := b[k]
		if !ok || x.Addr != y.Addr || !bytes.Equal(x.MAC, y.MAC) {
			return false
		}
	}
	return true
}

// save writes the leases atomically: a temp file in the same directory,
// fsynced, renamed over the old one, and the directory fsynced, so a crash
// leaves either the old or the new file, never a torn one.
func (p *Pool) save(leases map[string]Lease) error {
	dir := filepath.Dir(p.path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("saving leases: %w", err)
	}
	b, err := Marshal(leases)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(p.path, b, 0o600); err != nil {
		return fmt.Errorf("saving leases: %w", err)
	}
	return nil
}

type fileV1 struct {
	Version int         `json:"version"`
	Leases  []leaseJSON `json:"leases"`
}

type leaseJSON struct {
	VM      string `json:"vm"`
	Address string `json:"address"`
	MAC     string `json:"mac"`
}

// Marshal renders leases in the file format, sorted by VM name.
func Marshal(leases map[string]Lease) ([]byte, error) {
	f := fileV1{Version: 1, Leases: []leaseJSON{}}
	for _, vm := range sortedKeys(leases) {
		l := leases[vm]
		f.Leases = append(f.Leases, leaseJSON{VM: l.VM, Address: l.Addr.String(), MAC: l.MAC.String()})
	}
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Parse reads a leases file. It rejects anything it would not have written:
// another version, an empty VM name, an address that is not IPv4, a MAC that
// is not 6 bytes, a VM, address or MAC that appears twice.
func Parse(b []byte) ([]Lease, error) {
	var f fileV1
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("leases: %w", err)
	}
	if dec.More() {
		return nil, errors.New("leases: trailing data after the JSON object")
	}
	if f.Version != 1 {
		return nil, fmt.Errorf("leases: version %d, want 1", f.Version)
	}
	seenVM, seenAddr, seenMAC := map[string]bool{}, map[netip.Addr]bool{}, map[string]bool{}
	out := make([]Lease, 0, len(f.Leases))
	for i, l := range f.Leases {
		field := fmt.Sprintf("leases[%d]", i)
		if l.VM == "" {
			return nil, fmt.Errorf("%s.vm: empty", field)
		}
		a, err := netip.ParseAddr(l.Address)
		if err != nil || !a.Is4() {
			return nil, fmt.Errorf("%s.address: %q is not an IPv4 address", field, l.Address)
		}
		mac, err := net.ParseMAC(l.MAC)
		if err != nil || len(mac) != 6 {
			return nil, fmt.Errorf("%s.mac: %q is not a 6-byte MAC", field, l.MAC)
		}
		switch {
		case seenVM[l.VM]:
			return nil, fmt.Errorf("%s.vm: %q appears twice", field, l.VM)
		case seenAddr[a]:
			return nil, fmt.Errorf("%s.address: %s appears twice", field, a)
		case seenMAC[mac.String()]:
			return nil, fmt.Errorf("%s.mac: %s appears twice", field, mac)
		}
		seenVM[l.VM], seenAddr[a], seenMAC[mac.String()] = true, true, true
		out = append(out, Lease{VM: l.VM, Addr: a, MAC: mac})
	}
	return out, nil
}
