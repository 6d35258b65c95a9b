package link

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A sleeping guest's addresses are pinned at its MAC, both families; a
// guest awake again is unpinned; entries the kernel learnt are left alone.
func TestPinNeighboursPinsSleepersAndUnpinsTheRest(t *testing.T) {
	m, ns := newManager(t)
	_, _, err := m.EnsureBridge(BridgeSpec{Name: "brokkr0", Addr: netip.MustParsePrefix("10.213.0.1/24"),
		Addr6: netip.MustParsePrefix("fd00:6272:6b72::1/64"), MTU: 1500})
	require.NoError(t, err)
	macA, macB := GuestMAC("a", 0), GuestMAC("b", 0)
	a4, a6, b4 := netip.MustParseAddr("10.213.0.10"), netip.MustParseAddr("fd00:6272:6b72::10"), netip.MustParseAddr("10.213.0.11")
	// Learnt, not pinned: stays whatever the pins. The bridge gets a port
	// and its carrier first: the carrier's loss, reported up to a second
	// after the bridge came up, flushes every entry but the permanent
	// ones (6.1 did it under this test).
	ns.MustRun(t, "ip", "link", "add", "brk-p0", "master", "brokkr0", "up", "type", "veth", "peer", "name", "brk-p1")
	ns.MustRun(t, "ip", "link", "set", "brk-p1", "up")
	require.Eventually(t, func() bool { return strings.Contains(ns.MustRun(t, "ip", "link", "show", "brokkr0"), "LOWER_UP") },
		5*time.Second, 20*time.Millisecond, "the bridge's carrier")
	time.Sleep(1500 * time.Millisecond) // the linkwatch's carrier events delivered
	ns.MustRun(t, "ip", "neigh", "add", "10.213.0.12", "lladdr", "02:00:00:00:00:12", "dev", "brokkr0", "nud", "stale")
	neigh := func(a netip.Addr) string {
		fam := "-4"
		if a.Is6() {
			fam = "-6"
		}
		return strings.TrimSpace(ns.MustRun(t, "ip", fam, "neigh", "show", a.String(), "dev", "brokkr0"))
	}

	require.NoError(t, m.PinNeighbours("brokkr0", map[netip.Addr]net.HardwareAddr{a4: macA, a6: macA, b4: macB}))
	assert.Equal(t, a4.String()+" lladdr "+macA.String()+" PERMANENT", neigh(a4))
	assert.Equal(t, a6.String()+" lladdr "+macA.String()+" PERMANENT", neigh(a6))
	assert.Equal(t, b4.String()+" lladdr "+macB.String()+" PERMANENT", neigh(b4))
	require.NoError(t, m.PinNeighbours("brokkr0", map[netip.Addr]net.HardwareAddr{a4: macA, a6: macA, b4: macB}), "a second pass changes nothing")

	// b awake again, a's address now another MAC's (a VM of that address made anew).
	macC := GuestMAC("c", 0)
	require.NoError(t, m.PinNeighbours("brokkr0", map[netip.Addr]net.HardwareAddr{a4: macC}))
	assert.Equal(t, a4.String()+" lladdr "+macC.String()+" PERMANENT", neigh(a4))
	assert.Empty(t, neigh(a6))
	assert.Empty(t, neigh(b4))
	assert.Contains(t, neigh(netip.MustParseAddr("10.213.0.12")), "02:00:00:00:00:12", "a learnt entry is not brokkr's to remove")

	// Every VM awake: the last pin goes, and a manager made anew (a
	// restarted daemon) removes what an earlier one pinned.
	require.NoError(t, m.PinNeighbours("brokkr0", nil))
	assert.Empty(t, neigh(a4))
	ns.MustRun(t, "ip", "neigh", "replace", b4.String(), "lladdr", macB.String(), "nud", "permanent", "dev", "brokkr0")
	m2, err := New(ns.Path)
	require.NoError(t, err)
	defer m2.Close()
	require.NoError(t, m2.PinNeighbours("brokkr0", nil))
	assert.Empty(t, neigh(b4), "the first call looks, sleepers or not")
}
