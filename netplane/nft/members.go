package nft

import (
	"errors"
	"time"

	"github.com/brokkr/brokkr/bpf/ctmark"
	"github.com/brokkr/brokkr/netplane/nft/compile"
	"github.com/google/nftables"
)

// capSets are the members of the set-based cap's sets: reading them,
// deleting those whose connection is gone, and remembering what the slow
// path deleted so the watcher does not delete it again. Every method but
// members runs under the kernel's membersMu.
type capSets struct {
	k      *nlKernel
	capped func(name string) bool // an applied exposure with a cap (the SetCap's index)

	dropped       map[string]time.Time // members the slow path deleted (exposure NUL key)
	droppedPruned time.Time
}

// releaseLocked deletes connections from cap sets (membersMu held).
func (m *capSets) releaseLocked(pending map[string][][]byte) {
	if len(pending) == 0 {
		return
	}
	inet := table(famInet)
	send := func(set string, keys [][]byte) error {
		els := make([]nftables.SetElement, len(keys))
		for i, k := range keys {
			els[i] = nftables.SetElement{Key: k}
		}
		return m.k.sideCommit(func() error {
			// The lasting socket: SetDeleteElements only fails before
			// queuing.
			if err := m.k.conn.SetDeleteElements(&nftables.Set{Table: inet, Name: set}, els); err != nil {
				return err
			}
			return m.k.conn.Flush()
		})
	}
	for name, keys := range pending {
		if !m.capped(name) {
			continue
		}
		// A key the slow path deleted already would fail the batch, and a
		// failed batch costs the kernel's abort (~10 ms measured).
		keep := keys[:0:0]
		for _, k := range keys {
			if _, ok := m.dropped[name+"\x00"+string(k)]; ok {
				delete(m.dropped, name+"\x00"+string(k))
				continue
			}
			keep = append(keep, k)
		}
		if keys = keep; len(keys) == 0 {
			continue
		}
		if err := send(compile.ConnsSet(name), keys); err != nil && !errors.Is(err, errClosed) && len(keys) > 1 {
			for _, k := range keys {
				_ = send(compile.ConnsSet(name), [][]byte{k})
			}
		}
	}
}

// members reads the members of e's cap set.
func (m *capSets) members(e Exposure) ([]nftables.SetElement, error) {
	var els []nftables.SetElement
	err := m.k.nl(func() (err error) {
		els, err = m.k.conn.GetSetElements(&nftables.Set{Table: table(famInet), Name: compile.ConnsSet(e.Name), KeyType: compile.ConnKeyType})
		return err
	})
	return els, err
}

// staleLocked lists the members of e's cap set whose connection has no
// conntrack entry or has closed: one GET per member, no dump (membersMu
// held). members is how many the set holds.
func (m *capSets) staleLocked(e Exposure) (stale [][]byte, members int, err error) {
	els, err := m.members(e)
	if err != nil {
		return nil, 0, err
	}
	var missing [][]byte
	check := func(k []byte) (gone, closed bool, err error) {
		src, dst, _ := compile.ConnOfKey(k)
		en, ok, err := m.k.ct.Get(compile.ProtoNum(e.Protocol), src, dst)
		if err != nil {
			return false, false, err
		}
		return !ok, ok && (!en.Open() || en.Mark&ctmark.Closed == ctmark.Closed), nil
	}
	for _, el := range els {
		if _, _, ok := compile.ConnOfKey(el.Key); !ok {
			continue
		}
		members++
		gone, closed, err := check(el.Key)
		if err != nil {
			return nil, 0, err
		}
		switch {
		case closed:
			stale = append(stale, el.Key)
		case gone:
			missing = append(missing, el.Key)
		}
	}
	if len(missing) > 0 {
		// A connection admitted a moment ago is in the set before its
		// conntrack entry is confirmed (end of the same packet's path):
		// look again after a short pause before calling it gone.
		time.Sleep(2 * time.Millisecond)
		for _, k := range missing {
			if gone, closed, err := check(k); err == nil && (gone || closed) {
				stale = append(stale, k)
			}
		}
	}
	return stale, members, nil
}

// noteDroppedLocked remembers keys the watcher must not delete. Their close
// (or destroy) event removes them; those whose event never comes (no entry
// left, a connection older than the watcher) are forgotten after a minute
// (membersMu held).
func (m *capSets) noteDroppedLocked(name string, keys [][]byte) {
	now := time.Now()
	if now.Sub(m.droppedPruned) > 10*time.Second {
		m.droppedPruned = now
		for k, at := range m.dropped {
			if now.Sub(at) > time.Minute {
				delete(m.dropped, k)
			}
		}
	}
	for _, k := range keys {
		m.dropped[name+"\x00"+string(k)] = now
	}
}

// dropLocked deletes members the slow path found closed (they are in the
// set: membersMu is held since they were read) and remembers them, so the
// watcher does not delete them again when their close event arrives.
func (m *capSets) dropLocked(name string, keys [][]byte) {
	for _, k := range keys {
		delete(m.dropped, name+"\x00"+string(k)) // deleted before and back since: delete it now
	}
	m.releaseLocked(map[string][][]byte{name: keys})
	m.noteDroppedLocked(name, keys)
}
