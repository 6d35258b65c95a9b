package proxy

import (
	"context"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Keepalive of callers: a caller that vanished without a FIN must not hold a
// place under the cap forever (there is no idle timeout on TCP).
const (
	keepIdle     = 15 * time.Second
	keepInterval = 15 * time.Second
	keepCount    = 4
)

// listenConfig sets the socket options every exposure socket gets before
// bind: SO_REUSEADDR, so a port whose old connections sit in TIME_WAIT can be
// bound again at once; IPV6_V6ONLY on IPv6 sockets, so "::" means IPv6 only
// and an IPv4 exposure on the same port is a separate socket rather than a
// clash; and for a wildcard UDP socket, IP_PKTINFO / IPV6_RECVPKTINFO so each
// datagram says which local address it was sent to and the reply can leave
// from that same address.
//
// A TCP listener also gets its keepalive settings here, once: accepted sockets
// inherit them from the listener, so the per-connection setsockopt calls Go
// would otherwise make (four per accept) are turned off. At high connection
// rates the proxy's cost is its syscalls.
func listenConfig(pktinfo bool) *net.ListenConfig {
	lc := &net.ListenConfig{KeepAlive: -1, Control: func(network, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			s := int(fd)
			if serr = unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); serr != nil {
				return
			}
			if network == "tcp4" || network == "tcp6" {
				if serr = unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1); serr != nil {
					return
				}
				for _, o := range []struct{ opt, v int }{
					{unix.TCP_KEEPIDLE, int(keepIdle / time.Second)},
					{unix.TCP_KEEPINTVL, int(keepInterval / time.Second)},
					{unix.TCP_KEEPCNT, keepCount},
				} {
					if serr = unix.SetsockoptInt(s, unix.IPPROTO_TCP, o.opt, o.v); serr != nil {
						return
					}
				}
			}
			v6 := network == "tcp6" || network == "udp6"
			if v6 {
				if serr = unix.SetsockoptInt(s, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1); serr != nil {
					return
				}
			}
			if pktinfo {
				if v6 {
					serr = unix.SetsockoptInt(s, unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
				} else {
					serr = unix.SetsockoptInt(s, unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
				}
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	// Plain TCP, not Go's default MPTCP: an MPTCP listener's accepted
	// sockets do not inherit TCP_NODELAY (each would need a setsockopt),
	// and its SYN handling costs more per caller (measured below in
	// BENCHMARKS.md, "Proxy against HAProxy").
	lc.SetMultipathTCP(false)
	return lc
}

// family picks the network name for the host address, so "0.0.0.0" never
// becomes a dual-stack socket and "::" never an IPv4 one.
func family(c checked) string {
	if c.host.Is4() {
		return string(c.Proto) + "4"
	}
	return string(c.Proto) + "6"
}

func listenTCP(c checked) (net.Listener, error) {
	return listenConfig(false).Listen(context.Background(), family(c), c.hostAddrPort())
}

func listenUDP(c checked) (*net.UDPConn, error) {
	pc, err := listenConfig(c.host.IsUnspecified()).ListenPacket(context.Background(), family(c), c.hostAddrPort())
	if err != nil {
		return nil, err
	}
	return pc.(*net.UDPConn), nil
}
