package bpf

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
)

// Wake is the kernel's side of waking a suspended VM on its first caller
// (wake.h; docs/ARCHITECTURE.md, "Suspend and resume"): exposure_wake_v2, a
// flag per counter slot that the daemon sets while the exposure's VM is
// asleep, and wake_events, the ring buffer where the nat path and the
// socket path put one record per wake. Both are pinned by name under
// bpfDir, like exposure_stats_v2: the programs loaded before or after find
// the same maps.
type Wake struct {
	flags, events *ebpf.Map
	rd            *ringbuf.Reader
	closeOnce     sync.Once
	closeErr      error
}

// Flag values of exposure_wake_v2 (wake.h; 2, a wake asked, is set by the
// programs alone).
const (
	wakeAwake  uint32 = 0
	wakeAsleep uint32 = 1
)

// wakeOnly is the two maps of wake.c, loaded without exposure.h's others.
type wakeOnly struct {
	ExposureWake *ebpf.Map `ebpf:"exposure_wake_v2"`
	WakeEvents   *ebpf.Map `ebpf:"wake_events"`
}

// OpenWake creates or opens the wake maps under dir (a bpffs).
func OpenWake(dir string) (*Wake, error) {
	if err := checkBPFFS(dir); err != nil {
		return nil, err
	}
	spec, err := loadWake()
	if err != nil {
		return nil, fmt.Errorf("wake maps: %w", err)
	}
	var m wakeOnly
	if err := spec.LoadAndAssign(&m, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir}}); err != nil {
		return nil, fmt.Errorf("loading %s: %w", filepath.Join(dir, WakeMapName), err)
	}
	rd, err := ringbuf.NewReader(m.WakeEvents)
	if err != nil {
		m.ExposureWake.Close()
		m.WakeEvents.Close()
		return nil, fmt.Errorf("wake_events: %w", err)
	}
	return &Wake{flags: m.ExposureWake, events: m.WakeEvents, rd: rd}, nil
}

// Sleep marks slot asleep: the next new flow or connect of the exposure
// asks for a wake (again, if one was asked before: a re-arm).
func (w *Wake) Sleep(slot int) error {
	k := uint32(slot)
	if err := w.flags.Update(&k, wakeAsleep, ebpf.UpdateExist); err != nil {
		return fmt.Errorf(WakeMapName+"[%d]: %w", slot, err)
	}
	return nil
}

// Awake clears slot's flag: its VM runs.
func (w *Wake) Awake(slot int) error {
	k := uint32(slot)
	if err := w.flags.Update(&k, wakeAwake, ebpf.UpdateExist); err != nil {
		return fmt.Errorf(WakeMapName+"[%d]: %w", slot, err)
	}
	return nil
}

// Asleep reports slot's flag: asleep (with or without a wake asked).
func (w *Wake) Asleep(slot int) (bool, error) {
	k := uint32(slot)
	var cur uint32
	if err := w.flags.Lookup(&k, &cur); err != nil {
		return false, err
	}
	return cur != wakeAwake, nil
}

// ErrWakeClosed is Next's error once Close was called.
var ErrWakeClosed = errors.New("wake events: closed")

// Next blocks until the kernel asks for a wake and returns its slot, or
// until ctx ends (ctx's error) or Close is called (ErrWakeClosed). One
// Next at a time; after ctx ends the next call waits afresh, so a daemon
// whose Run ends and starts again (a failed hand-over) keeps its events.
// (The reader's deadline cannot end a Read in progress: SetDeadline waits
// for the Read's lock. Flush wakes it.)
func (w *Wake) Next(ctx context.Context) (int, error) {
	stop := context.AfterFunc(ctx, func() { _ = w.rd.Flush() })
	defer stop()
	for {
		rec, err := w.rd.Read()
		switch {
		case errors.Is(err, os.ErrClosed) || errors.Is(err, ringbuf.ErrClosed):
			return 0, ErrWakeClosed
		case errors.Is(err, ringbuf.ErrFlushed):
			if ctx.Err() != nil {
				return 0, ctx.Err()
			}
			continue // a flush for an earlier call's context
		case err != nil:
			return 0, fmt.Errorf("wake events: %w", err)
		}
		if len(rec.RawSample) >= 4 {
			return int(binary.LittleEndian.Uint32(rec.RawSample)), nil
		}
	}
}

// Close ends a Next in progress and closes the maps (their pins stay). It
// may be called more than once.
func (w *Wake) Close() error {
	w.closeOnce.Do(func() {
		w.closeErr = errors.Join(w.rd.Close(), w.flags.Close(), w.events.Close())
	})
	return w.closeErr
}

// SlotOf is the slot index of the named exposure, if it has one.
func (s *Store) SlotOf(name string) (int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.byName[name]
	return i, ok
}

// NameOf is the name of the exposure in slot i ("" for a free slot).
func (s *Store) NameOf(i int) string {
	if i < 0 || i >= Slots {
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.nameAt(i)
}
