package proxy

import (
	"encoding/binary"
	"net"
	"net/netip"
	"strconv"

	"github.com/brokkr/brokkr/internal/spec"
)

// The PROXY protocol (HAProxy's, versions 1 and 2): the proxy writes the
// header as a plain write on the guest's socket, right after the dial and
// before the first byte of the caller's is spliced, so the payload keeps the
// splice path. Only the PROXY command over TCP is written: the proxy always
// knows both addresses, and UDP exposures carry no header (config.Compile
// refuses one).
//
// An encoder of its own rather than a library: the header is a few dozen
// bytes of a fixed layout, written once per connection on the proxy's hot
// path without an allocation beyond its buffer, and the daemon keeps its
// dependencies. The tests parse it with an independent parser
// (github.com/pires/go-proxyproto), so the layout is checked against someone
// else's reading of the specification, not against this one's twice.

// ppVersion is an exposure's header as the carriers read it: 0 none.
type ppVersion = uint32

const (
	ppNone ppVersion = iota
	ppV1
	ppV2
)

func ppOf(p spec.ProxyProtocol) ppVersion {
	switch p {
	case spec.ProxyV1:
		return ppV1
	case spec.ProxyV2:
		return ppV2
	}
	return ppNone
}

// ppV2Sig is the 12 bytes every version 2 header starts with.
var ppV2Sig = [12]byte{'\r', '\n', '\r', '\n', 0, '\r', '\n', 'Q', 'U', 'I', 'T', '\n'}

// maxPPHeader is the longest header written: v1 with two full IPv6
// addresses is 104 bytes (the specification's bound is 107), v2 with IPv6
// 16 + 36 = 52.
const maxPPHeader = 108

// appendPPHeader appends the header of version v for a connection from src
// to dst (the address the caller dialled). Both addresses are of one family
// in the header: two IPv4 ones (v4-mapped ones unmapped) give TCP4 /
// AF_INET; otherwise an IPv4 one is written v4-mapped beside the IPv6 one
// (TCP6 / AF_INET6). Zones are left out: the header has no place for one.
func appendPPHeader(b []byte, v ppVersion, src, dst netip.AddrPort) []byte {
	sa, da := src.Addr().Unmap().WithZone(""), dst.Addr().Unmap().WithZone("")
	four := sa.Is4() && da.Is4()
	if !four {
		sa, da = netip.AddrFrom16(sa.As16()), netip.AddrFrom16(da.As16())
	}
	switch v {
	case ppV1:
		if four {
			b = append(b, "PROXY TCP4 "...)
		} else {
			b = append(b, "PROXY TCP6 "...)
		}
		b = sa.AppendTo(b)
		b = append(b, ' ')
		b = da.AppendTo(b)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(src.Port()), 10)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(dst.Port()), 10)
		return append(b, '\r', '\n')
	case ppV2:
		b = append(b, ppV2Sig[:]...)
		b = append(b, 0x21) // version 2, command PROXY
		if four {
			b = append(b, 0x11) // AF_INET, STREAM
			b = binary.BigEndian.AppendUint16(b, 12)
			s4, d4 := sa.As4(), da.As4()
			b = append(b, s4[:]...)
			b = append(b, d4[:]...)
		} else {
			b = append(b, 0x21) // AF_INET6, STREAM
			b = binary.BigEndian.AppendUint16(b, 36)
			s16, d16 := sa.As16(), da.As16()
			b = append(b, s16[:]...)
			b = append(b, d16[:]...)
		}
		b = binary.BigEndian.AppendUint16(b, src.Port())
		return binary.BigEndian.AppendUint16(b, dst.Port())
	}
	return b
}

// writePPHeader writes the header for the caller c to the guest g. The
// guest's socket is fresh from its dial, so its send buffer takes the few
// bytes at once; NODELAY (Go's default) sends them without waiting for the
// caller's first bytes, which a server-speaks-first guest (SMTP) never gets
// before it has read the header and greeted.
func writePPHeader(g sock, src, dst netip.AddrPort, v ppVersion) error {
	if !src.IsValid() || !dst.IsValid() {
		return net.UnknownNetworkError("caller without TCP addresses")
	}
	var buf [maxPPHeader]byte
	_, err := g.Write(appendPPHeader(buf[:0], v, src, dst))
	return err
}
