package bpf

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// armProgram is the program that arms the sweep, of either hooks.
func armProgram(np *NatPath) *ebpf.Program {
	if np.tc != nil {
		return np.tc.BrkNattcArm
	}
	return np.objs.BrkNatArm
}

// progID is a loaded program's kernel ID.
func progID(t *testing.T, p *ebpf.Program) ebpf.ProgramID {
	t.Helper()
	info, err := p.Info()
	require.NoError(t, err)
	id, ok := info.ID()
	require.True(t, ok, "program ID")
	return id
}

// progLoaded reports whether the kernel still holds the program with id.
func progLoaded(id ebpf.ProgramID) bool {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return false
	}
	p.Close()
	return true
}

// Every load hands the sweeping timer to its own programs, flows or not: a
// bpf_timer runs the program that set its callback, so a new binary that
// left an armed timer alone would keep the previous binary's sweep running,
// and its program loaded, for as long as the pinned map lives. (Fails with
// armSweeper's call in LoadNatPath removed: the sweep never starts without
// a flow, and the first load's program stays held by the timer.)
func TestEveryLoadHandsTheSweepToItsOwnProgram(t *testing.T) {
	tp := newNatTopo(t, 1)
	np1 := tp.load(t)
	first := progID(t, armProgram(np1))
	eventually(t, "a sweep with no flow ever tracked", func() bool { return sweeps(t, np1) > 0 })

	np2 := tp.load(t)
	defer np2.Close()
	require.NoError(t, np1.Close()) // the first daemon is gone
	deadline := time.Now().Add(5 * time.Second)
	for progLoaded(first) {
		require.True(t, time.Now().Before(deadline), "the first load's program is still held (by the sweep's timer)")
		time.Sleep(20 * time.Millisecond)
	}
	s := sweeps(t, np2)
	untilSweeps(t, np2, 3, "the sweep runs on", func() bool { return sweeps(t, np2) > s })
}

// A binary whose programs cannot load (here a pinned nat_flows of another
// layout, as a changed map would be) leaves the programs an earlier brokkrd
// attached serving: the same links, the cap and the counters exact, and
// the reason said. (Fails with the adoption in LoadNatPath removed: the
// load returns an error and the caller would run the fallback's marks
// under the old programs.)
func TestAnUnloadableBinaryLeavesTheEarlierProgramsServing(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo(t, 1)
	np1 := tp.load(t)
	ids := linkIDs(t, np1.links)
	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	roundTrip(t, a, []byte("held"))
	breakNatFlowsPin(t, tp.pins)

	np2, err := LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, InNS: tp.host.Do})
	require.NoError(t, err, "the earlier programs are kept, not an error")
	defer np2.Close()
	assert.Contains(t, np2.Adopted(), "nat_flows", "the reason names what did not load")
	assert.Equal(t, ids, linkIDs(t, np2.links), "the same links, the earlier programs")
	require.NoError(t, np1.Close())

	_, err = dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "the cap holds")
	roundTrip(t, a, []byte("still"))
	require.NoError(t, a.Close())
	eventually(t, "the held place given back", func() bool { return tp.slot.Read().Active == 0 })
	b, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, b, []byte("new"))
	require.NoError(t, b.Close())
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.EqualValues(t, 1, c.Refused)
	assert.EqualValues(t, 4+5+3, c.BytesIn)
	assert.EqualValues(t, 4+5+3, c.BytesOut)
}

// When the earlier programs cannot be kept either (one of their links is
// gone), none is left attached: the fallback's marks are then read by no
// program. (Fails with detachNatPath's call removed: the other links stay.)
func TestAnUnloadableBinaryWithNoEarlierPathLeavesNoProgramAttached(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo(t, 1)
	np1 := tp.load(t)
	p := np1.objs.natpathPrograms
	out, reflect := progID(t, p.BrkNatOut), progID(t, p.BrkNatReflect)
	breakNatFlowsPin(t, tp.pins)
	require.NoError(t, os.Remove(filepath.Join(tp.pins, pinNatPre)))
	_, err := LoadNatPath(NatPathConfig{PinDir: tp.pins, Bridge: tp.bridge, InNS: tp.host.Do})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "nat_flows")
	require.NoError(t, np1.Close())
	eventually(t, "no earlier program attached", func() bool { return !progLoaded(out) && !progLoaded(reflect) })
}

// breakNatFlowsPin puts a map of another layout where nat_flows is pinned:
// the programs already attached keep theirs, a new load cannot use it.
func breakNatFlowsPin(t *testing.T, pins string) {
	t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: 16})
	require.NoError(t, err)
	defer m.Close()
	pin := filepath.Join(pins, "nat_flows")
	require.NoError(t, os.Remove(pin))
	require.NoError(t, m.Pin(pin))
}

// While an upgrade replaces the programs both copies run, one after the
// other at the same hooks (the new at the other priority): a connection
// is admitted once and its bytes counted once. (Fails with first_packet's
// test removed from account(): the second copy takes the first one's new
// flow for a leftover and admits the connection again.)
func TestTwoCopiesOfTheProgramsCountEachConnectionOnce(t *testing.T) {
	requireNetfilterHooks(t)
	tp := newNatTopo(t, 0)
	np := tp.load(t)
	defer np.Close()
	var second natpathObjects
	require.NoError(t, loadNatpathObjects(&second, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: tp.pins}}))
	defer second.Close()
	for _, h := range []struct {
		hook link.NetfilterInetHook
		prog *ebpf.Program
	}{{link.NetfilterInetPreRouting, second.BrkNatPre}, {link.NetfilterInetLocalOut, second.BrkNatOut}} {
		var l link.Link
		require.NoError(t, tp.host.Do(func() (err error) {
			l, err = link.AttachNetfilter(link.NetfilterOptions{Program: h.prog, ProtocolFamily: link.NetfilterProtoIPv4,
				Hook: h.hook, Priority: netfilterPriorityAlt})
			return err
		}))
		defer l.Close()
	}
	for i := 0; i < 5; i++ {
		c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
		require.NoError(t, err)
		roundTrip(t, c, []byte("0123456789"))
		require.NoError(t, c.Close())
	}
	eventually(t, "every place given back", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 5, c.Accepted)
	assert.EqualValues(t, 50, c.BytesIn)
	assert.EqualValues(t, 50, c.BytesOut)
	k, p := tp.slot.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
}
