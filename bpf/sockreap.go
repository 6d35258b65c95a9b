package bpf

import (
	"errors"
	"fmt"
	"io"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// sockReaper runs the socket iterators of sockreap.c: they close the
// host-local callers' sockets whose translation no longer holds (the
// exposure moved to another guest or went), as the nat path's conntrack
// flush ends its flows. Its links are the process's own (an iterator runs
// only when read), on the maps the socket path pinned.
type sockReaper struct {
	objs     sockreapObjects
	tcp, udp *link.Iter
}

func loadSockReaper(pinDir string) (*sockReaper, error) {
	r := &sockReaper{}
	if err := loadSockreapObjects(&r.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: pinDir}}); err != nil {
		return nil, fmt.Errorf("loading the socket iterators: %w", err)
	}
	var err error
	if r.tcp, err = link.AttachIter(link.IterOptions{Program: r.objs.BrkSockReapTcp}); err != nil {
		r.close()
		return nil, fmt.Errorf("the TCP socket iterator: %w", err)
	}
	if r.udp, err = link.AttachIter(link.IterOptions{Program: r.objs.BrkSockReapUdp}); err != nil {
		r.close()
		return nil, fmt.Errorf("the UDP socket iterator: %w", err)
	}
	return r, nil
}

// reap walks the TCP and UDP sockets of the namespace it runs in (an
// iterator sees the namespace of the thread that opens it) and returns how
// many it closed.
func (r *sockReaper) reap() (int, error) {
	n := 0
	for _, it := range []*link.Iter{r.tcp, r.udp} {
		rc, err := it.Open()
		if err != nil {
			return n, err
		}
		k, err := io.Copy(io.Discard, rc)
		rc.Close()
		n += int(k)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func (r *sockReaper) close() error {
	var errs []error
	for _, l := range []*link.Iter{r.tcp, r.udp} {
		if l != nil {
			errs = append(errs, l.Close())
		}
	}
	return errors.Join(append(errs, r.objs.Close())...)
}
