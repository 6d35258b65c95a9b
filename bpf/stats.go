// Package bpf holds brokkr's eBPF objects and the Go side of the per-exposure
// counter map, exposure_stats_v2, shared by the kernel fast path (netplane) and
// the userspace proxy.
//
// The map is a BPF_F_MMAPABLE array pinned under bpfDir. A Store maps it into
// the process and counters are bumped with atomic operations on that memory,
// so counting a connection or a buffer of bytes costs no syscall. Slots are
// found again by name after a restart, so counters survive the daemon; a slot
// is zeroed only when its exposure is deleted.
package bpf

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/spec"
)

const (
	// MapName is the pin name under bpfDir. A changed value layout or size
	// gets a new name, so an old pin is never misread: v2 is v1's
	// (exposure_stats, V1MapName) layout with Slots entries, where v1 had
	// 16,384 (migrate.go copies v1 into it).
	MapName = "exposure_stats_v2"
	// NameLen is the size of the name field, NUL included.
	NameLen = 64
	// MaxNameLen is the longest exposure name a slot can hold.
	MaxNameLen = NameLen - 1
	// Slots is the number of entries in the array (and in every map
	// indexed by the slot): 131,072. The v2 maps take 131,072 × (120 +
	// 32 + 8 + 24 + 4 + 4) bytes, 24 MiB: exposure_stats_v2 15 MiB,
	// exposure_limits_v2 4, fallback_fed_v2 3, exposure_denied_v2 1,
	// exposure_wake_v2 and allow_restricted_v2 0.5 each.
	Slots = spec.MaxExposures

	// bpffsMagic is BPF_FS_MAGIC from statfs(2).
	bpffsMagic = 0xcafe4a11
)

// statLayout is the value struct as bpf2go generated it from exposure_stats.c.
type statLayout = statsExposureStat

// limitLayout is the value of exposure_limits_v2 (exposure.h).
type limitLayout = statsExposureLimit

const (
	valueSize = int(unsafe.Sizeof(statLayout{}))
	limitSize = int(unsafe.Sizeof(limitLayout{}))
)

// Field offsets inside one value, taken from the generated struct so the Go
// and C views cannot drift.
var (
	offProtocol = int(unsafe.Offsetof(statLayout{}.Protocol))
	offHostPort = int(unsafe.Offsetof(statLayout{}.HostPort))
	offActive   = int(unsafe.Offsetof(statLayout{}.Active))
	offAccepted = int(unsafe.Offsetof(statLayout{}.Accepted))
	offRefused  = int(unsafe.Offsetof(statLayout{}.Refused))
	offDropped  = int(unsafe.Offsetof(statLayout{}.Dropped))
	offBytesIn  = int(unsafe.Offsetof(statLayout{}.BytesIn))
	offBytesOut = int(unsafe.Offsetof(statLayout{}.BytesOut))

	offCap          = int(unsafe.Offsetof(limitLayout{}.Cap))
	offGen          = int(unsafe.Offsetof(limitLayout{}.Gen))
	offProxyActive  = int(unsafe.Offsetof(limitLayout{}.ProxyActive))
	offKernelActive = int(unsafe.Offsetof(limitLayout{}.KernelActive))
)

// LimitsMapName is the pin name of the cap and generation map beside
// exposure_stats_v2.
const LimitsMapName = "exposure_limits_v2"

// WakeMapName and AllowRestrictedMapName are the other maps indexed by the
// slot (wake.h, natpath.c), sized by Slots and renamed with it.
const (
	WakeMapName            = "exposure_wake_v2"
	AllowRestrictedMapName = "allow_restricted_v2"
)

// Protocol numbers as stored in the map.
const (
	ProtoTCP uint32 = unix.IPPROTO_TCP
	ProtoUDP uint32 = unix.IPPROTO_UDP
)

// ProtoNumber maps "tcp"/"udp" to the number stored in the map (0 if unknown).
func ProtoNumber(name string) uint32 {
	switch strings.ToLower(name) {
	case "tcp":
		return ProtoTCP
	case "udp":
		return ProtoUDP
	}
	return 0
}

// ProtoName is the inverse of ProtoNumber.
func ProtoName(n uint32) string {
	switch n {
	case ProtoTCP:
		return "tcp"
	case ProtoUDP:
		return "udp"
	}
	return fmt.Sprintf("proto-%d", n)
}

// Counters is one exposure's figures. Active is a gauge, the rest are totals.
type Counters struct {
	Active   uint64 `json:"active"`
	Accepted uint64 `json:"accepted"`
	Refused  uint64 `json:"refused"`
	Dropped  uint64 `json:"dropped"`
	BytesIn  uint64 `json:"bytesIn"`
	BytesOut uint64 `json:"bytesOut"`
	// Denied is the callers allowFrom turned away (exposure_denied_v2).
	Denied uint64 `json:"denied"`
}

// Entry is one occupied slot, as Dump returns it.
type Entry struct {
	Slot     int
	Name     string
	Protocol uint32
	HostPort uint32
	Counters
}

// Store is the process's view of exposure_stats_v2: the pinned, mmapped map,
// or plain memory when BPF is not available. Use one Store per pin per
// process.
type Store struct {
	mu     sync.Mutex
	m      *ebpf.Map // nil in memory mode
	lm     *ebpf.Map // exposure_limits_v2; nil in memory mode
	fm     *ebpf.Map // fallback_fed_v2; nil in memory mode
	dm     *ebpf.Map // exposure_denied_v2; nil in memory mode
	mem    []byte    // mmapped map values, or anonymous memory
	lmem   []byte    // mmapped exposure_limits_v2 values, or anonymous memory
	fmem   []byte    // mmapped fallback_fed_v2 values, or anonymous memory
	bm     *ebpf.Map // fallback_bytes_fed_v2; nil in memory mode
	bmem   []byte    // mmapped fallback_bytes_fed_v2 values, or anonymous memory
	dmem   []byte    // mmapped exposure_denied_v2 values, or anonymous memory
	path   string    // pin path; "" in memory mode
	reason string    // why the store is in memory, if it is
	byName map[string]int
	refs   map[int]int
	// hint is the lowest slot that may be free: Attach looks from there,
	// so taking n slots costs O(n), not O(n × Slots).
	hint   int
	closed bool
	// mig is the copy from the v1 maps while their writers may still
	// count into them (migrate.go); nil when there is none.
	mig atomic.Pointer[migration]
}

// Open loads (or creates) the map pinned at dir/exposure_stats_v2 and maps
// it into memory. dir must be on a bpffs; see EnsureBPFFS. When only the v1
// maps are pinned there (an older brokkrd's, 16,384 slots), their every
// slot is copied into the v2 ones first, slot numbers unchanged, and what
// their writers add afterwards is carried over until FinishMigration
// (migrate.go).
func Open(dir string) (*Store, error) {
	if err := checkBPFFS(dir); err != nil {
		return nil, err
	}
	if err := liftMemlock(); err != nil {
		return nil, err
	}
	if err := migrateV1(dir); err != nil {
		return nil, fmt.Errorf("copying %s into %s: %w", filepath.Join(dir, V1MapName), MapName, err)
	}
	s, err := openV2(dir)
	if err != nil {
		return nil, err
	}
	if err := s.resumeMigration(dir); err != nil {
		s.Close()
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, V1MapName), err)
	}
	return s, nil
}

func openV2(dir string) (*Store, error) {
	cs, err := loadStats()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", MapName, err)
	}
	var objs statsMaps
	err = cs.LoadAndAssign(&objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}})
	if errors.Is(err, ebpf.ErrMapIncompatible) {
		return nil, fmt.Errorf("%s: a pinned map with another layout is in the way (remove it, or it belongs to another version): %w", filepath.Join(dir, MapName), err)
	}
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", filepath.Join(dir, MapName), err)
	}
	s := &Store{m: objs.ExposureStatsV2, lm: objs.ExposureLimitsV2, dm: objs.ExposureDeniedV2, path: filepath.Join(dir, MapName)}
	// What is mapped or made so far, undone in reverse when a step fails.
	var undo []func()
	fail := func(what string, err error) (*Store, error) {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		objs.Close()
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, what), err)
	}
	mapped := func(m *ebpf.Map, size int, into *[]byte) error {
		b, err := mmapValues(m, size)
		if err != nil {
			return fmt.Errorf("mmap: %w", err)
		}
		*into = b
		undo = append(undo, func() { _ = unix.Munmap(b) })
		return nil
	}
	for _, r := range []struct {
		m    *ebpf.Map
		size int
		into *[]byte
		name string
	}{{s.m, valueSize, &s.mem, MapName}, {s.lm, limitSize, &s.lmem, LimitsMapName}, {s.dm, deniedSize, &s.dmem, DeniedMapName}} {
		if err := mapped(r.m, r.size, r.into); err != nil {
			return fail(r.name, err)
		}
	}
	// The fed maps only brokkrd reads, made here, not by the programs' objects.
	for _, r := range []struct {
		spec *ebpf.MapSpec
		m    **ebpf.Map
		into *[]byte
	}{{fedSpec(), &s.fm, &s.fmem}, {bytesFedSpec(), &s.bm, &s.bmem}} {
		m, err := ebpf.NewMapWithOptions(r.spec, ebpf.MapOptions{PinPath: dir})
		if err != nil {
			return fail(r.spec.Name, err)
		}
		undo = append(undo, func() { m.Close() })
		*r.m = m
		if err := mapped(m, fedSize, r.into); err != nil {
			return fail(r.spec.Name, err)
		}
	}
	s.index()
	return s, nil
}

// BytesFedMapName is the pin of the bytes the daemon last fed into each
// slot from the event-fed fallback's nft byte counters, as FedMapName is
// for accepted and refused: per slot {valid, in, out}. A map of its own (a
// pinned map keeps its layout): where it is not yet, the first feed of a
// slot is its baseline, once.
const BytesFedMapName = "fallback_bytes_fed_v2"

func bytesFedSpec() *ebpf.MapSpec {
	spec := fedSpec()
	spec.Name = BytesFedMapName
	return spec
}

// DeniedMapName is the pin of the callers allowFrom turned away, per slot
// (denied.h): a map of its own, so exposure_stats_v2 keeps its layout.
const DeniedMapName = "exposure_denied_v2"

const deniedSize = int(unsafe.Sizeof(statsExposureDeny{}))

// FedMapName is the pin of what the daemon last fed into each slot from
// kernel counters it reads itself (the event-fed fallback's nft counters):
// per slot {valid, accepted, refused}, zeroed and made valid with the slot.
// Only brokkrd reads it; no program does.
const FedMapName = "fallback_fed_v2"

// A fed record, in fallback_fed_v2 and fallback_bytes_fed_v2 alike: {valid,
// a, b} (accepted and refused; bytes in and out).
const (
	fedSize     = 24
	offFedValid = 0
	offFedA     = 8
	offFedB     = 16
)

func fedSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{Name: FedMapName, Type: ebpf.Array, KeySize: 4, ValueSize: fedSize,
		MaxEntries: Slots, Flags: unix.BPF_F_MMAPABLE, Pinning: ebpf.PinByName}
}

// liftMemlock removes RLIMIT_MEMLOCK for this process where the kernel
// still charges BPF maps and programs to it (before 5.11: Debian 11's 5.10
// refused even the 16,384-slot maps under the default 8 MiB); newer kernels
// charge the memory cgroup, and this does nothing.
var liftMemlock = sync.OnceValue(func() error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return fmt.Errorf("raising RLIMIT_MEMLOCK for BPF maps: %w", err)
	}
	return nil
})

func mmapValues(m *ebpf.Map, size int) ([]byte, error) {
	return mmapN(m, int(m.MaxEntries())*size)
}

// mmapN maps the first n bytes of m's values read-write.
func mmapN(m *ebpf.Map, n int) ([]byte, error) {
	n = (n + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	return unix.Mmap(m.FD(), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

// anonWords is n bytes of zeroed, page-aligned private memory: the
// kernel gives a page only when it is first written, so an in-memory
// store of Slots entries (24 MiB of address space) costs what its used
// slots touch, not 24 MiB of heap for the garbage collector to scan.
func anonWords(n int) []byte {
	n = (n + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		panic(fmt.Sprintf("in-memory counters: mmap of %d bytes: %v", n, err))
	}
	return b
}

// NewInMemory returns a Store that counts in process memory only; reason says
// why (it is reported in status so an operator knows bpftool will not see it).
func NewInMemory(reason string) *Store {
	s := &Store{mem: anonWords(Slots * valueSize), lmem: anonWords(Slots * limitSize), fmem: anonWords(Slots * fedSize),
		bmem: anonWords(Slots * fedSize), dmem: anonWords(Slots * deniedSize), reason: reason}
	// Fresh memory holds no names: nothing to index.
	s.byName = make(map[string]int)
	s.refs = make(map[int]int)
	return s
}

func (s *Store) index() {
	s.byName = make(map[string]int)
	s.refs = make(map[int]int)
	for i := 0; i < Slots; i++ {
		if s.mem[s.base(i)] == 0 { // a free slot: one byte read, no string
			continue
		}
		s.byName[s.nameAt(i)] = i
	}
}

// Pinned reports whether counters live in the pinned BPF map.
func (s *Store) Pinned() bool { return s.m != nil }

// Path is the pin path ("" in memory mode).
func (s *Store) Path() string { return s.path }

// Reason says why the store is in memory ("" when pinned).
func (s *Store) Reason() string { return s.reason }

// Close unmaps the map and drops the process's handle. The pin and its values
// stay for the next process.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	if s.m == nil {
		// The memory stays mapped: a Slot still held somewhere may count
		// into it, as it could into the heap this memory replaced.
		return nil
	}
	var merr error
	if m := s.mig.Swap(nil); m != nil {
		merr = m.close()
	}
	err := errors.Join(merr, unix.Munmap(s.mem), unix.Munmap(s.lmem), unix.Munmap(s.fmem), unix.Munmap(s.bmem), unix.Munmap(s.dmem))
	return errors.Join(err, s.m.Close(), s.lm.Close(), s.fm.Close(), s.bm.Close(), s.dm.Close())
}

func (s *Store) base(i int) int { return i * valueSize }

func (s *Store) word(i, off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.mem[s.base(i)+off]))
}

func (s *Store) u32(i, off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&s.mem[s.base(i)+off]))
}

func (s *Store) limit64(i, off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.lmem[i*limitSize+off]))
}

func (s *Store) limit32(i, off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&s.lmem[i*limitSize+off]))
}

func (s *Store) denied(i int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.dmem[i*deniedSize]))
}

func (s *Store) nameAt(i int) string {
	b := s.mem[s.base(i) : s.base(i)+NameLen]
	if n := bytes.IndexByte(b, 0); n >= 0 {
		b = b[:n]
	}
	return string(b)
}

func (s *Store) read(i int) Counters {
	s.pull(i)
	return Counters{
		Active:   s.word(i, offActive).Load(),
		Accepted: s.word(i, offAccepted).Load(),
		Refused:  s.word(i, offRefused).Load(),
		Dropped:  s.word(i, offDropped).Load(),
		BytesIn:  s.word(i, offBytesIn).Load(),
		BytesOut: s.word(i, offBytesOut).Load(),
		Denied:   s.denied(i).Load(),
	}
}

// zero frees slot i (and lowers Attach's hint to it).
func (s *Store) zero(i int) {
	if i < s.hint {
		s.hint = i
	}
	for _, off := range []int{offActive, offAccepted, offRefused, offDropped, offBytesIn, offBytesOut} {
		s.word(i, off).Store(0)
	}
	s.denied(i).Store(0)
	s.u32(i, offProtocol).Store(0)
	s.u32(i, offHostPort).Store(0)
	clear(s.mem[s.base(i) : s.base(i)+NameLen])
	// A new generation: flows the kernel still tracks for the slot's old
	// exposure no longer count in it.
	s.limit32(i, offCap).Store(0)
	s.limit64(i, offProxyActive).Store(0)
	s.limit64(i, offKernelActive).Store(0)
	gen := s.limit32(i, offGen).Add(1)
	s.zeroV1(i, gen)
	// Nothing fed yet, and that is known: the exposure's kernel counters
	// are made after its slot, from zero.
	for _, mem := range [][]byte{s.fmem, s.bmem} {
		fedWord(mem, i, offFedA).Store(0)
		fedWord(mem, i, offFedB).Store(0)
		fedWord(mem, i, offFedValid).Store(1)
	}
}

// fedWord is word off of slot i's record in a fed map's values mem.
func fedWord(mem []byte, i, off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&mem[i*fedSize+off]))
}

// ValidName reports whether name fits a slot.
func ValidName(name string) error {
	if name == "" {
		return errors.New("empty name")
	}
	if len(name) > MaxNameLen {
		return fmt.Errorf("name %q is longer than %d bytes", name, MaxNameLen)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("name %q contains NUL", name)
	}
	return nil
}

// Attach returns the slot for the named exposure, finding it again if an
// earlier process left it in the map, or taking a free one. Protocol and host
// port are (re)written so bpftool shows the exposure's current shape. Every
// Attach must be paired with a Release.
func (s *Store) Attach(name string, protocol uint32, hostPort uint16) (*Slot, error) {
	if err := ValidName(name); err != nil {
		return nil, fmt.Errorf("%s slot: %w", MapName, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("%s: store is closed", MapName)
	}
	i, ok := s.byName[name]
	if !ok {
		i = -1
		for j := s.hint; j < Slots; j++ {
			if s.mem[s.base(j)] == 0 && s.refs[j] == 0 {
				i = j
				break
			}
		}
		if i < 0 {
			return nil, fmt.Errorf("%s: all %d slots are in use", MapName, Slots)
		}
		s.zero(i)
		s.hint = i + 1
		copy(s.mem[s.base(i):s.base(i)+MaxNameLen], name)
		s.byName[name] = i
	}
	s.u32(i, offProtocol).Store(protocol)
	s.u32(i, offHostPort).Store(uint32(hostPort))
	s.refs[i]++
	return &Slot{s: s, i: i, name: name}, nil
}

// Lookup reads the named exposure's counters without attaching.
func (s *Store) Lookup(name string) (Counters, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.byName[name]
	if !ok {
		return Counters{}, false
	}
	return s.read(i), true
}

// ResetActive takes the proxy's share out of every active gauge. A daemon
// calls it once at start: the connections the previous process proxied died
// with it, while the kernel paths' connections live on and keep their
// places (the kernel maintains that share itself). After a hand-over,
// keep[name] of the proxy's places are still held, by connections this
// process now carries and will close (nil: none).
func (s *Store) ResetActive(keep map[string]uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, i := range s.byName {
		s.pull(i) // the proxy's share v1 still had, first
		k := keep[name]
		p := s.limit64(i, offProxyActive).Swap(k)
		if p < k { // never: a place handed over was taken in this slot
			k = p
			s.limit64(i, offProxyActive).Store(p)
		}
		s.word(i, offActive).Add(-(p - k))
	}
}

// Prune zeroes and frees every slot whose name keep rejects and that no one
// holds: exposures deleted while no process was watching.
func (s *Store) Prune(keep func(name string) bool) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var gone []string
	for name, i := range s.byName {
		if s.refs[i] > 0 || keep(name) {
			continue
		}
		s.zero(i)
		delete(s.byName, name)
		gone = append(gone, name)
	}
	sort.Strings(gone)
	return gone
}

// Entries lists the occupied slots, in slot order.
func (s *Store) Entries() []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Entry, 0, len(s.byName))
	for name, i := range s.byName {
		out = append(out, Entry{Slot: i, Name: name, Protocol: s.u32(i, offProtocol).Load(),
			HostPort: s.u32(i, offHostPort).Load(), Counters: s.read(i)})
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Slot < out[b].Slot })
	return out
}

// Slot is one exposure's entry. Its methods are safe for concurrent use and
// cost one atomic instruction each.
type Slot struct {
	s        *Store
	i        int
	name     string
	released atomic.Bool
}

// Index is the array index, for tools and BPF programs.
func (sl *Slot) Index() int { return sl.i }

// Name is the exposure name the slot carries.
func (sl *Slot) Name() string { return sl.name }

func (sl *Slot) add(off int, d uint64) { sl.s.word(sl.i, off).Add(d) }

// Opened counts a connection the proxy admitted without a cap: accepted+1,
// active+1.
func (sl *Slot) Opened() {
	sl.add(offAccepted, 1)
	sl.add(offActive, 1)
	sl.s.limit64(sl.i, offProxyActive).Add(1)
}

// Reserve takes a place of the exposure's one cap, shared with the kernel
// paths, for a proxied connection: a compare-and-increment of the slot's
// active gauge, the same the BPF programs do. It reports false (and counts
// nothing) when the cap is full. A reservation ends with Closed.
func (sl *Slot) Reserve() bool {
	sl.s.pull(sl.i) // what v1's writers admitted, while they may
	active := sl.s.word(sl.i, offActive)
	limit := sl.s.limit32(sl.i, offCap)
	for {
		cur := active.Load()
		if c := limit.Load(); c != 0 && cur >= uint64(c) {
			return false
		}
		if active.CompareAndSwap(cur, cur+1) {
			sl.s.limit64(sl.i, offProxyActive).Add(1)
			return true
		}
	}
}

// TryOpen is Reserve that also counts the connection accepted.
func (sl *Slot) TryOpen() bool {
	if !sl.Reserve() {
		return false
	}
	sl.add(offAccepted, 1)
	return true
}

// Closed is the end of a connection counted by Opened or TryOpen: active-1.
func (sl *Slot) Closed() {
	sl.add(offActive, ^uint64(0))
	sl.s.limit64(sl.i, offProxyActive).Add(^uint64(0))
}

// SetCap sets the exposure's one cap (0 = unlimited), read by every path.
func (sl *Slot) SetCap(c uint32) {
	sl.s.limit32(sl.i, offCap).Store(c)
	sl.s.capV1(sl.i, c)
}

// Cap is the cap SetCap set.
func (sl *Slot) Cap() uint32 { return sl.s.limit32(sl.i, offCap).Load() }

// SetKernelActive sets the kernel path's share of active to n, for a kernel
// path whose connections the daemon counts itself (the event-fed fallback).
func (sl *Slot) SetKernelActive(n uint64) {
	old := sl.s.limit64(sl.i, offKernelActive).Swap(n)
	sl.add(offActive, n-old)
}

// Shares returns the kernel paths' and the proxy's parts of active.
func (sl *Slot) Shares() (kernel, proxy uint64) {
	return sl.s.limit64(sl.i, offKernelActive).Load(), sl.s.limit64(sl.i, offProxyActive).Load()
}

// AddAccepted, AddRefused and AddDropped add to the totals.
func (sl *Slot) AddAccepted(n uint64) { sl.add(offAccepted, n) }
func (sl *Slot) AddRefused(n uint64)  { sl.add(offRefused, n) }
func (sl *Slot) AddDropped(n uint64)  { sl.add(offDropped, n) }

// AddDenied counts callers allowFrom turned away.
func (sl *Slot) AddDenied(n uint64) { sl.s.denied(sl.i).Add(n) }

// Gen is the slot's generation, bumped whenever it is given to an
// exposure: what the kernel keeps per slot (the nat path's allowFrom) is
// written for one generation.
func (sl *Slot) Gen() uint32 { return sl.s.limit32(sl.i, offGen).Load() }

// AddBytes adds to bytes_in (caller to guest) and bytes_out (guest to caller).
func (sl *Slot) AddBytes(in, out uint64) {
	if in != 0 {
		sl.add(offBytesIn, in)
	}
	if out != 0 {
		sl.add(offBytesOut, out)
	}
}

// FeedKernelTotals adds to accepted and refused what two kernel counters
// the daemon reads itself (the event-fed fallback's nft counters, absolute
// since the table made them) gained since the values last fed. Those are
// kept beside the slot in the pinned fallback_fed_v2 map, so a new daemon goes
// on exactly where the last one stopped and counts what the kernel admitted
// while no daemon ran: never a first-read baseline. A value below the last
// one is a counter made anew (the table re-created): all of it is new. A
// slot that an older brokkrd left without a fed record takes the first
// values as its baseline, once.
func (sl *Slot) FeedKernelTotals(accepted, refused uint64) {
	if a, r, ok := fedGrowth(sl.s.fmem, sl.i, accepted, refused); ok {
		sl.AddAccepted(a)
		sl.AddRefused(r)
	}
}

// FeedKernelBytes is FeedKernelTotals for the bytes per direction (the
// event-fed fallback's nft byte counters), remembered in the pinned
// fallback_bytes_fed_v2 map: what the kernel counted while no daemon ran is
// counted once the next one feeds.
func (sl *Slot) FeedKernelBytes(in, out uint64) {
	if i, o, ok := fedGrowth(sl.s.bmem, sl.i, in, out); ok {
		sl.AddBytes(i, o)
	}
}

// fedGrowth records a and b as what slot i was last fed in a fed map's
// values mem and returns how much each grew since the values recorded
// before; not ok when nothing was recorded (the first values are a
// baseline).
func fedGrowth(mem []byte, i int, a, b uint64) (ga, gb uint64, ok bool) {
	lastA, lastB := fedWord(mem, i, offFedA).Swap(a), fedWord(mem, i, offFedB).Swap(b)
	if fedWord(mem, i, offFedValid).Swap(1) == 0 {
		return 0, 0, false
	}
	return grown(lastA, a), grown(lastB, b), true
}

// grown is how much a monotonic counter that may have restarted from zero
// went up from last to cur.
func grown(last, cur uint64) uint64 {
	if cur >= last {
		return cur - last
	}
	return cur
}

// Read returns the slot's current counters.
func (sl *Slot) Read() Counters { return sl.s.read(sl.i) }

// Release gives the slot back. With deleted set and no other holder left, the
// exposure is gone for good: the slot is zeroed and freed. Without it the
// values stay for the next process (a daemon stopping, not a deletion).
func (sl *Slot) Release(deleted bool) {
	if sl.released.Swap(true) {
		return
	}
	s := sl.s
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refs[sl.i]--
	if s.refs[sl.i] > 0 {
		return
	}
	delete(s.refs, sl.i)
	if deleted && !s.closed {
		s.zero(sl.i)
		delete(s.byName, sl.name)
	}
}

// Dump reads a pinned exposure_stats_v2 map (or a v1 exposure_stats, its
// layout with fewer slots) without attaching: what `brokkr stats` uses,
// daemon or not. The values are mapped PROT_READ (the kernel maps a BPF
// map only through a descriptor that may write, so the map is opened
// read-write and never written) and only the occupied slots, a name's
// first byte, are read: no copy of the whole map, no syscall per slot.
func Dump(pinPath string) ([]Entry, error) {
	m, err := ebpf.LoadPinnedMap(pinPath, nil)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", pinPath, err)
	}
	defer m.Close()
	if int(m.ValueSize()) != valueSize || m.Type() != ebpf.Array || m.Flags()&unix.BPF_F_MMAPABLE == 0 {
		return nil, fmt.Errorf("%s: %v of value size %d, flags %#x: not the layout of %s (another version)", pinPath, m.Type(), m.ValueSize(), m.Flags(), MapName)
	}
	n := int(m.MaxEntries())
	mem, err := mmapRead(m, n*valueSize)
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", pinPath, err)
	}
	defer unix.Munmap(mem)
	var out []Entry
	for i := 0; i < n; i++ {
		b := i * valueSize
		if mem[b] == 0 {
			continue
		}
		w := func(off int) uint64 { return (*atomic.Uint64)(unsafe.Pointer(&mem[b+off])).Load() }
		u := func(off int) uint32 { return (*atomic.Uint32)(unsafe.Pointer(&mem[b+off])).Load() }
		name := mem[b : b+NameLen]
		if k := bytes.IndexByte(name, 0); k >= 0 {
			name = name[:k]
		}
		out = append(out, Entry{Slot: i, Name: string(name), Protocol: u(offProtocol), HostPort: u(offHostPort),
			Counters: Counters{Active: w(offActive), Accepted: w(offAccepted), Refused: w(offRefused), Dropped: w(offDropped),
				BytesIn: w(offBytesIn), BytesOut: w(offBytesOut)}})
	}
	// denied sits beside, in exposure_denied_v2 (exposure_denied for v1;
	// absent where an older brokkrd made the pins: nothing was denied).
	deniedPin := filepath.Join(filepath.Dir(pinPath), DeniedMapName)
	if filepath.Base(pinPath) == V1MapName {
		deniedPin = filepath.Join(filepath.Dir(pinPath), v1DeniedMapName)
	}
	dm, err := ebpf.LoadPinnedMap(deniedPin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", deniedPin, err)
	}
	defer dm.Close()
	if int(dm.ValueSize()) != deniedSize || int(dm.MaxEntries()) != n {
		return nil, fmt.Errorf("%s: %d entries of %d bytes beside %d of %s", deniedPin, dm.MaxEntries(), dm.ValueSize(), n, pinPath)
	}
	dmem, err := mmapRead(dm, n*deniedSize)
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", deniedPin, err)
	}
	defer unix.Munmap(dmem)
	for i := range out {
		out[i].Denied = (*atomic.Uint64)(unsafe.Pointer(&dmem[out[i].Slot*deniedSize])).Load()
	}
	return out, nil
}

// StatsPin is the counter map `brokkr stats` reads under dir:
// exposure_stats_v2, or the v1 exposure_stats when only it is pinned (an
// older brokkrd's, not yet copied by a newer one).
func StatsPin(dir string) string {
	v2 := filepath.Join(dir, MapName)
	if !exists(v2) {
		if v1 := filepath.Join(dir, V1MapName); exists(v1) {
			return v1
		}
	}
	return v2
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// mmapRead maps n bytes of m's values read-only.
func mmapRead(m *ebpf.Map, n int) ([]byte, error) {
	n = (n + os.Getpagesize() - 1) &^ (os.Getpagesize() - 1)
	return unix.Mmap(m.FD(), 0, n, unix.PROT_READ, unix.MAP_SHARED)
}

// EnsureBPFFS makes dir usable for pins: when dir is under /sys/fs/bpf and no
// bpffs is mounted there, it mounts one; then it creates dir. Anything else
// that is not a bpffs is an error, never silently a tmpfs.
func EnsureBPFFS(dir string) error {
	const root = "/sys/fs/bpf"
	clean := filepath.Clean(dir)
	if clean == root || strings.HasPrefix(clean, root+"/") {
		if !isBPFFS(root) {
			if err := os.MkdirAll(root, 0o755); err != nil {
				return fmt.Errorf("bpfDir %s: %w", dir, err)
			}
			if err := unix.Mount("bpf", root, "bpf", 0, "mode=0700"); err != nil {
				return fmt.Errorf("bpfDir %s: mounting bpffs at %s: %w", dir, root, err)
			}
		}
	}
	if strings.Contains(filepath.Base(clean), ".") {
		return fmt.Errorf("bpfDir %s: bpffs names may not contain '.'", dir)
	}
	if err := os.MkdirAll(clean, 0o700); err != nil {
		return fmt.Errorf("bpfDir %s: %w", dir, err)
	}
	return checkBPFFS(clean)
}

func checkBPFFS(dir string) error {
	if !isBPFFS(dir) {
		return fmt.Errorf("bpfDir %s is not on a bpffs (mount -t bpf bpf %s, or use a path under /sys/fs/bpf)", dir, dir)
	}
	return nil
}

func isBPFFS(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return uint32(st.Type) == bpffsMagic
}
