package conntrack

import (
	"net/netip"
	"testing"

	"github.com/brokkr/brokkr/internal/nstest"
	ct "github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

// benchConn is a Conn in a fresh namespace holding n UDP entries
// (10.99.x.y:40000 -> 10.99.0.1:9000), none of which a benchmark's host
// sides match: the flows of a busy host that a flush must not pay for.
func benchConn(b *testing.B, n int) *Conn {
	ns := nstest.New(b, "ctb")
	raw, err := dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	for i := 0; i < n; i++ {
		src := netip.AddrFrom4([4]byte{10, 99, byte(i >> 8), byte(i)})
		f := ct.NewFlow(unix.IPPROTO_UDP, 0, src, netip.MustParseAddr("10.99.0.1"), 40000, 9000, 120, 0)
		if err := raw.Create(f); err != nil {
			b.Fatalf("create %d: %v", i, err)
		}
	}
	c, err := Dial(ns.Path)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}

// tcpSides is n TCP host sides on ports from first.
func tcpSides(n int, first uint16) []HostSide {
	sides := make([]HostSide, n)
	for i := range sides {
		sides[i] = HostSide{Proto: unix.IPPROTO_TCP, Port: first + uint16(i)}
	}
	return sides
}

func benchDelete(b *testing.B, entries int, sides []HostSide) {
	c := benchConn(b, entries)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.DeleteHostSides(sides); err != nil {
			b.Fatal(err)
		}
	}
}

// One host side (an exposure created or changed) with 20,000 entries, and
// in an empty namespace (the baseline: nothing to walk).
func BenchmarkDeleteHostSides20000(b *testing.B) { benchDelete(b, 20000, tcpSides(1, 8080)) }
func BenchmarkDeleteHostSidesEmpty(b *testing.B) { benchDelete(b, 0, tcpSides(1, 8080)) }

// 100 and 10,000 host sides at once (a first converge) with 20,000 entries.
func BenchmarkDeleteManyHostSides20000(b *testing.B) { benchDelete(b, 20000, tcpSides(100, 8000)) }
func BenchmarkDeleteHostSides10000Sides20000(b *testing.B) {
	benchDelete(b, 20000, tcpSides(10000, 20000))
}

// BenchmarkDumpDecodeAll20000 is the cost this package avoids: the
// library's full dump and decode of every entry (what DeleteHostSides did
// before it filtered in the kernel and parsed only original tuples).
func BenchmarkDumpDecodeAll20000(b *testing.B) {
	c := benchConn(b, 20000)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.c.Dump(nil); err != nil {
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
	c := benchConn(b, 20000)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.ByMark(mark, mask); err != nil {
			b.Fatal(err)
		}
	}
}
