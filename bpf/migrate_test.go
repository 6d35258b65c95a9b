package bpf

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// v1Slots is the size of the maps brokkrd pinned up to v0.19.
const v1Slots = 16384

// v1Specs are the v1 maps: today's specs under the v1 names, v1's size.
func v1Specs(t *testing.T) []*ebpf.MapSpec {
	t.Helper()
	cs, err := loadStats()
	require.NoError(t, err)
	ws, err := loadWake()
	require.NoError(t, err)
	ns, err := loadNatpath()
	require.NoError(t, err)
	var out []*ebpf.MapSpec
	for _, p := range v1Pins {
		var sp *ebpf.MapSpec
		switch p.v2 {
		case FedMapName:
			sp = fedSpec()
		case WakeMapName:
			sp = ws.Maps[p.v2]
		case AllowRestrictedMapName:
			sp = ns.Maps[p.v2]
		default:
			sp = cs.Maps[p.v2]
		}
		require.NotNil(t, sp, p.v2)
		sp = sp.Copy()
		sp.Name, sp.MaxEntries = p.v1, v1Slots
		out = append(out, sp)
	}
	return out
}

// pinV1 makes the six v1 maps under dir, as an older brokkrd left them.
func pinV1(t *testing.T, dir string) {
	t.Helper()
	for _, sp := range v1Specs(t) {
		m, err := ebpf.NewMapWithOptions(sp, ebpf.MapOptions{PinPath: dir})
		require.NoError(t, err, sp.Name)
		m.Close()
	}
}

// v1View maps the v1 maps under dir as a Store's memory (the same
// layouts), for the test to write what an older brokkrd and its programs
// would.
func v1View(t *testing.T, dir string) *Store {
	t.Helper()
	v := &Store{}
	for _, x := range []struct {
		name string
		size int
		mem  *[]byte
	}{{V1MapName, valueSize, &v.mem}, {v1LimitsMapName, limitSize, &v.lmem}, {v1DeniedMapName, deniedSize, &v.dmem}, {v1FedMapName, fedSize, &v.fmem}} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, x.name), nil)
		require.NoError(t, err)
		b, err := mmapValues(m, x.size)
		require.NoError(t, err)
		m.Close() // the mapping keeps the map
		t.Cleanup(func() { _ = unix.Munmap(b) })
		*x.mem = b
	}
	return v
}

// v1Slot is what the test puts in one v1 slot.
type v1Slot struct {
	slot          int
	name          string
	port          uint32
	c             Counters
	cap, gen      uint32
	kernel, proxy uint64
	fedA, fedR    uint64
	asleep        bool
	restricted    uint32 // allow_restricted: gen+1 when restricted
}

func (x v1Slot) write(t *testing.T, dir string, v *Store) {
	t.Helper()
	i := x.slot
	copy(v.mem[v.base(i):v.base(i)+MaxNameLen], x.name)
	v.u32(i, offProtocol).Store(ProtoTCP)
	v.u32(i, offHostPort).Store(x.port)
	for off, val := range map[int]uint64{offActive: x.c.Active, offAccepted: x.c.Accepted, offRefused: x.c.Refused,
		offDropped: x.c.Dropped, offBytesIn: x.c.BytesIn, offBytesOut: x.c.BytesOut} {
		v.word(i, off).Store(val)
	}
	v.denied(i).Store(x.c.Denied)
	v.limit32(i, offCap).Store(x.cap)
	v.limit32(i, offGen).Store(x.gen)
	v.limit64(i, offKernelActive).Store(x.kernel)
	v.limit64(i, offProxyActive).Store(x.proxy)
	fedWord(v.fmem, i, offFedValid).Store(1)
	fedWord(v.fmem, i, offFedA).Store(x.fedA)
	fedWord(v.fmem, i, offFedB).Store(x.fedR)
	if x.asleep {
		put(t, filepath.Join(dir, v1WakeMapName), uint32(i), wakeAsleep)
	}
	if x.restricted != 0 {
		put(t, filepath.Join(dir, v1AllowMapName), uint32(i), x.restricted)
	}
}

func put(t *testing.T, pin string, k, v uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(pin, nil)
	require.NoError(t, err)
	defer m.Close()
	require.NoError(t, m.Update(k, v, ebpf.UpdateExist))
}

func get(t *testing.T, pin string, k uint32) uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(pin, nil)
	require.NoError(t, err)
	defer m.Close()
	var v uint32
	require.NoError(t, m.Lookup(k, &v))
	return v
}

// check asserts that s holds x in the same slot, every value.
func (x v1Slot) check(t *testing.T, dir string, s *Store, extra Counters) *Slot {
	t.Helper()
	sl, err := s.Attach(x.name, ProtoTCP, uint16(x.port))
	require.NoError(t, err)
	require.Equal(t, x.slot, sl.Index(), "%s keeps its slot number", x.name)
	want := x.c
	want.Active += extra.Active
	want.Accepted += extra.Accepted
	want.Refused += extra.Refused
	want.BytesIn += extra.BytesIn
	want.Denied += extra.Denied
	assert.Equal(t, want, sl.Read(), x.name)
	assert.Equal(t, x.cap, sl.Cap(), x.name)
	assert.Equal(t, x.gen, sl.Gen(), x.name)
	k, p := sl.Shares()
	assert.Equal(t, x.kernel+extra.Active, k, x.name)
	assert.Equal(t, x.proxy, p, x.name)
	assert.EqualValues(t, 1, fedWord(s.fmem, x.slot, offFedValid).Load())
	assert.Equal(t, x.fedA, fedWord(s.fmem, x.slot, offFedA).Load())
	assert.Equal(t, x.fedR, fedWord(s.fmem, x.slot, offFedB).Load())
	wantWake := wakeAwake
	if x.asleep {
		wantWake = wakeAsleep
	}
	assert.Equal(t, wantWake, get(t, filepath.Join(dir, WakeMapName), uint32(x.slot)), x.name)
	assert.Equal(t, x.restricted, get(t, filepath.Join(dir, AllowRestrictedMapName), uint32(x.slot)), x.name)
	return sl
}

func testSlots() []v1Slot {
	var out []v1Slot
	for k, i := range []int{0, 5000, v1Slots - 1} {
		b := uint64(k+1) * 1000
		out = append(out, v1Slot{slot: i, name: fmt.Sprintf("old-%d", i), port: uint32(9000 + k),
			c:   Counters{Active: 3, Accepted: b + 1, Refused: b + 2, Dropped: b + 3, BytesIn: b + 4, BytesOut: b + 5, Denied: b + 6},
			cap: uint32(10 + k), gen: uint32(7 + k), kernel: 2, proxy: 1, fedA: b + 7, fedR: b + 8,
			asleep: k == 1, restricted: uint32(8 + k)})
	}
	return out
}

// programUsing loads a program that references m, as an earlier brokkrd's
// attached programs reference the v1 maps.
func programUsing(t *testing.T, m *ebpf.Map) *ebpf.Program {
	t.Helper()
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SocketFilter, License: "GPL", Instructions: asm.Instructions{
		asm.LoadMapPtr(asm.R1, m.FD()), asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	require.NoError(t, err)
	return p
}

func pinned(dir string) []string {
	var out []string
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// A daemon that finds the v1 maps (16,384 slots) copies every slot into
// the v2 ones, numbers unchanged: names, counters, caps, generations,
// shares, denied, fed values, wake and allowFrom flags. What the earlier
// writers add to v1 afterwards is carried over once, and the v1 pins go
// only when no program uses them any more. A second Open does nothing.
// (Fails with FinishMigration's check of programsUsing removed: the v1
// pins are removed while a program still counts into them.)
func TestOpenCopiesEveryV1SlotAndCarriesLaterCountsOver(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	pinV1(t, dir)
	v1 := v1View(t, dir)
	slots := testSlots()
	for _, x := range slots {
		x.write(t, dir, v1)
	}
	assert.Equal(t, filepath.Join(dir, V1MapName), StatsPin(dir), "brokkr stats reads v1 while it is all there is")

	s, err := Open(dir)
	require.NoError(t, err)
	defer s.Close()
	require.True(t, s.Migrating())
	assert.Equal(t, filepath.Join(dir, MapName), StatsPin(dir))
	var held []*Slot
	for _, x := range slots {
		held = append(held, x.check(t, dir, s, Counters{}))
	}

	// After the copy an earlier program admits a connection and counts,
	// into v1: read once, however often read.
	mid := slots[1]
	v1.word(mid.slot, offActive).Add(1)
	v1.limit64(mid.slot, offKernelActive).Add(1)
	v1.word(mid.slot, offAccepted).Add(1)
	v1.word(mid.slot, offBytesIn).Add(100)
	v1.denied(mid.slot).Add(2)
	extra := Counters{Active: 1, Accepted: 1, BytesIn: 100, Denied: 2}
	for range 2 {
		mid.check(t, dir, s, extra).Release(false)
	}

	// A program still uses v1: nothing is removed, counts go on moving.
	st, err := ebpf.LoadPinnedMap(filepath.Join(dir, V1MapName), nil)
	require.NoError(t, err)
	prog := programUsing(t, st)
	st.Close()
	done, err := s.FinishMigration()
	assert.False(t, done)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "uses "+V1MapName)
	assert.Contains(t, pinned(dir), V1MapName)
	v1.word(slots[2].slot, offRefused).Add(4)
	require.NoError(t, prog.Close())

	done, err = s.FinishMigration()
	require.NoError(t, err)
	require.True(t, done)
	assert.False(t, s.Migrating())
	for _, p := range v1Pins {
		assert.NotContains(t, pinned(dir), p.v1, "the v1 pin is removed")
		assert.Contains(t, pinned(dir), p.v2)
	}
	assert.NotContains(t, pinned(dir), MigrationMapName)
	assert.NotContains(t, pinned(dir), stagingDir)
	slots[1].check(t, dir, s, extra).Release(false)
	slots[2].check(t, dir, s, Counters{Refused: 4}).Release(false)
	entries, err := Dump(StatsPin(dir))
	require.NoError(t, err)
	require.Len(t, entries, 3)
	assert.Equal(t, mid.slot, entries[1].Slot)
	assert.EqualValues(t, mid.c.Accepted+1, entries[1].Accepted)
	assert.EqualValues(t, mid.c.Denied+2, entries[1].Denied)
	for _, sl := range held {
		sl.Release(false)
	}
	require.NoError(t, s.Close())

	// A second Open: nothing to copy, the same values.
	s2, err := Open(dir)
	require.NoError(t, err)
	defer s2.Close()
	assert.False(t, s2.Migrating())
	slots[0].check(t, dir, s2, Counters{}).Release(false)
	slots[1].check(t, dir, s2, extra).Release(false)
	slots[2].check(t, dir, s2, Counters{Refused: 4}).Release(false)
	assert.NotContains(t, pinned(dir), V1MapName)
}

// A daemon that stops (or dies) with the migration open leaves the copy's
// snapshot pinned: the next one goes on from it, and a count made in
// between moves once. A copy interrupted half-way (v2 maps in staging, one
// moved beside v1, no exposure_stats_v2) is made again from v1. (Fails
// with resumeMigration's call removed from Open: the count made while no
// daemon ran is lost.)
func TestAnOpenMigrationGoesOnAfterARestart(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	pinV1(t, dir)
	v1 := v1View(t, dir)
	x := testSlots()[1]
	x.write(t, dir, v1)

	// What a copy killed half-way leaves: staging with a map in it, and a
	// v2 limits map beside v1 that holds none of v1's values.
	require.NoError(t, os.Mkdir(filepath.Join(dir, stagingDir), 0o700))
	js := v1Specs(t)[1]
	js.Pinning = ebpf.PinNone
	junk, err := ebpf.NewMapWithOptions(js, ebpf.MapOptions{})
	require.NoError(t, err)
	require.NoError(t, junk.Pin(filepath.Join(dir, stagingDir, LimitsMapName)))
	cs, err := loadStats()
	require.NoError(t, err)
	lim, err := ebpf.NewMapWithOptions(cs.Maps[LimitsMapName], ebpf.MapOptions{PinPath: dir})
	require.NoError(t, err)
	lim.Close()
	junk.Close()

	s, err := Open(dir)
	require.NoError(t, err)
	x.check(t, dir, s, Counters{}).Release(false)
	require.NoError(t, s.Close())

	v1.word(x.slot, offAccepted).Add(5)
	s, err = Open(dir)
	require.NoError(t, err)
	defer s.Close()
	require.True(t, s.Migrating(), "the migration is still open")
	x.check(t, dir, s, Counters{Accepted: 5}).Release(false)
	done, err := s.FinishMigration()
	require.NoError(t, err)
	require.True(t, done)
	x.check(t, dir, s, Counters{Accepted: 5}).Release(false)
}

// The v2 maps hold more exposures than v1 could: a slot past 16,384
// counts, and bpftool and Dump see it in the pinned map; past Slots,
// Attach refuses. (Dump skips the free slots: it reads 2 entries of
// Slots.)
func TestASlotPastTheV1SizeCounts(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	s, err := Open(dir)
	require.NoError(t, err)
	defer s.Close()
	var held []*Slot
	defer func() {
		for _, sl := range held {
			sl.Release(true)
		}
	}()
	start := time.Now()
	for i := 0; i <= v1Slots; i++ {
		sl, err := s.Attach(fmt.Sprintf("e-%d", i), ProtoTCP, uint16(i%60000+1))
		require.NoError(t, err)
		held = append(held, sl)
	}
	t.Logf("%d slots attached in %v", len(held), time.Since(start))
	last := held[v1Slots]
	require.Equal(t, v1Slots, last.Index())
	last.Opened()
	last.AddBytes(11, 22)
	// Free every slot but two: Dump lists what is occupied, nothing else.
	for _, sl := range held[1:v1Slots] {
		sl.Release(true)
	}
	held = []*Slot{held[0], last}
	entries, err := Dump(s.Path())
	require.NoError(t, err)
	require.Len(t, entries, 2)
	assert.Equal(t, v1Slots, entries[1].Slot)
	assert.Equal(t, Counters{Active: 1, Accepted: 1, BytesIn: 11, BytesOut: 22}, entries[1].Counters)

	if _, err := exec.LookPath("bpftool"); err == nil {
		out, err := exec.Command("bpftool", "map", "lookup", "pinned", s.Path(), "key", "0", "0x40", "0", "0").CombinedOutput()
		require.NoError(t, err, "%s", out)
		assert.Contains(t, string(out), `"accepted": 1`)
		assert.Contains(t, string(out), `"bytes_out": 22`)
		assert.Contains(t, string(out), fmt.Sprintf(`"name": "e-%d"`, v1Slots))
	}
}

// loadV1NatPath loads and attaches the nat path as a brokkrd of the v1
// maps did (the same programs, on exposure_stats and the maps beside it),
// pins its links and exits: only the pins keep its programs.
func loadV1NatPath(t *testing.T, tp *natTopo) map[string]ebpf.ProgramID {
	t.Helper()
	requireNetfilterHooks(t)
	ns, err := loadNatpath()
	require.NoError(t, err)
	for _, p := range v1Pins {
		if sp, ok := ns.Maps[p.v2]; ok {
			sp.Name, sp.MaxEntries = p.v1, v1Slots
		}
	}
	var objs natpathObjects
	require.NoError(t, ns.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: tp.pins}}))
	defer objs.Close()
	old := &NatPath{objs: &objs}
	require.NoError(t, old.SetGuests(netip.MustParsePrefix("10.213.0.0/24"), netip.Prefix{}))
	ids := map[string]ebpf.ProgramID{}
	for _, h := range []struct {
		pin    string
		prog   *ebpf.Program
		attach func() (link.Link, error)
	}{
		{pinNatPre, objs.BrkNatPre, func() (link.Link, error) {
			return link.AttachNetfilter(link.NetfilterOptions{Program: objs.BrkNatPre, ProtocolFamily: link.NetfilterProtoIPv4,
				Hook: link.NetfilterInetPreRouting, Priority: NetfilterPriority})
		}},
		{pinNatOut, objs.BrkNatOut, func() (link.Link, error) {
			return link.AttachNetfilter(link.NetfilterOptions{Program: objs.BrkNatOut, ProtocolFamily: link.NetfilterProtoIPv4,
				Hook: link.NetfilterInetLocalOut, Priority: NetfilterPriority})
		}},
		{pinNatReflect, objs.BrkNatReflect, func() (link.Link, error) {
			return link.AttachTCX(link.TCXOptions{Interface: tp.bridge, Program: objs.BrkNatReflect, Attach: ebpf.AttachTCXEgress})
		}},
	} {
		var l link.Link
		require.NoError(t, tp.host.Do(func() (err error) { l, err = h.attach(); return err }))
		require.NoError(t, l.Pin(filepath.Join(tp.pins, h.pin)))
		l.Close()
		ids[h.pin] = progID(t, h.prog)
	}
	require.NoError(t, old.armSweeper())
	return ids
}

// An upgrade from a brokkrd of the v1 maps whose programs are this one's
// (the same tags: a program's tag does not depend on its maps): the
// daemon copies v1, the connections the earlier programs admit meanwhile
// are counted, this binary's programs replace the earlier ones (their
// links and the sweep), the migration ends, and every connection, open
// across the upgrade or not, is counted once with its bytes, and gives its
// place back. (Fails with sameMaps' test removed from sameProgram: the
// earlier links are kept, the earlier programs count on into v1, and the
// migration never ends.)
func TestAnUpgradeFromTheV1MapsReplacesTheEarlierProgramsAndKeepsEveryCount(t *testing.T) {
	pins := nstest.PrivateBPFFS(t)
	const slot = 5000
	pinV1(t, pins)
	v1 := v1View(t, pins)
	v1Slot{slot: slot, name: "web", port: 8080, cap: 3, gen: 4}.write(t, pins, v1)
	tp := newNatNet(t, pins, slot)
	before := loadV1NatPath(t, tp)

	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	defer a.Close()
	roundTrip(t, a, []byte("hello"))

	s, err := Open(pins)
	require.NoError(t, err)
	defer s.Close()
	require.True(t, s.Migrating())
	sl, err := s.Attach("web", ProtoTCP, 8080)
	require.NoError(t, err)
	defer sl.Release(false)
	require.Equal(t, slot, sl.Index())
	assert.EqualValues(t, 1, sl.Read().Accepted)

	// Between the copy and the switch: the earlier programs count into v1.
	b, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, b, []byte("ab"))
	require.NoError(t, b.Close())
	eventually(t, "b counted and closed under the earlier programs", func() bool {
		c := sl.Read()
		return c.Accepted == 2 && c.Active == 1
	})

	np := tp.load(t)
	defer np.Close()
	// Each earlier program that used a v1 map is replaced and unloaded;
	// one that uses none (the reflector: nat_flows alone) may stay.
	now := map[string]ebpf.ProgramID{pinNatPre: progID(t, np.objs.BrkNatPre), pinNatOut: progID(t, np.objs.BrkNatOut)}
	for pin, id := range before {
		if pin == pinNatReflect {
			continue
		}
		assert.NotEqual(t, id, now[pin], "%s runs this binary's program", pin)
		eventually(t, pin+"'s earlier program unloaded", func() bool { return !progLoaded(id) })
	}
	eventually(t, "the migration ends", func() bool {
		done, _ := s.FinishMigration()
		return done
	})
	for _, p := range v1Pins {
		assert.NotContains(t, pinned(pins), p.v1)
	}

	c, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, c, []byte("xyz"))
	require.NoError(t, c.Close())
	roundTrip(t, a, []byte("!"))
	require.NoError(t, a.Close())
	eventually(t, "every place given back", func() bool { return sl.Read().Active == 0 })
	eventually(t, "every byte counted", func() bool { return sl.Read().BytesIn == 5+2+3+1 })
	got := sl.Read()
	assert.Equal(t, Counters{Accepted: 3, BytesIn: 11, BytesOut: 11}, got)
	k, p := sl.Shares()
	assert.Zero(t, k)
	assert.Zero(t, p)
	entries, err := Dump(StatsPin(pins))
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, slot, entries[0].Slot)
	assert.Equal(t, got, entries[0].Counters)
	assert.True(t, strings.HasSuffix(StatsPin(pins), MapName))
}

// The kernel programs count a slot past v1's 16,384 (here 100,000): the
// nat path admits, counts and releases in it, and the pinned map shows
// it. (natpath.c's check of the mark's id against EXPOSURE_SLOTS at
// 16384 again: the connection is let through uncounted and this fails.)
func TestTheNatPathCountsASlotPastTheV1Size(t *testing.T) {
	const slot = 100000
	pins := nstest.PrivateBPFFS(t)
	s, err := Open(pins)
	require.NoError(t, err)
	defer s.Close()
	var fill []*Slot
	for i := 0; i < slot; i++ {
		sl, err := s.Attach(fmt.Sprintf("fill-%d", i), ProtoTCP, 1)
		require.NoError(t, err)
		fill = append(fill, sl)
	}
	sl, err := s.Attach("web", ProtoTCP, 8080)
	require.NoError(t, err)
	defer sl.Release(true)
	require.Equal(t, slot, sl.Index())
	for _, f := range fill {
		f.Release(true)
	}
	sl.SetCap(1)
	tp := newNatNet(t, pins, slot)
	np := tp.load(t)
	defer np.Close()

	a, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, a, []byte("far"))
	_, err = dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.ErrorIs(t, err, unix.ECONNREFUSED, "the cap of slot 100,000 holds")
	require.NoError(t, a.Close())
	eventually(t, "the place given back", func() bool { return sl.Read().Active == 0 })
	entries, err := Dump(filepath.Join(pins, MapName))
	require.NoError(t, err)
	require.Len(t, entries, 1)
	assert.Equal(t, slot, entries[0].Slot)
	assert.Equal(t, Counters{Accepted: 1, Refused: 1, BytesIn: 3, BytesOut: 3}, entries[0].Counters)
}

// Of two pullers that read the same copied value, one moves the gain.
// (Fails with move's compare-and-swap replaced by a store: the gain moves
// twice.)
func TestAGainMovesOnceBetweenTwoPullers(t *testing.T) {
	var seen, dst atomic.Uint64
	last, cur := seen.Load(), uint64(5) // both pullers read these
	assert.True(t, move(&seen, &dst, last, cur))
	assert.False(t, move(&seen, &dst, last, cur), "the second puller's copied value is stale")
	assert.EqualValues(t, 5, dst.Load())
	assert.EqualValues(t, 5, seen.Load())
	// A gauge that went down moves as a wrapping add.
	assert.True(t, move(&seen, &dst, 5, 3))
	assert.EqualValues(t, 3, dst.Load())
}

// Pulls race with the writers of v1 and v2 and with each other (two
// stores, as the old and the new daemon of a hand-over would be), under
// the race detector: every increment arrives once.
func TestPullsMoveEachIncrementOnce(t *testing.T) {
	dir := nstest.PrivateBPFFS(t)
	pinV1(t, dir)
	v1 := v1View(t, dir)
	v1Slot{slot: 42, name: "race", port: 1}.write(t, dir, v1)
	a, err := Open(dir)
	require.NoError(t, err)
	defer a.Close()
	b, err := Open(dir) // the same pins, another Store: the other process
	require.NoError(t, err)
	defer b.Close()
	require.True(t, b.Migrating())
	sa, err := a.Attach("race", ProtoTCP, 1)
	require.NoError(t, err)
	defer sa.Release(false)
	sb, err := b.Attach("race", ProtoTCP, 1)
	require.NoError(t, err)
	defer sb.Release(false)

	const n = 20000
	done := make(chan struct{})
	var readers sync.WaitGroup
	for _, sl := range []*Slot{sa, sb, sa, sb} {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for {
				select {
				case <-done:
					return
				default:
					sl.Read()
				}
			}
		}()
	}
	var writers sync.WaitGroup
	writers.Add(2)
	go func() { // an earlier program, into v1
		defer writers.Done()
		for range n {
			v1.word(42, offAccepted).Add(1)
		}
	}()
	go func() { // the proxy, into v2
		defer writers.Done()
		for range n {
			sa.AddAccepted(1)
		}
	}()
	writers.Wait()
	close(done)
	readers.Wait()
	assert.EqualValues(t, 2*n, sa.Read().Accepted)
	assert.EqualValues(t, 2*n, sb.Read().Accepted)
	ok, err := a.FinishMigration()
	require.NoError(t, err)
	require.True(t, ok)
	assert.EqualValues(t, 2*n, sb.Read().Accepted, "b, its migration ended by a")
}
