package bpf

// The hand-over from the v1 maps (16,384 slots: exposure_stats and the
// maps beside it, as brokkrd up to v0.19 pinned them) to the v2 ones
// (Slots entries, the same layouts). A pinned map cannot be resized, so
// the bigger maps have new names and the counts are copied across.
//
// The copy cannot be the whole story: until this binary's programs
// replace the previous ones (pinned links kept by an earlier daemon, the
// sweep's timer) and the process that handed over is gone, those go on
// writing into the v1 maps. So the copy also keeps, in a pinned map of its
// own (exposure_migration), the value of every counter as it copied it;
// from then on what a v1 counter gained beyond that is moved into v2 by a
// compare-and-swap on the copied value (pull), so each increment moves
// once, whichever process (or several) pulls, and a daemon killed half-way
// goes on from the pinned copy. A read, a cap check and ResetActive pull
// the slot first, so figures are exact while v1 is still written.
// FinishMigration, once no BPF program uses a v1 map any more, pulls every
// slot a last time and removes the v1 pins (and exposure_migration): the
// maps are freed with their last user, and a v1 pin left behind would be
// stale counts under the contract's old name. Nothing that writes v1 can
// then be left: programs are checked by the kernel's own list, and the
// daemon calls it only once the process it took over from is gone.
//
// While the migration is open, a cap set or a slot zeroed is written into
// v1 too, for the earlier programs that may still admit against it (an
// upgrade whose own programs cannot load keeps them serving).

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// V1MapName is the v1 counter map: `brokkr stats` reads it when it is all
// there is (an older brokkrd's, never opened by this one).
const V1MapName = "exposure_stats"

// The v1 maps' pin names.
const (
	v1LimitsMapName = "exposure_limits"
	v1DeniedMapName = "exposure_denied"
	v1FedMapName    = "fallback_fed"
	v1WakeMapName   = "exposure_wake"
	v1AllowMapName  = "allow_restricted"
)

// MigrationMapName is the pin of the values the copy took from v1, per v1
// slot (snapWords counters), while v1 may still be written.
const MigrationMapName = "exposure_migration"

// stagingDir is where the v2 maps are made and filled before they are
// moved beside the v1 ones (exposure_stats_v2 last): a copy interrupted
// half-way leaves no v2 counter map to be taken for a finished one.
const stagingDir = "migrating"

// The counters the copy snapshots and pull moves: exposure_stats' six,
// exposure_denied's, and exposure_limits' shares of active. The rest (the
// names, caps, generations, fed values, wake flags, allowFrom's restricted
// flags) only the daemon writes; they are copied once.
const (
	snapActive = iota
	snapAccepted
	snapRefused
	snapDropped
	snapBytesIn
	snapBytesOut
	snapDenied
	snapProxy
	snapKernel
	snapWords
)

const snapSize = snapWords * 8

// regionSize is each region's value size (a table, not a map literal:
// v1word runs for every word of every pulled slot).
var regionSize = [...]int{inStats: valueSize, inLimits: limitSize, inDenied: deniedSize}

// region says which map a snapshot word lives in and where.
type region int

const (
	inStats region = iota
	inLimits
	inDenied
)

var snapFields = [snapWords]struct {
	r   region
	off int
}{
	snapActive: {inStats, offActive}, snapAccepted: {inStats, offAccepted}, snapRefused: {inStats, offRefused},
	snapDropped: {inStats, offDropped}, snapBytesIn: {inStats, offBytesIn}, snapBytesOut: {inStats, offBytesOut},
	snapDenied: {inDenied, 0}, snapProxy: {inLimits, offProxyActive}, snapKernel: {inLimits, offKernelActive},
}

// migration is the open hand-over from v1: its maps, mapped.
type migration struct {
	mu   sync.RWMutex // pulls share it; zeroV1 and the end take it alone
	done bool
	n    int                   // v1's slots
	maps []*ebpf.Map           // v1's maps and exposure_migration, closed at the end
	ids  map[ebpf.MapID]string // v1's maps, to find their users
	mem  map[region][]byte     // v1's stats, limits and denied values (denied may be absent)
	snap []byte                // exposure_migration's values
	all  [][]byte              // every mapping, unmapped at the end
	pins []string              // v1's pins, then exposure_migration's
}

func (m *migration) v1word(i, k int) *atomic.Uint64 {
	f := snapFields[k]
	mem := m.mem[f.r]
	if mem == nil {
		return nil
	}
	return (*atomic.Uint64)(unsafe.Pointer(&mem[i*regionSize[f.r]+f.off]))
}

func (m *migration) sword(i, k int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&m.snap[i*snapSize+k*8]))
}

func (s *Store) v2word(i, k int) *atomic.Uint64 {
	f := snapFields[k]
	switch f.r {
	case inStats:
		return s.word(i, f.off)
	case inLimits:
		return s.limit64(i, f.off)
	}
	return s.denied(i)
}

// pull moves into slot i what its v1 counters gained since the copy (or
// the last pull): each increment once, by a compare-and-swap on the copied
// value that every puller (in any process) shares.
func (s *Store) pull(i int) {
	m := s.mig.Load()
	if m == nil || i >= m.n {
		return
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if !m.done {
		s.pullLocked(m, i)
	}
}

// pullLocked is pull with m.mu held (either way) and m open.
func (s *Store) pullLocked(m *migration, i int) {
	for k := 0; k < snapWords; k++ {
		src := m.v1word(i, k)
		if src == nil {
			continue
		}
		seen, dst := m.sword(i, k), s.v2word(i, k)
		for {
			last, cur := seen.Load(), src.Load()
			if cur == last || move(seen, dst, last, cur) {
				break
			}
		}
	}
}

// move adds cur-last to dst (wrapping: a gauge that went down) when seen
// still holds last, the value this puller read, and makes it cur: of
// pullers that read the same last, one moves.
func move(seen, dst *atomic.Uint64, last, cur uint64) bool {
	if !seen.CompareAndSwap(last, cur) {
		return false
	}
	dst.Add(cur - last)
	return true
}

// zeroV1 zeroes v1's slot i with v2's (the exposure is gone): its
// counters and their copied values, and the generation, so the earlier
// programs neither count nor free places of the old exposure's flows in
// the next one.
func (s *Store) zeroV1(i int, gen uint32) {
	m := s.mig.Load()
	if m == nil || i >= m.n {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.done {
		return
	}
	for k := 0; k < snapWords; k++ {
		if w := m.v1word(i, k); w != nil {
			w.Store(0)
		}
		m.sword(i, k).Store(0)
	}
	if lim := m.mem[inLimits]; lim != nil {
		(*atomic.Uint32)(unsafe.Pointer(&lim[i*limitSize+offCap])).Store(0)
		(*atomic.Uint32)(unsafe.Pointer(&lim[i*limitSize+offGen])).Store(gen)
	}
}

// capV1 sets the cap of v1's slot i too, for the earlier programs.
func (s *Store) capV1(i int, c uint32) {
	m := s.mig.Load()
	if m == nil || i >= m.n {
		return
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if lim := m.mem[inLimits]; !m.done && lim != nil {
		(*atomic.Uint32)(unsafe.Pointer(&lim[i*limitSize+offCap])).Store(c)
	}
}

// Migrating reports whether the v1 maps are still being carried over.
func (s *Store) Migrating() bool { return s.mig.Load() != nil }

// FinishMigration ends the hand-over from the v1 maps once nothing writes
// them: no BPF program uses one (this binary's replaced the earlier ones)
// and, the caller's part, the process that handed over is gone. Until
// then it moves what v1 gained and returns an error naming who still uses
// it; done is true once there is no migration (or none was needed).
func (s *Store) FinishMigration() (done bool, err error) {
	m := s.mig.Load()
	if m == nil {
		return true, nil
	}
	users, err := programsUsing(m.ids)
	if err != nil {
		return false, err
	}
	if len(users) > 0 {
		for i := 0; i < m.n; i++ {
			s.pull(i)
		}
		return false, fmt.Errorf("the v1 counter maps are still used by BPF programs %v: their counts are carried over until they are replaced", users)
	}
	// Nothing writes v1 any more: the last pull, and the pins go, with
	// m held so that a Close meanwhile neither unmaps under the pull nor
	// lets the pins go without it.
	m.mu.Lock()
	if m.done { // closed meanwhile
		m.mu.Unlock()
		return false, fmt.Errorf("%s: store is closed", MapName)
	}
	for i := 0; i < m.n; i++ {
		s.pullLocked(m, i)
	}
	var errs []error
	for _, p := range m.pins {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	m.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return false, fmt.Errorf("removing the v1 pins: %w", err)
	}
	s.mig.CompareAndSwap(m, nil)
	return true, m.close()
}

func (m *migration) close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.done {
		return nil
	}
	m.done = true
	var errs []error
	for _, b := range m.all {
		errs = append(errs, unix.Munmap(b))
	}
	for _, mp := range m.maps {
		errs = append(errs, mp.Close())
	}
	return errors.Join(errs...)
}

// programsUsing lists the loaded BPF programs that use one of the maps
// ids names ("name (id N) uses map").
func programsUsing(ids map[ebpf.MapID]string) ([]string, error) {
	var users []string
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("listing BPF programs: %w", err)
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // gone meanwhile
		}
		info, err := p.Info()
		p.Close()
		if err != nil {
			continue
		}
		maps, _ := info.MapIDs()
		for _, mid := range maps {
			if name, ok := ids[mid]; ok {
				users = append(users, fmt.Sprintf("%s (id %d) uses %s", info.Name, id, name))
				break
			}
		}
	}
	sort.Strings(users)
	return users, nil
}

// v1Pins are the v1 maps with their v2 names, the counter map first.
var v1Pins = []struct{ v1, v2 string }{
	{V1MapName, MapName}, {v1LimitsMapName, LimitsMapName}, {v1DeniedMapName, DeniedMapName},
	{v1FedMapName, FedMapName}, {v1WakeMapName, WakeMapName}, {v1AllowMapName, AllowRestrictedMapName},
}

func snapSpec(n int) *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: MigrationMapName, Type: ebpf.Array, KeySize: 4, ValueSize: snapSize,
		MaxEntries: uint32(n), Flags: unix.BPF_F_MMAPABLE, Pinning: ebpf.PinByName}
}

// migrateV1 copies the v1 maps under dir into new v2 ones, when v1 is
// there and v2 is not: every slot, its number unchanged, with the
// snapshot pull moves from. The v2 maps are made and filled in stagingDir
// and moved beside v1 at the end, exposure_stats_v2 last.
func migrateV1(dir string) error {
	if exists(filepath.Join(dir, MapName)) || !exists(filepath.Join(dir, V1MapName)) {
		return nil
	}
	// What an interrupted copy left: never a finished one, since
	// exposure_stats_v2 is moved last.
	staging := filepath.Join(dir, stagingDir)
	if err := os.RemoveAll(staging); err != nil {
		return err
	}
	for _, p := range v1Pins[1:] {
		if err := os.Remove(filepath.Join(dir, p.v2)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	if err := os.Remove(filepath.Join(dir, MigrationMapName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.Mkdir(staging, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(staging)

	var closers []func() error
	defer func() {
		for i := len(closers) - 1; i >= 0; i-- {
			_ = closers[i]()
		}
	}()
	mapOf := func(m *ebpf.Map) *ebpf.Map { closers = append(closers, m.Close); return m }
	mmapOf := func(m *ebpf.Map, size int) ([]byte, error) {
		b, err := mmapValues(m, size)
		if err == nil {
			closers = append(closers, func() error { return unix.Munmap(b) })
		}
		return b, err
	}

	// v1: the counter map must be v1's layout; the others may be absent
	// (a brokkrd older still).
	old := map[string]*ebpf.Map{}
	for _, p := range v1Pins {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, p.v1), nil)
		if errors.Is(err, os.ErrNotExist) && p.v1 != V1MapName {
			continue
		}
		if err != nil {
			return err
		}
		old[p.v1] = mapOf(m)
	}
	st := old[V1MapName]
	if int(st.ValueSize()) != valueSize || st.Flags()&unix.BPF_F_MMAPABLE == 0 || st.MaxEntries() > Slots {
		return fmt.Errorf("%s: value size %d, %d entries, flags %#x: not a layout this binary copies", V1MapName, st.ValueSize(), st.MaxEntries(), st.Flags())
	}
	n := int(st.MaxEntries())

	// v2, in staging.
	cs, err := loadStats()
	if err != nil {
		return err
	}
	var objs statsMaps
	if err := cs.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: staging}}); err != nil {
		return err
	}
	mapOf(objs.ExposureStatsV2)
	mapOf(objs.ExposureLimitsV2)
	mapOf(objs.ExposureDeniedV2)
	fed, err := ebpf.NewMapWithOptions(fedSpec(), ebpf.MapOptions{PinPath: staging})
	if err != nil {
		return err
	}
	mapOf(fed)
	ws, err := loadWake()
	if err != nil {
		return err
	}
	wake, err := ebpf.NewMapWithOptions(ws.Maps[WakeMapName], ebpf.MapOptions{PinPath: staging})
	if err != nil {
		return err
	}
	mapOf(wake)
	ns, err := loadNatpath()
	if err != nil {
		return err
	}
	allow, err := ebpf.NewMapWithOptions(ns.Maps[AllowRestrictedMapName], ebpf.MapOptions{PinPath: staging})
	if err != nil {
		return err
	}
	mapOf(allow)
	snap, err := ebpf.NewMapWithOptions(snapSpec(n), ebpf.MapOptions{PinPath: staging})
	if err != nil {
		return err
	}
	mapOf(snap)

	dst := &Store{}
	if dst.mem, err = mmapOf(objs.ExposureStatsV2, valueSize); err != nil {
		return err
	}
	if dst.lmem, err = mmapOf(objs.ExposureLimitsV2, limitSize); err != nil {
		return err
	}
	if dst.dmem, err = mmapOf(objs.ExposureDeniedV2, deniedSize); err != nil {
		return err
	}
	if dst.fmem, err = mmapOf(fed, fedSize); err != nil {
		return err
	}
	src := &migration{n: n, mem: map[region][]byte{}}
	if src.snap, err = mmapOf(snap, snapSize); err != nil {
		return err
	}
	if src.mem[inStats], err = mmapOf(st, valueSize); err != nil {
		return err
	}
	var oldFed []byte
	for name, r := range map[string]region{v1LimitsMapName: inLimits, v1DeniedMapName: inDenied, v1FedMapName: -1} {
		m := old[name]
		if m == nil {
			continue
		}
		if int(m.MaxEntries()) != n {
			return fmt.Errorf("%s: %d entries beside %s's %d", name, m.MaxEntries(), V1MapName, n)
		}
		size := map[region]int{inLimits: limitSize, inDenied: deniedSize, -1: fedSize}[r]
		if int(m.ValueSize()) != size {
			return fmt.Errorf("%s: value size %d, want %d", name, m.ValueSize(), size)
		}
		b, err := mmapOf(m, size)
		if err != nil {
			return err
		}
		if r < 0 {
			oldFed = b
		} else {
			src.mem[r] = b
		}
	}

	for i := 0; i < n; i++ {
		b := i * valueSize
		// The name, protocol and port: only the daemon writes them.
		copy(dst.mem[b:b+offActive], src.mem[inStats][b:b+offActive])
		if lim := src.mem[inLimits]; lim != nil {
			l := i * limitSize
			copy(dst.lmem[l:l+limitSize], lim[l:l+limitSize]) // cap, gen, reserved
		}
		if oldFed != nil {
			copy(dst.fmem[i*fedSize:(i+1)*fedSize], oldFed[i*fedSize:(i+1)*fedSize])
		}
		// The counters: one read each, into v2 and the snapshot alike.
		for k := 0; k < snapWords; k++ {
			var v uint64
			if w := src.v1word(i, k); w != nil {
				v = w.Load()
			}
			dst.v2word(i, k).Store(v)
			src.sword(i, k).Store(v)
		}
	}
	// The wake flags and allowFrom's restricted flags (arrays without
	// BPF_F_MMAPABLE): the set ones.
	for _, p := range []struct {
		from string
		to   *ebpf.Map
	}{{v1WakeMapName, wake}, {v1AllowMapName, allow}} {
		m := old[p.from]
		if m == nil {
			continue
		}
		var k, v uint32
		it := m.Iterate()
		for it.Next(&k, &v) {
			if v == 0 || int(k) >= Slots {
				continue
			}
			if err := p.to.Update(k, v, ebpf.UpdateAny); err != nil {
				return fmt.Errorf("%s[%d]: %w", p.from, k, err)
			}
		}
		if err := it.Err(); err != nil {
			return fmt.Errorf("reading %s: %w", p.from, err)
		}
	}

	// Into place: the snapshot first, the counter map last.
	for _, name := range []string{MigrationMapName, LimitsMapName, DeniedMapName, FedMapName, WakeMapName, AllowRestrictedMapName, MapName} {
		if err := os.Rename(filepath.Join(staging, name), filepath.Join(dir, name)); err != nil {
			return err
		}
	}
	return nil
}

// resumeMigration opens what migrateV1 (in this process or an earlier
// one) left to carry over: v1's maps and the snapshot.
func (s *Store) resumeMigration(dir string) error {
	snapPin := filepath.Join(dir, MigrationMapName)
	if !exists(snapPin) {
		return nil
	}
	if !exists(filepath.Join(dir, V1MapName)) {
		// A migration that ended before it removed its snapshot.
		return os.Remove(snapPin)
	}
	m := &migration{mem: map[region][]byte{}, ids: map[ebpf.MapID]string{}}
	fail := func(err error) error {
		_ = m.close()
		return err
	}
	for _, p := range v1Pins {
		path := filepath.Join(dir, p.v1)
		mp, err := ebpf.LoadPinnedMap(path, nil)
		if errors.Is(err, os.ErrNotExist) && p.v1 != V1MapName {
			continue
		}
		if err != nil {
			return fail(err)
		}
		m.maps = append(m.maps, mp)
		m.pins = append(m.pins, path)
		if info, err := mp.Info(); err == nil {
			if id, ok := info.ID(); ok {
				m.ids[id] = p.v1
			}
		}
		var r region
		switch p.v1 {
		case V1MapName:
			r = inStats
		case v1LimitsMapName:
			r = inLimits
		case v1DeniedMapName:
			r = inDenied
		default:
			continue
		}
		size := map[region]int{inStats: valueSize, inLimits: limitSize, inDenied: deniedSize}[r]
		if int(mp.ValueSize()) != size {
			return fail(fmt.Errorf("%s: value size %d, want %d", p.v1, mp.ValueSize(), size))
		}
		b, err := mmapValues(mp, size)
		if err != nil {
			return fail(err)
		}
		m.all = append(m.all, b)
		m.mem[r] = b
	}
	m.n = int(m.maps[0].MaxEntries())
	sm, err := ebpf.LoadPinnedMap(snapPin, nil)
	if err != nil {
		return fail(err)
	}
	m.maps = append(m.maps, sm)
	m.pins = append(m.pins, snapPin)
	if int(sm.MaxEntries()) != m.n || int(sm.ValueSize()) != snapSize {
		return fail(fmt.Errorf("%s: %d entries of %d bytes, want %d of %d", MigrationMapName, sm.MaxEntries(), sm.ValueSize(), m.n, snapSize))
	}
	if m.snap, err = mmapValues(sm, snapSize); err != nil {
		return fail(err)
	}
	m.all = append(m.all, m.snap)
	s.mig.Store(m)
	return nil
}
