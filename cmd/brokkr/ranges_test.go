package main

import (
	"testing"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// expose add sends a range as the config spells it (a string), and the
// listing shows it.
func TestExposeAddAndListAPortRange(t *testing.T) {
	st := twoVMs()
	st.Exposures = append(st.Exposures, api.Exposure{Name: "games", VM: "web", State: "active", Mode: "nat",
		HostPort: 30000, HostPortLast: 30099, GuestPort: 30000, GuestPortLast: 30099, Protocol: "udp"},
		api.Exposure{Name: "fan", VM: "web", State: "active", Mode: "proxy", HostAddress: "::1",
			HostPort: 31000, HostPortLast: 31009, GuestPort: 80, Protocol: "tcp"})
	f := newFakeDaemon(t, st)
	_, errs, code := run(t, "expose", "add", "games", "--vm", "web", "--guest-port", "30000-30099", "--host-port", "30000-30099",
		"--protocol", "udp", "--socket", f.sock)
	require.Equal(t, 0, code, errs)
	got := f.exposureRequests()
	require.Len(t, got, 1)
	assert.Equal(t, `PUT games {"guestPort":"30000-30099","hostPort":"30000-30099","name":"games","protocol":"udp","vm":"web"}`, got[0])

	out, _, code := run(t, "--socket", f.sock, "expose", "ls")
	require.Equal(t, 0, code)
	assert.Contains(t, out, "*:30000-30099/udp")
	assert.Contains(t, out, "web:30000-30099")
	assert.Contains(t, out, "[::1]:31000-31009/tcp")
	assert.Contains(t, out, "web:80 ")
}
