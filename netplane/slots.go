package netplane

import (
	"log/slog"

	"github.com/brokkr/brokkr/bpf"
)

// slotFeeds are the counter slots of the published exposures: attached by
// name (again when the protocol or host port changed, so bpftool shows the
// current shape), their cap set for every path, released as deleted when
// the exposure goes. (The daemon is to become the one owner of this for
// every path; netplane keeps what it had until then.)
type slotFeeds struct {
	store *bpf.Store
	log   *slog.Logger
	feeds map[string]*slotFeed
}

// attachAll attaches a slot per desired exposure and releases the slots
// of exposures that left the desired state as deleted (zeroed once the
// proxy lets go too).
func (s *slotFeeds) attachAll(exps []Exposure) {
	want := make(map[string]bool, len(exps))
	for _, e := range exps {
		want[e.Name] = true
		s.attach(e)
	}
	for name := range s.feeds {
		if !want[name] {
			s.release(name)
		}
	}
}

// attach attaches e's slot and sets its cap for every path.
func (s *slotFeeds) attach(e Exposure) {
	proto := bpf.ProtoNumber(string(e.Proto))
	f := s.feeds[e.Name]
	if f == nil || f.proto != proto || f.hostPort != e.HostPort {
		slot, err := s.store.Attach(e.Name, proto, e.HostPort)
		if err != nil {
			s.log.Warn("netplane: counter slot", "exposure", e.Name, "err", err)
			return
		}
		if f != nil {
			f.slot.Release(false)
			f.slot, f.proto, f.hostPort = slot, proto, e.HostPort
		} else {
			f = &slotFeed{slot: slot, proto: proto, hostPort: e.HostPort}
			s.feeds[e.Name] = f
		}
	}
	f.slot.SetCap(uint32(e.MaxConns))
}

// release releases a deleted exposure's slot.
func (s *slotFeeds) release(name string) {
	if f := s.feeds[name]; f != nil {
		f.slot.Release(true)
		delete(s.feeds, name)
	}
}

// close lets go of every slot (their values stay).
func (s *slotFeeds) close() {
	for name, f := range s.feeds {
		f.slot.Release(false)
		delete(s.feeds, name)
	}
}
