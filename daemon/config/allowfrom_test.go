package config

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/spec"
)

func TestAllowFromIsTypedPrefixesOfBothFamilies(t *testing.T) {
	_, m, err := Load([]byte(`
exposures:
  - {name: a, target: 10.213.0.9, guestPort: 80, hostPort: 8080, allowFrom: [192.0.2.0/24, "2001:db8::/32", 198.51.100.7/32]}
  - {name: b, target: 10.213.0.9, guestPort: 80, hostPort: 8081}
  - {name: c, target: 10.213.0.9, guestPort: 80, hostPort: 8082, allowFrom: []}
`))
	require.NoError(t, err)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("2001:db8::/32"),
		netip.MustParsePrefix("198.51.100.7/32")}, m.Exposures[0].AllowFrom)
	assert.Nil(t, m.Exposures[1].AllowFrom, "absent: everyone")
	assert.Nil(t, m.Exposures[2].AllowFrom, "empty: everyone")
}

func TestAllowFromErrorsNameTheirPrefix(t *testing.T) {
	got := errorsOf(t, `
exposures:
  - {name: a, target: 10.213.0.9, guestPort: 80, hostPort: 8080}
  - {name: b, target: 10.213.0.9, guestPort: 80, hostPort: 8081, allowFrom: [10.1.2.3/16, nonsense, 10.0.0.1, "::ffff:10.0.0.0/104", "2001:db8::1/32", 10.0.0.0/8]}
`)
	assert.Equal(t, []string{
		`exposures[1].allowFrom[0]: "10.1.2.3/16" has host bits set; did you mean 10.1.0.0/16?`,
		`exposures[1].allowFrom[1]: "nonsense" is not a CIDR prefix (like 192.0.2.0/24 or 2001:db8::/32)`,
		`exposures[1].allowFrom[2]: "10.0.0.1" is not a CIDR prefix (like 192.0.2.0/24 or 2001:db8::/32)`,
		`exposures[1].allowFrom[3]: "::ffff:10.0.0.0/104" is an IPv4-mapped IPv6 prefix; write it as IPv4`,
		`exposures[1].allowFrom[4]: "2001:db8::1/32" has host bits set; did you mean 2001:db8::/32?`,
	}, got)
}

func TestAllowFromSurvivesTheJSONOfDesiredState(t *testing.T) {
	c, _, err := Load([]byte(`exposures: [{name: a, target: 10.213.0.9, guestPort: 80, hostPort: 8080, allowFrom: [192.0.2.0/24]}]`))
	require.NoError(t, err)
	j, err := json.Marshal(c)
	require.NoError(t, err)
	_, m, err := Load(j)
	require.NoError(t, err)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}, m.Exposures[0].AllowFrom)
}

func TestAllowFromIsBoundedPerExposure(t *testing.T) {
	var b strings.Builder
	for i := 0; i <= spec.MaxAllowFrom; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d.%d.%d.0/24", 1+i>>16, i>>8&255, i&255)
	}
	got := errorsOf(t, "exposures: [{name: a, target: 10.213.0.9, guestPort: 80, hostPort: 8080, allowFrom: ["+b.String()+"]}]")
	assert.Equal(t, []string{"exposures[0].allowFrom: 65537 prefixes, more than the 65536 an exposure may have"}, got)
}
