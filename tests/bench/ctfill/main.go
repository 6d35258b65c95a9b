// Command ctfill fills a network namespace's conntrack table with unrelated
// UDP entries (not brokkr's: no mark), for the benchmark of a daemon pass on
// a busy host.
//
//	ctfill -ns /run/netns/NAME -n 200000
package main

import (
	"flag"
	"fmt"
	"net/netip"
	"os"
	"runtime"

	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

func main() {
	nsPath := flag.String("ns", "", "namespace path")
	n := flag.Int("n", 200000, "entries to create")
	flag.Parse()
	runtime.LockOSThread()
	h, err := netns.GetFromPath(*nsPath)
	check(err)
	check(netns.Set(h))
	c, err := conntrack.Dial(nil)
	check(err)
	defer c.Close()
	dst := netip.MustParseAddr("192.0.2.1")
	made := 0
	for i := 0; i < *n; i++ {
		src := netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)})
		f := conntrack.NewFlow(unix.IPPROTO_UDP, 0, src, dst, uint16(1024+i>>16), 9000, 600, 0)
		if err := c.Create(f); err != nil {
			check(fmt.Errorf("entry %d: %w", i, err))
		}
		made++
	}
	fmt.Println("created", made)
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "ctfill:", err)
		os.Exit(1)
	}
}
