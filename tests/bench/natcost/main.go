// Command natcost loads or removes the BPF nat path on a pin directory, for
// an A/B of the programs' cost per connection on one topology:
//
//	natcost load -pins DIR -ns HOSTNS -bridge br0 -guests 10.213.0.0/24 -slot web -cap 256
//	natcost remove -pins DIR -ns HOSTNS -bridge br0
//
// load prints the slot's mark (for the nft rule) and keeps nothing open: the
// links stay pinned.
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
	slotName := fs.String("slot", "web", "exposure name")
	capN := fs.Uint("cap", 256, "cap")
	_ = fs.Parse(os.Args[2:])
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
	np, err := bpf.LoadNatPath(bpf.NatPathConfig{PinDir: *pins, Bridge: idx, Guests: netip.MustParsePrefix(*guests),
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
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "natcost:", err)
		os.Exit(1)
	}
}
