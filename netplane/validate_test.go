package netplane

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/netplane/ipam"
	"github.com/brokkr/brokkr/netplane/link"
	"github.com/brokkr/brokkr/netplane/nft"
)

func errText(errs []error) string {
	var b strings.Builder
	for _, e := range errs {
		b.WriteString(e.Error() + "\n")
	}
	return b.String()
}

// What netplane derives from a valid spec can still clash: shortened tap
// names with each other or the bridge, and an explicit target with an
// address IPAM already gave a guest.
func TestValidateDerivedNamesAndAddresses(t *testing.T) {
	n := Network{Bridge: "brokkr0", CIDR: netip.MustParsePrefix("10.213.0.1/24")}
	addr := netip.MustParseAddr
	assigned := map[string]netip.Addr{"web": addr("10.213.0.7")}
	target := func(a string) Desired {
		return Desired{Network: n, Guests: guestsOf("web"), Exposures: []Exposure{
			{Name: "x", Target: spec.Target{Addr: addr(a)}, Proto: spec.TCP, HostPort: 8080, GuestPort: 80}}}
	}
	tapIsBridge := Desired{Network: Network{Bridge: "brk-web", CIDR: n.CIDR}, Guests: guestsOf("web")}
	// Both shorten to brk-abcde and the same 3 bytes of their sha256 (a
	// collision found by search).
	long := Desired{Network: n, Guests: guestsOf("abcdefghijk-1988", "abcdefghijk-6273")}
	cases := []struct {
		d    Desired
		want string
	}{
		{target("10.213.0.7"), `exposures[0].target: 10.213.0.7 is assigned to guest "web"`},
		{tapIsBridge, `guests[0].name: tap name "brk-web" of guest "web" clashes with the bridge`},
		{long, `guests[1].name: tap name "brk-abcde`},
	}
	for _, c := range cases {
		assert.Contains(t, errText(validateDerived(c.d, assigned)), c.want)
	}
	assert.Empty(t, validateDerived(target("10.213.0.8"), assigned))
	assert.Empty(t, validateDerived(Desired{Network: n, Guests: guestsOf("web", "db")}, assigned))
}

// The model's cap bound is the one the kernel fallback's sets are sized to.
func TestMaxConnsLimitIsTheTables(t *testing.T) {
	assert.Equal(t, nft.MaxConnsLimit, spec.MaxConnsLimit)
}

// A change of exposures is checked against IPAM's leases without a pass:
// an explicit target that is a desired guest's address is refused, one of
// a guest no longer desired is not.
func TestValidateExposuresChecksTargetsAgainstTheLeases(t *testing.T) {
	pool, err := ipam.Open(t.TempDir())
	require.NoError(t, err)
	leases, _, err := pool.Reconcile(ipam.Request{Bridge: netip.MustParsePrefix("10.213.0.1/24"), VMs: []string{"web"}, MAC: link.GuestMAC})
	require.NoError(t, err)
	web := leases["web"].Addr
	p := &Plane{pool: pool}
	d := Desired{Guests: guestsOf("web"), Exposures: []Exposure{
		{Name: "x", Target: spec.Target{Addr: web}, Proto: spec.TCP, HostPort: 8080, GuestPort: 80}}}
	assert.Contains(t, errText(p.ValidateExposures(d)), `exposures[0].target: `+web.String()+` is assigned to guest "web"`)
	d.Guests = guestsOf("db")
	assert.Empty(t, p.ValidateExposures(d))
}
