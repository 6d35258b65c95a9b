package proxy

import (
	"github.com/brokkr/brokkr/internal/spec"
	"io"
	"net"
	"net/netip"
	"strconv"
	"testing"
)

// Short connections (connect, 1-byte exchange, close) through the proxy and,
// as the baseline measured in the same run, straight to the guest. Compare
// the two ns/op figures as a ratio; both run on loopback.
func BenchmarkShortConnectionDirect(b *testing.B) {
	benchConnect(b, direct(benchGuest(b, echo)))
}

func BenchmarkShortConnectionProxied(b *testing.B) {
	benchConnect(b, proxied(b, benchGuest(b, echo)))
}

// direct is the guest's own address on loopback.
func direct(guestPort int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(guestPort)) }

// proxied is the address of a proxy exposure carrying to the guest's port.
func proxied(b *testing.B, guestPort int) string {
	m := NewManager(func(string) string { return "127.0.0.1" }, nil)
	b.Cleanup(m.StopAll)
	st := m.Converge([]Spec{{Exposure: spec.Exposure{Name: "bench", Target: spec.Target{VM: "vm"}, Proto: "tcp", GuestPort: uint16(guestPort)}, Listen: netip.MustParseAddr("127.0.0.1")}})[0]
	if st.State != StateActive {
		b.Fatal(st.Reason)
	}
	return st.BoundAddr
}

func benchConnect(b *testing.B, addr string) {
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]byte, 1)
		for pb.Next() {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				b.Error(err)
				return
			}
			if _, err := c.Write([]byte{'x'}); err != nil {
				b.Error(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				b.Error(err)
			}
			c.Close()
		}
	})
}

// benchGuest serves each connection on loopback with handle, until the
// benchmark ends, and returns its port.
func benchGuest(b *testing.B, handle func(net.Conn)) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); handle(c) }()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

func echo(c net.Conn) { io.Copy(c, c) }

// sink reads to EOF, then answers with how many bytes it read.
func sink(c net.Conn) {
	n, _ := io.Copy(io.Discard, c)
	c.Write([]byte(strconv.FormatInt(n, 10)))
}

// Bulk transfer (one connection, 64 MiB each way per op... one way: caller to
// guest) through the proxy and, as the baseline in the same run, direct.
func BenchmarkBulkDirect(b *testing.B)  { benchBulk(b, direct(benchGuest(b, sink))) }
func BenchmarkBulkProxied(b *testing.B) { benchBulk(b, proxied(b, benchGuest(b, sink))) }

func benchBulk(b *testing.B, addr string) {
	const size = 64 << 20
	buf := make([]byte, 256<<10)
	b.SetBytes(size)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			b.Fatal(err)
		}
		for sent := 0; sent < size; sent += len(buf) {
			if _, err := c.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		c.(*net.TCPConn).CloseWrite()
		got, _ := io.ReadAll(c)
		c.Close()
		if string(got) != strconv.Itoa(size) {
			b.Fatalf("guest got %q bytes", got)
		}
	}
}
