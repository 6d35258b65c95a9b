package bpf

import (
	"net/netip"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/kernelfeat"
	"github.com/cilium/ebpf"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
)

// tcPrograms lists the programs of the BPF filters on tp's bridge, at its
// egress then at its ingress.
func tcPrograms(t *testing.T, tp *natTopo) []ebpf.ProgramID {
	t.Helper()
	var ids []ebpf.ProgramID
	require.NoError(t, tp.host.Do(func() error {
		for _, parent := range []uint32{netlink.HANDLE_MIN_EGRESS, netlink.HANDLE_MIN_INGRESS} {
			fs, err := netlink.FilterList(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Index: tp.bridge}}, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if b, ok := f.(*netlink.BpfFilter); ok {
					ids = append(ids, ebpf.ProgramID(b.Id))
				}
			}
		}
		return nil
	}))
	return ids
}

// A binary whose tc programs cannot load (here a pinned nat_flows of
// another layout) takes the earlier binary's filters off the bridge: its
// fallback's marks must not be read as slots by programs it did not load.
// (Fails with the detachTC in LoadNatPath's error path removed.)
func TestAnUnloadableBinaryTakesTheTCProgramsOff(t *testing.T) {
	kernelfeat.Require(t, kernelfeat.NatPath...)
	tp := newNatTopo(t, 1)
	np1, err := LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, Guests: netip.MustParsePrefix("10.213.0.0/24"), InNS: tp.host.Do, TC: true})
	require.NoError(t, err)
	defer np1.Close()
	require.Len(t, tcPrograms(t, tp), 2, "one program at each hook")
	breakNatFlowsPin(t, tp.pins)
	_, err = LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, InNS: tp.host.Do, TC: true})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "nat_flows")
	assert.Empty(t, tcPrograms(t, tp), "no program left on the bridge")
}

// A UDP caller allowFrom kept out is admitted once its prefix is allowed,
// though it never stopped sending: on the tc programs its conntrack entry
// (confirmed before the bridge, kept alive by its datagrams) carries a
// flow marked denied, which must not outlive the restriction. (Fails on
// the tc programs with the F_DENIED re-check in toward_guest removed.)
func TestADeniedUDPCallerAllowedSinceIsAdmittedOnTheSameEntry(t *testing.T) {
	tp := newNatTopo(t, 1)
	np := tp.load(t)
	defer np.Close()
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}))
	u, err := dial(t, tp.client, "udp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer u.Close()
	_, err = u.Write([]byte("denied"))
	require.NoError(t, err)
	require.NoError(t, u.SetReadDeadline(time.Now().Add(300*time.Millisecond)))
	_, err = u.Read(make([]byte, 16))
	require.Error(t, err, "no answer: dropped")
	require.EqualValues(t, 1, tp.slot.Read().Denied)
	require.NoError(t, np.SetAllow(tp.slot.Index(), tp.slot.Gen(), []netip.Prefix{netip.MustParsePrefix("10.99.0.0/24")}))
	roundTrip(t, u, []byte("allowed since"))
	c := tp.slot.Read()
	assert.EqualValues(t, 1, c.Accepted)
	assert.EqualValues(t, 1, c.Denied, "counted once")
}

// The netfilter hooks' programs, loaded where the tc programs ran (a
// daemon restarted without BROKKR_NAT_HOOKS=tc), take those off the bridge:
// both would see every packet (the flows are shared, so a connection is
// still counted once, as this test checks, but each packet pays twice).
// (Fails with the detachTC in loadNatPath removed.)
func TestTheNetfilterProgramsTakeTheTCProgramsOff(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo(t, 1)
	np1, err := LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, Guests: netip.MustParsePrefix("10.213.0.0/24"), InNS: tp.host.Do, TC: true})
	require.NoError(t, err)
	require.NoError(t, np1.Close())
	require.Len(t, tcPrograms(t, tp), 2)
	np2 := tp.load(t)
	defer np2.Close()
	assert.Equal(t, "netfilter", np2.Hooks())
	assert.Empty(t, tcPrograms(t, tp), "no tc program left on the bridge")
	c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, c, []byte("once"))
	c.Close()
	eventually(t, "counted once", func() bool { s := tp.slot.Read(); return s.Active == 0 && s.Accepted == 1 })
	assert.EqualValues(t, 4, tp.slot.Read().BytesIn, "counted once")
}
