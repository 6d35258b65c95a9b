// Command echod is the test guest's echo service: TCP echo that keeps every
// connection open until the peer closes it, and UDP echo. It exists because
// Debian's busybox-static has neither tcpsvd nor udpsvd, and a fork per
// connection would not hold thousands of idle connections in a small guest.
package main

import (
	"flag"
	"io"
	"log"
	"net"
)

func main() {
	tcpAddr := flag.String("tcp", ":7000", "TCP echo listen address (empty: off)")
	udpAddr := flag.String("udp", ":7001", "UDP echo listen address (empty: off)")
	flag.Parse()
	errc := make(chan error, 2)
	if *tcpAddr != "" {
		ln, err := net.Listen("tcp", *tcpAddr)
		if err != nil {
			log.Fatal(err)
		}
		go func() { errc <- serveTCP(ln) }()
	}
	if *udpAddr != "" {
		pc, err := net.ListenPacket("udp", *udpAddr)
		if err != nil {
			log.Fatal(err)
		}
		go func() { errc <- serveUDP(pc) }()
	}
	log.Fatal(<-errc)
}

// serveTCP echoes each connection's bytes back until the peer closes it.
func serveTCP(ln net.Listener) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return err
		}
		go func() {
			defer c.Close()
			_, _ = io.Copy(c, c)
		}()
	}
}

// serveUDP sends every datagram back to its sender.
func serveUDP(pc net.PacketConn) error {
	buf := make([]byte, 65536)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return err
		}
		_, _ = pc.WriteTo(buf[:n], from)
	}
}
