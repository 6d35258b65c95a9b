package conntrack

import (
	"net/netip"
	"testing"

	"github.com/brokkr/brokkr/internal/nstest"
	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

// fill makes n UDP entries (10.99.x.y:40000 -> 10.99.0.1:9000) in ns.
func fill(b *testing.B, ns *nstest.NS, n int) {
	c, err := dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	for i := 0; i < n; i++ {
		src := netip.AddrFrom4([4]byte{10, 99, byte(i >> 8), byte(i)})
		f := ct.NewFlow(unix.IPPROTO_UDP, 0, src, netip.MustParseAddr("10.99.0.1"), 40000, 9000, 120, 0)
		if err := c.Create(f); err != nil {
			b.Fatalf("create %d: %v", i, err)
		}
	}
}

// BenchmarkDeleteHostSides20000 times one flush by host side in a namespace
// holding 20,000 entries none of which match (a busy host, a new exposure).
func BenchmarkDeleteHostSides20000(b *testing.B) {
	ns := nstest.New(b, "ctb")
	fill(b, ns, 20000)
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	side := []HostSide{{Proto: unix.IPPROTO_TCP, Port: 8080}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.DeleteHostSides(side); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDeleteHostSidesEmpty is the baseline: the same flush in a
// namespace with no entries (the walk of the host-wide hash alone).
func BenchmarkDeleteHostSidesEmpty(b *testing.B) {
	ns := nstest.New(b, "ctb")
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	side := []HostSide{{Proto: unix.IPPROTO_TCP, Port: 8080}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.DeleteHostSides(side); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDeleteManyHostSides20000 is a first converge's flush: 100 host
// sides at once (one shared dump) against 20,000 unrelated entries.
func BenchmarkDeleteManyHostSides20000(b *testing.B) {
	ns := nstest.New(b, "ctb")
	fill(b, ns, 20000)
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	sides := make([]HostSide, 100)
	for i := range sides {
		sides[i] = HostSide{Proto: unix.IPPROTO_TCP, Port: uint16(8000 + i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.DeleteHostSides(sides); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDumpDecodeAll20000 is the cost this package avoids: the
// library's full dump and decode of every entry (what DeleteHostSides did
// before it filtered in the kernel and parsed only original tuples).
func BenchmarkDumpDecodeAll20000(b *testing.B) {
	ns := nstest.New(b, "ctb")
	fill(b, ns, 20000)
	c, err := dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.Dump(nil); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDeleteHostSides10000Sides20000 is a first converge of 10,000
// exposures on a host whose namespace tracks 20,000 unrelated entries.
func BenchmarkDeleteHostSides10000Sides20000(b *testing.B) {
	ns := nstest.New(b, "ctb")
	fill(b, ns, 20000)
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	sides := make([]HostSide, 10000)
	for i := range sides {
		sides[i] = HostSide{Proto: unix.IPPROTO_TCP, Port: uint16(20000 + i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.DeleteHostSides(sides); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkByMarkAll20000 and BenchmarkByMarkOwnedBit20000 are the netplane
// counter read before and after brokkr's entries carried an owner bit: every
// entry of the namespace decoded, against a kernel mark filter that returns
// none of 20,000 unrelated entries.
func BenchmarkByMarkAll20000(b *testing.B)      { benchByMark(b, 0, 0) }
func BenchmarkByMarkOwnedBit20000(b *testing.B) { benchByMark(b, 1<<29, 1<<29) }

func benchByMark(b *testing.B, mark, mask uint32) {
	ns := nstest.New(b, "ctb")
	fill(b, ns, 20000)
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.ByMark(mark, mask); err != nil {
			b.Fatal(err)
		}
	}
}
