// Package scope puts each VMM process into a transient systemd scope of its
// own, brokkr-vm-<name>.scope under brokkr.slice, through systemd's D-Bus
// API, the way libvirt and runc's systemd driver do: the daemon starts the
// process, then asks systemd to move it (StartTransientUnit with PIDs=). The
// VMM is then accounted apart from brokkrd (tasks, memory), and a stop of
// brokkrd.service, whose cgroup the VMM has left, does not reach it.
package scope

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
)

// Slice holds every VM's scope. systemd makes it on first use; an installed
// dist/brokkr.slice only adds limits for all VMs together.
const Slice = "brokkr.slice"

// Unit is the name of the VM's scope.
func Unit(vm string) string { return "brokkr-vm-" + vm + ".scope" }

// The devices a VMM may open: the same as brokkrd.service's DeviceAllow
// (dist/brokkrd.service), which no longer applies once the VMM has left
// the service's cgroup. DevicePolicy=closed adds /dev/null, /dev/zero,
// /dev/urandom, /dev/ptmx and the other pseudo devices.
var deviceAllow = []struct{ Path, Access string }{
	{"/dev/kvm", "rw"},
	{"/dev/net/tun", "rw"},
	{"/dev/vhost-net", "rw"},
	{"/dev/vhost-vsock", "rw"},
}

// stopTimeout bounds a Release: the VMM itself has gone by then (the
// engine's stop sequence ran), so only leftovers that ignore SIGTERM wait.
const stopTimeout = 10 * time.Second

// ErrNoSystemd says systemd does not run this host.
var ErrNoSystemd = errors.New("systemd does not run this host (no /run/systemd/system)")

// Dialer opens a connection to a systemd manager.
type Dialer func(ctx context.Context) (*sddbus.Conn, error)

// SystemBus connects to the system manager through the system bus
// ($DBUS_SYSTEM_BUS_ADDRESS or its default socket), or through systemd's own
// socket, /run/systemd/private, where no bus daemon runs.
func SystemBus(ctx context.Context) (*sddbus.Conn, error) {
	c, err := sddbus.NewSystemConnectionContext(ctx)
	if err == nil {
		return c, nil
	}
	c, perr := sddbus.NewSystemdConnectionContext(ctx)
	if perr == nil {
		return c, nil
	}
	return nil, fmt.Errorf("system bus: %v; /run/systemd/private: %v", err, perr)
}

// Systemd is a supervisor.Placer backed by a systemd manager. It dials on
// first use and again after the bus went away (a bus daemon restarted).
type Systemd struct {
	dial Dialer

	mu   sync.Mutex
	conn *sddbus.Conn
}

// New returns a Placer that reaches systemd through dial.
func New(dial Dialer) *Systemd { return &Systemd{dial: dial} }

// Detect returns a Placer when systemd runs the host (sd_booted(3): the
// directory /run/systemd/system exists) and answers on its bus. Otherwise
// the error says why: ErrNoSystemd, or what the bus answered.
func Detect(ctx context.Context) (*Systemd, error) {
	if fi, err := os.Stat("/run/systemd/system"); err != nil || !fi.IsDir() {
		return nil, ErrNoSystemd
	}
	s := New(SystemBus)
	err := s.with(ctx, func(c *sddbus.Conn) error {
		_, err := c.SystemStateContext(ctx) // any call that ctx bounds
		return err
	})
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("systemd runs this host but does not answer: %w", err)
	}
	return s, nil
}

// Close drops the connection.
func (s *Systemd) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil {
		s.conn.Close()
		s.conn = nil
	}
}

// Place moves pid into the VM's scope, making the scope. A pid already in it
// is left alone (an adopted VMM). A scope of that name that outlived its
// process (systemd had not collected it yet, or an earlier VMM left a child
// behind) is stopped first: the pid is not in it, so nothing of ours dies.
func (s *Systemd) Place(ctx context.Context, vm string, pid int) error {
	unit := Unit(vm)
	if pid <= 0 {
		return fmt.Errorf("scope %s: pid %d", unit, pid)
	}
	err := s.with(ctx, func(c *sddbus.Conn) error {
		if cur, err := c.GetUnitNameByPID(ctx, uint32(pid)); err == nil && cur == unit {
			return nil
		}
		err := start(ctx, c, vm, pid)
		if isDBusError(err, "org.freedesktop.systemd1.UnitExists") {
			if err := stop(ctx, c, unit); err != nil && !isDBusError(err, "org.freedesktop.systemd1.NoSuchUnit") {
				return fmt.Errorf("stop the stale scope: %w", err)
			}
			err = start(ctx, c, vm, pid)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("scope %s for pid %d: %w", unit, pid, err)
	}
	return nil
}

// Release stops the VM's scope with whatever is still in it. A scope that
// is gone already (it goes by itself when its last process exits) is fine.
func (s *Systemd) Release(ctx context.Context, vm string) error {
	unit := Unit(vm)
	err := s.with(ctx, func(c *sddbus.Conn) error { return stop(ctx, c, unit) })
	if err == nil || isDBusError(err, "org.freedesktop.systemd1.NoSuchUnit") {
		return nil
	}
	return fmt.Errorf("scope %s: stop: %w", unit, err)
}

// with runs f on the connection, dialling when there is none, and once more
// on a fresh one when the old one turns out closed.
func (s *Systemd) with(ctx context.Context, f func(*sddbus.Conn) error) error {
	for attempt := 0; ; attempt++ {
		c, err := s.connect(ctx)
		if err != nil {
			return err
		}
		err = f(c)
		if err == nil || c.Connected() || attempt > 0 {
			return err
		}
		s.mu.Lock()
		if s.conn == c {
			s.conn.Close()
			s.conn = nil
		}
		s.mu.Unlock()
	}
}

func (s *Systemd) connect(ctx context.Context) (*sddbus.Conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil {
		c, err := s.dial(ctx)
		if err != nil {
			return nil, err
		}
		s.conn = c
	}
	return s.conn, nil
}

// start makes the scope around pid and waits for systemd's job to finish:
// only then is the process in the scope's cgroup.
func start(ctx context.Context, c *sddbus.Conn, vm string, pid int) error {
	props := []sddbus.Property{
		sddbus.PropDescription("brokkr VM " + vm),
		sddbus.PropSlice(Slice),
		sddbus.PropPids(uint32(pid)),
		// Gone once empty, also when its process failed: a VM's next start
		// makes a new scope of the same name.
		{Name: "CollectMode", Value: dbus.MakeVariant("inactive-or-failed")},
		{Name: "DevicePolicy", Value: dbus.MakeVariant("closed")},
		{Name: "DeviceAllow", Value: dbus.MakeVariant(deviceAllow)},
		{Name: "TimeoutStopUSec", Value: dbus.MakeVariant(uint64(stopTimeout / time.Microsecond))},
	}
	done := make(chan string, 1)
	if _, err := c.StartTransientUnitContext(ctx, Unit(vm), "fail", props, done); err != nil {
		return err
	}
	return waitJob(ctx, "start", done)
}

func stop(ctx context.Context, c *sddbus.Conn, unit string) error {
	done := make(chan string, 1)
	if _, err := c.StopUnitContext(ctx, unit, "replace", done); err != nil {
		return err
	}
	return waitJob(ctx, "stop", done)
}

func waitJob(ctx context.Context, what string, done <-chan string) error {
	select {
	case r := <-done:
		if r != "done" {
			return fmt.Errorf("%s job: %s", what, r)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%s job: %w", what, ctx.Err())
	}
}

func isDBusError(err error, name string) bool {
	var de dbus.Error
	return errors.As(err, &de) && de.Name == name
}
