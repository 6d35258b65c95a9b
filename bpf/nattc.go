package bpf

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The nat path on kernels without BPF netfilter programs (before 6.4) is
// two tc programs on the guest bridge (bpf/nattc.c), classic cls_bpf
// filters under a clsact qdisc: tcx links are 6.6. A filter belongs to the
// bridge, not to a process, so the path keeps running with no daemon, and
// a new binary's programs replace the old ones in place (one netlink
// replace of the same priority and handle: never a moment without a
// program, never two).
const (
	tcPriority  = 0xb4b
	tcHandle    = 1
	tcEgressNm  = "brk_nattc_egress"
	tcIngressNm = "brk_nattc_ingress"
)

// Hooks says where the nat path's programs run: "netfilter" (the
// PREROUTING and LOCAL_OUT hooks, 6.4+) or "tc" (the bridge's tc hooks,
// kernels before 6.4).
func (n *NatPath) Hooks() string {
	if n.tc != nil {
		return "tc"
	}
	return "netfilter"
}

// loadNatPathTC loads the tc programs onto the pinned maps and puts them
// on cfg.Bridge, replacing what an earlier binary put there.
func loadNatPathTC(cfg NatPathConfig) (*NatPath, error) {
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: cfg.PinDir}}
	spec, err := loadNatpath()
	if err != nil {
		return nil, fmt.Errorf("nat path: %w", err)
	}
	n := &NatPath{objs: &natpathObjects{}, tc: &nattcObjects{}, pinDir: cfg.PinDir, bridge: cfg.Bridge, inNS: cfg.InNS}
	// The maps only, by the netfilter object's spec (its programs are not
	// loaded): what SetGuests and allowFrom write to is the same for both.
	if err := spec.LoadAndAssign(&n.objs.natpathMaps, opts); err != nil {
		return nil, fmt.Errorf("nat path: loading the maps: %w", err)
	}
	if err := loadNattcObjects(n.tc, opts); err != nil {
		n.objs.Close()
		return nil, fmt.Errorf("nat path: loading the tc programs: %w", err)
	}
	if err := n.SetGuests(cfg.Guests, cfg.Guests6); err != nil {
		n.Close()
		return nil, err
	}
	// Programs at the netfilter hooks (a daemon run without HooksEnv on
	// a kernel that has them) would go on seeing every packet: nothing
	// counted twice (the flows are shared), but every packet paid twice.
	if err := detachNatPath(cfg.PinDir); err != nil {
		n.Close()
		return nil, err
	}
	if err := cfg.InNS(func() error { return attachTC(cfg.Bridge, n.tc.BrkNattcEgress, n.tc.BrkNattcIngress) }); err != nil {
		n.Close()
		return nil, fmt.Errorf("nat path: on bridge %d: %w", cfg.Bridge, err)
	}
	if err := n.armSweeper(); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// tcFilter is the filter of prog at the bridge's egress or ingress.
func tcFilter(ifindex int, egress bool, prog *ebpf.Program, name string) *netlink.BpfFilter {
	parent := uint32(netlink.HANDLE_MIN_INGRESS)
	if egress {
		parent = netlink.HANDLE_MIN_EGRESS
	}
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: parent, Handle: tcHandle,
			Protocol: unix.ETH_P_ALL, Priority: tcPriority},
		Name: name, DirectAction: true, Fd: -1,
	}
	if prog != nil {
		f.Fd = prog.FD()
	}
	return f
}

// attachTC puts the programs on the bridge (in the calling thread's network
// namespace), replacing the filters an earlier binary put there.
func attachTC(ifindex int, egress, ingress *ebpf.Program) error {
	qd := &netlink.GenericQdisc{QdiscType: "clsact", QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex,
		Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
	if err := netlink.QdiscAdd(qd); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("clsact qdisc: %w", err)
	}
	if err := netlink.FilterReplace(tcFilter(ifindex, true, egress, tcEgressNm)); err != nil {
		return fmt.Errorf("tc egress filter: %w", err)
	}
	if err := netlink.FilterReplace(tcFilter(ifindex, false, ingress, tcIngressNm)); err != nil {
		return fmt.Errorf("tc ingress filter: %w", err)
	}
	return nil
}

// detachTC takes the programs off the bridge (a bridge that is gone took
// them with it).
func detachTC(ifindex int) error {
	var errs []error
	for _, f := range []*netlink.BpfFilter{tcFilter(ifindex, true, nil, tcEgressNm), tcFilter(ifindex, false, nil, tcIngressNm)} {
		if err := netlink.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
