package main

import (
	"errors"
	"log/slog"
	"os"
	"strings"

	"github.com/brokkr/brokkr/proxy"
	"github.com/coreos/go-systemd/v22/activation"
	"golang.org/x/sys/unix"
)

// Crash safety for the proxy's listeners: under systemd each one is kept in
// the unit's file-descriptor store (FDSTORE=1, FileDescriptorStoreMax= in
// dist/brokkrd.service), so when brokkrd dies, even by SIGKILL, the
// listening socket stays open in systemd and callers queue in its backlog;
// the next brokkrd gets it back as LISTEN_FDS and accepts them. go-systemd's
// SdNotify cannot pass descriptors, hence the sendmsg here.

const pxNamePrefix = "brokkr-px-"

// sdNotifyFds sends state with files attached to $NOTIFY_SOCKET. Without
// NOTIFY_SOCKET it does nothing and reports false.
func sdNotifyFds(state string, files []*os.File) (bool, error) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return false, nil
	}
	if path[0] == '@' {
		path = "\x00" + path[1:]
	}
	s, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer unix.Close(s)
	var oob []byte
	if len(files) > 0 {
		fds, err := rawFds(files) // not Fd(): see rawFds
		if err != nil {
			return false, err
		}
		oob = unix.UnixRights(fds...)
	}
	return true, unix.Sendmsg(s, []byte(state), oob, &unix.SockaddrUnix{Name: path}, 0)
}

// fromSystemd takes the proxy listeners systemd passed back (LISTEN_FDS,
// named by LISTEN_FDNAMES).
func fromSystemd() map[string]*os.File {
	out := map[string]*os.File{}
	for _, f := range activation.Files(true) {
		if !strings.HasPrefix(f.Name(), pxNamePrefix) {
			f.Close()
			continue
		}
		out[f.Name()] = f
	}
	return out
}

// fdStore keeps systemd's store in step with the bound listeners.
type fdStore struct {
	have map[string]bool
	log  *slog.Logger
	off  bool
}

func newFDStore(log *slog.Logger, have ...map[string]*os.File) *fdStore {
	s := &fdStore{have: map[string]bool{}, log: log, off: os.Getenv("NOTIFY_SOCKET") == ""}
	for _, m := range have {
		for name := range m {
			s.have[name] = true
		}
	}
	return s
}

// sync stores each newly bound listener and removes the ones gone.
func (s *fdStore) sync(ms ...*proxy.Manager) {
	if s.off {
		return
	}
	current := map[string]bool{}
	for _, m := range ms {
		if m == nil {
			continue
		}
		added, names := m.ListenerFiles(s.have)
		for _, n := range names {
			current[n] = true
		}
		for name, f := range added {
			_, err := sdNotifyFds("FDSTORE=1\nFDNAME="+name, []*os.File{f})
			f.Close()
			if err != nil {
				s.log.Warn("fd store: keeping a proxy listener in systemd", "name", name, "err", err)
				continue
			}
			s.have[name] = true
		}
	}
	for name := range s.have {
		if !current[name] {
			s.remove(name)
		}
	}
}

func (s *fdStore) remove(name string) {
	if s.off {
		return
	}
	if _, err := sdNotifyFds("FDSTOREREMOVE=1\nFDNAME="+name, nil); err != nil && !errors.Is(err, unix.ENOENT) {
		s.log.Warn("fd store: removing a proxy listener", "name", name, "err", err)
	}
	delete(s.have, name)
}
