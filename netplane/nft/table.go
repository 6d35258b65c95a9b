// Package nft applies brokkr's nftables tables and runs what lives beside
// them: Converge makes the kernel hold what package compile builds from the
// caller's whole desired state (Rules), in one netlink batch, falling back to
// replacing both tables in one batch, and reports the drift it repaired.
// Without the BPF nat path it also runs the set-based cap: the watcher that
// frees the slots of closed connections (caps.go) and the slow path that
// decides for callers who find a cap full (overflow.go). Counters reads the
// per-exposure numbers. Nothing outside brokkr's two tables is touched.
package nft

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/brokkr/brokkr/netplane/nft/compile"

	"github.com/brokkr/brokkr/netplane/conntrack"
	"github.com/google/nftables"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Table manages brokkr's tables in one network namespace: it applies what
// package compile builds (Converge), and runs the fallback cap (the watcher
// and the slow path) and the counters.
//
// Each lock guards one thing. Lock order: applyMu, then capMu, then nlMu;
// idxMu and the counters' locks are taken last (nothing is locked while
// they are held).
type Table struct {
	nsPath string
	nsFile *os.File // keeps the namespace fd for the netlink sockets
	log    *slog.Logger
	nopts  []nftables.ConnOption
	ct     *conntrack.Conn // locks itself
	opts   options         // what the slow path is started with

	// nlMu: the netlink sockets (one request or batch at a time) and the
	// count of cap-set batches committed since Converge read the
	// generation.
	nlMu       sync.Mutex
	conn       *nftables.Conn
	raw        *netlink.Conn
	closed     bool
	ownCommits uint32

	// applyMu: one Converge or Delete at a time, and what the last one
	// applied. The ruleset generation right after it: while it is unchanged
	// (but for ownCommits) nobody else has committed anything, so the kernel
	// still holds exactly prev*.
	applyMu                sync.Mutex
	prevGlobal, prevBridge *compile.TableSpec
	prevGlobalFP           string
	units                  map[string]unitEntry // per exposure, as applied
	gen                    uint32
	genValid               bool
	acctOn                 bool

	// idxMu: the applied exposures, as the watcher, the slow path and
	// Counters look them up. Written by Converge and Delete at their end.
	idxMu   sync.RWMutex
	applied bool
	ids     map[string]uint32 // exposure -> mark id
	byID    map[uint32]Exposure
	byHost  map[hostSide]string // tcp/udp, host address (invalid = any), port -> exposure

	// capMu: the members of the cap sets. A read of a set's members and the
	// deletes or add decided from it happen under it, and dropped with them.
	capMu         sync.Mutex
	droppedPruned time.Time
	dropped       map[string]time.Time // cap members the slow path deleted (exposure NUL key), so the watcher does not delete them again

	// hwMu: the bytes last reported per exposure (reports never go down).
	hwMu    sync.Mutex
	bytesHW map[string][2]uint64

	caps      atomic.Pointer[capWatcher] // nil WithoutCapWatcher
	ov        atomic.Pointer[overflow]   // the cap's slow path (TCP): started by the first Converge that has a capped TCP exposure
	closeOnce sync.Once
}

// Option configures Open.
type Option func(*options)

type options struct {
	log          *slog.Logger
	capWatcher   bool
	carrier      Carrier
	overflowWait time.Duration
}

// WithLogger sets the logger (default: slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// WithoutCapWatcher disables the goroutine that frees cap slots of
// connections that ended without FIN/RST (timeouts, UDP), and with it the
// cap's slow path (the kernel then refuses over the cap by itself). Only for
// benchmarks of the rule path; a cap is not honest without it.
func WithoutCapWatcher() Option { return func(o *options) { o.capWatcher = false } }

// sockBuf is the send and receive buffer of the nftables socket: a batch of
// 10,000 exposures is several MiB, and its 40,000 ACKs overflow the default
// receive buffer (ENOBUFS after a commit that succeeded).
const sockBuf = 64 << 20

// Open binds to the namespace at netnsPath ("" = the caller's namespace).
func Open(netnsPath string, opts ...Option) (*Table, error) {
	o := options{log: slog.Default(), capWatcher: true, overflowWait: DefaultOverflowWait}
	for _, f := range opts {
		f(&o)
	}
	t := &Table{nsPath: netnsPath, log: o.log, opts: o, ids: map[string]uint32{}, byID: map[uint32]Exposure{},
		byHost: map[hostSide]string{}, dropped: map[string]time.Time{}, units: map[string]unitEntry{}}
	ncfg := &netlink.Config{}
	nopts := []nftables.ConnOption{nftables.AsLasting(), nftables.WithSockOptions(forceBuffers)}
	if netnsPath != "" {
		f, err := os.Open(netnsPath)
		if err != nil {
			return nil, fmt.Errorf("nft: open netns: %w", err)
		}
		t.nsFile = f
		ncfg.NetNS = int(f.Fd())
		nopts = append(nopts, nftables.WithNetNSFd(int(f.Fd())))
	}
	t.nopts = nopts[1:] // batches use a fresh, non-lasting Conn
	var err error
	if t.conn, err = nftables.New(nopts...); err != nil {
		t.closeFiles()
		return nil, fmt.Errorf("nft: %w", err)
	}
	if t.raw, err = netlink.Dial(unix.NETLINK_NETFILTER, ncfg); err != nil {
		t.closeFiles()
		return nil, fmt.Errorf("nft: netfilter socket: %w", err)
	}
	if err := forceBuffers(t.raw); err != nil {
		t.closeFiles()
		return nil, err
	}
	if t.ct, err = conntrack.Dial(netnsPath); err != nil {
		t.closeFiles()
		return nil, err
	}
	if o.capWatcher {
		w, err := startCapWatcher(t)
		if err != nil {
			t.closeFiles()
			return nil, err
		}
		t.caps.Store(w)
	}
	return t, nil
}

func (t *Table) newConn() (*nftables.Conn, error) {
	c, err := nftables.New(t.nopts...)
	if err != nil {
		return nil, fmt.Errorf("nft: %w", err)
	}
	return c, nil
}

func forceBuffers(c *netlink.Conn) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		// The *FORCE variants pass net.core.[rw]mem_max (we are root).
		if serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, sockBuf); serr != nil {
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, sockBuf)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("nft: socket buffers: %w", serr)
	}
	return nil
}

func (t *Table) closeFiles() {
	if t.conn != nil {
		_ = t.conn.CloseLasting()
	}
	if t.raw != nil {
		_ = t.raw.Close()
	}
	if t.ct != nil {
		_ = t.ct.Close()
	}
	if t.nsFile != nil {
		_ = t.nsFile.Close()
	}
}

// Close stops the cap watcher and the slow path and closes the sockets; the
// tables stay.
func (t *Table) Close() error {
	t.closeOnce.Do(func() {
		t.applyMu.Lock() // no Converge starts the slow path meanwhile
		defer t.applyMu.Unlock()
		if o := t.ov.Swap(nil); o != nil {
			o.stop()
		}
		if w := t.caps.Swap(nil); w != nil {
			w.stop()
		}
		t.nlMu.Lock()
		defer t.nlMu.Unlock()
		t.closed = true
		t.closeFiles()
	})
	return nil
}

// errClosed: the Table was closed.
var errClosed = errors.New("nft: table closed")

// nl runs fn with the netlink sockets to itself.
func (t *Table) nl(fn func() error) error {
	t.nlMu.Lock()
	defer t.nlMu.Unlock()
	if t.closed {
		return errClosed
	}
	return fn()
}
