package netplane

import (
	"net"
	"net/netip"
)

// This file is the seam between the Plane and the nftables table `inet
// brokkr`, which package netplane/nft owns (built in parallel on another
// branch). The Plane computes the whole desired table as tableRules and
// hands it over in one call; the table reports what drift it repaired and
// its per-exposure counters.
//
// TODO(lead): netplane/nft has not landed on this branch yet. When it does,
// openTable becomes a call to nft.Open(netnsPath) wrapped so that
// tableRules/tableCounters convert to nft.Rules/nft.ExposureCounters (the
// fields below mirror the agreed nft API one to one). Until then openTable
// is nil and every exposure reports state failed with reason
// "nftables table not available".

// kernelTable is the nftables table in the managed namespace.
type kernelTable interface {
	Converge(r tableRules) (repaired []string, err error)
	Counters() (map[string]tableCounters, error)
	Delete() error
	Close() error
}

// openTable opens the table in the namespace at netnsPath ("" = current).
var openTable func(netnsPath string) (kernelTable, error)

// tableRules is the whole desired table (mirrors nft.Rules).
type tableRules struct {
	Bridge                          string
	Subnet                          netip.Prefix
	Gateway                         netip.Addr
	Masquerade, IsolateGuests, DHCP bool
	Guests                          []tableGuest
	Exposures                       []tableExposure
}

// tableGuest mirrors nft.Guest: what anti-spoofing needs per tap.
type tableGuest struct {
	Name, Tap string
	MAC       net.HardwareAddr
	Addr      netip.Addr
}

// tableExposure mirrors nft.Exposure.
type tableExposure struct {
	Name, Protocol      string
	HostAddr            netip.Addr
	HostPort, GuestPort uint16
	GuestAddr           netip.Addr
	MaxConns            int
}

// tableCounters mirrors nft.ExposureCounters: absolute kernel values.
type tableCounters struct {
	Accepted, Refused, BytesIn, BytesOut uint64
	Active                               uint64
}
