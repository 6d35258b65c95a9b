// Command natcost loads or removes the BPF nat path on a pin directory, for
// an A/B of the programs' cost per connection on one topology:
//
//	natcost load -pins DIR -ns HOSTNS -bridge br0 -guests 10.213.0.0/24 -slot web -cap 256
//	natcost remove -pins DIR -ns HOSTNS -bridge br0
//	natcost stats -pins DIR -slot web
//
// load prints the slot's mark (for the nft rule) and keeps nothing open: the
// links stay pinned. Loading again on the same pins with another -slot adopts
// the attached programs and takes the next slot (slot 0 is mark 0x20000001,
// slot 1 0x20000002, ...). -guests6 gives the programs the bridge's IPv6
// subnet (callers there are bridged); stats prints the slot's counters.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/internal/nlsafe"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: natcost load|remove ...")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	pins := fs.String("pins", "", "bpffs directory")
	ns := fs.String("ns", "", "host namespace path")
	bridge := fs.String("bridge", "br0", "bridge name")
	guests := fs.String("guests", "10.213.0.0/24", "guest subnet")
	guests6 := fs.String("guests6", "", "guest IPv6 subnet (none if empty)")
	slotName := fs.String("slot", "web", "exposure name")
	capN := fs.Uint("cap", 256, "cap")
	_ = fs.Parse(os.Args[2:])
	if os.Args[1] == "stats" {
		store, err := bpf.Open(*pins)
		check(err)
		defer store.Close()
		c, ok := store.Lookup(*slotName)
		if !ok {
			check(fmt.Errorf("no slot %q", *slotName))
		}
		fmt.Printf("accepted=%d refused=%d dropped=%d active=%d\n", c.Accepted, c.Refused, c.Dropped, c.Active)
		return
	}
	var g6 netip.Prefix
	if *guests6 != "" {
		g6 = netip.MustParsePrefix(*guests6)
	}
	var idx int
	check(nlsafe.Do(*ns, func() error {
		i, err := net.InterfaceByName(*bridge)
		if err != nil {
			return err
		}
		idx = i.Index
		return nil
	}))
	store, err := bpf.Open(*pins)
	check(err)
	defer store.Close()
	np, err := bpf.LoadNatPath(bpf.NatPathConfig{PinDir: *pins, Bridge: idx, Guests: netip.MustParsePrefix(*guests), Guests6: g6,
		InNS: func(fn func() error) error { return nlsafe.Do(*ns, fn) }})
	check(err)
	switch os.Args[1] {
	case "load":
		sl, err := store.Attach(*slotName, bpf.ProtoTCP, 0)
		check(err)
		sl.SetCap(uint32(*capN))
		fmt.Printf("0x%x\n", ctmark.Of(sl.Index()))
		sl.Release(false)
		check(np.Close())
	case "remove":
		check(np.Remove())
	default:
		check(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "natcost:", err)
		os.Exit(1)
	}
}
