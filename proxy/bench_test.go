package proxy

import (
	"io"
	"net"
	"strconv"
	"testing"
)

// Short connections (connect, 1-byte exchange, close) through the proxy and,
// as the baseline measured in the same run, straight to the guest. Compare
// the two ns/op figures as a ratio; both run on loopback.
func BenchmarkShortConnectionDirect(b *testing.B) {
	port := benchEcho(b)
	benchConnect(b, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
}

func BenchmarkShortConnectionProxied(b *testing.B) {
	port := benchEcho(b)
	m := NewManager(func(string) string { return "127.0.0.1" }, nil)
	defer m.StopAll()
	st := m.Converge([]Spec{{ID: "bench", VM: "vm", Protocol: "tcp", HostAddress: "127.0.0.1", GuestPort: port}})[0]
	if st.State != StateActive {
		b.Fatal(st.Reason)
	}
	benchConnect(b, st.BoundAddr)
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

func benchEcho(b *testing.B) int {
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
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}
