// Package nlsafe is the one way netplane talks to vishvananda/netlink for
// dumps: a dump that races a concurrent change comes back flagged
// NLM_F_DUMP_INTR (netlink.ErrDumpInterrupted) with a possibly inconsistent
// result, so every dump is retried until it is clean, at most MaxAttempts
// times. It also opens handles and runs code inside a managed namespace.
package nlsafe

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// MaxAttempts bounds the retries of an interrupted dump.
const MaxAttempts = 5

// Retry runs dump until it returns something other than
// netlink.ErrDumpInterrupted, at most MaxAttempts times. After the last
// attempt the (possibly partial) result is returned with the error so the
// caller can decide; callers in netplane treat it as a failed pass.
func Retry[T any](dump func() (T, error)) (T, error) {
	var (
		v   T
		err error
	)
	for i := 0; i < MaxAttempts; i++ {
		v, err = dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return v, err
		}
	}
	return v, fmt.Errorf("netlink dump interrupted %d times: %w", MaxAttempts, err)
}

// LinkList dumps every link of the handle's namespace.
func LinkList(h *netlink.Handle) ([]netlink.Link, error) {
	return Retry(h.LinkList)
}

// LinkByName looks a link up by name. The kernel may answer by a dump when
// the name lookup is not supported, hence the retry.
func LinkByName(h *netlink.Handle, name string) (netlink.Link, error) {
	return Retry(func() (netlink.Link, error) { return h.LinkByName(name) })
}

// AddrList dumps the addresses of one link (nil = every link).
func AddrList(h *netlink.Handle, link netlink.Link, family int) ([]netlink.Addr, error) {
	return Retry(func() ([]netlink.Addr, error) { return h.AddrList(link, family) })
}

// NeighList dumps the neighbour table of one link (0 = every link).
func NeighList(h *netlink.Handle, linkIndex, family int) ([]netlink.Neigh, error) {
	return Retry(func() ([]netlink.Neigh, error) { return h.NeighList(linkIndex, family) })
}

// IsNotFound reports whether err says a link does not exist.
func IsNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf)
}

// Handle opens a netlink handle in the namespace at nsPath ("" = the
// caller's current namespace).
func Handle(nsPath string) (*netlink.Handle, error) {
	if nsPath == "" {
		return netlink.NewHandle()
	}
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("opening netns %s: %w", nsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("netlink handle in %s: %w", nsPath, err)
	}
	return h, nil
}

// Do runs fn on a locked OS thread inside the namespace at nsPath ("" = run
// it on the caller's namespace). Things that act on "the current namespace"
// rather than on a netlink socket need this: TUNSETIFF creates the tap where
// the calling thread lives, /proc/sys/net is per namespace, and sockets are
// born in their creator's namespace (and stay there after Do returns). A
// thread that cannot be switched back stays locked so the runtime drops it.
func Do(nsPath string, fn func() error) error {
	if nsPath == "" {
		return fn()
	}
	target, err := netns.GetFromPath(nsPath)
	if err != nil {
		return fmt.Errorf("opening netns %s: %w", nsPath, err)
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering netns %s: %w", nsPath, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			// fn's own error is kept: fn may have done its work (started a
			// process, made a socket) and the caller must hear of both.
			errc <- errors.Join(ferr, fmt.Errorf("leaving netns %s: %w (thread discarded)", nsPath, err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}
