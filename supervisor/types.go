// Package supervisor runs the hypervisor processes from desired state: one
// worker goroutine per VM, images and disks, records, restart policy, and
// adoption of VMs that outlived a daemon restart.
package supervisor

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/brokkr/brokkr/internal/spec"
)

// Power and Restart are the model's types (docs/ARCHITECTURE.md, "Data flow").
type (
	Power   = spec.Power
	Restart = spec.Restart
)

// Power and restart values of the model.
const (
	PowerRunning   = spec.PowerRunning
	PowerStopped   = spec.PowerStopped
	PowerSuspended = spec.PowerSuspended

	RestartAlways    = spec.RestartAlways
	RestartOnFailure = spec.RestartOnFailure
	RestartNever     = spec.RestartNever
)

// Phases of VMStatus.Phase: the model's set (docs/ARCHITECTURE.md,
// "External contract").
const (
	PhasePending  = string(spec.PhasePending)
	PhaseCreating = string(spec.PhaseCreating)
	PhaseStarting = string(spec.PhaseStarting)
	PhaseRunning  = string(spec.PhaseRunning)
	PhaseStopping = string(spec.PhaseStopping)
	PhaseStopped  = string(spec.PhaseStopped)
	PhaseFailed   = string(spec.PhaseFailed)

	PhaseSuspending = string(spec.PhaseSuspending)
	PhaseSuspended  = string(spec.PhaseSuspended)
	PhaseResuming   = string(spec.PhaseResuming)
)

// Source is a local path or an http(s) URL, with the sha256 it must have
// (required for URLs, optional for paths).
type Source = spec.Source

// Disk is the VM's root disk: a per-VM sparse copy of Source grown to Size
// (0 = the image's own size).
type Disk = spec.Disk

// VMSpec is one VM's desired state, with the network facts netplane supplied.
type VMSpec struct {
	Name      string
	CPUs      int
	MemoryMiB int
	Kernel    Source
	Initramfs *Source
	Cmdline   string
	Disk      *Disk
	Power     spec.Power
	Restart   spec.Restart
	// IdleSuspend: suspend the VM after this long without traffic through
	// its exposures (Config.Traffic), resume it on Engine.Wake; 0 = never.
	IdleSuspend time.Duration

	Tap string           // tap device to attach (made by netplane)
	MAC net.HardwareAddr // the guest's MAC (stable per VM)
	// IP is the address of a guest on a network without DHCP (nil with
	// DHCP): it takes it from the kernel's ip= parameter (KernelIPParam).
	IP *spec.StaticIP
}

// KernelIPParam is the kernel parameter that gives a guest booted without
// DHCP its address (Documentation/admin-guide/nfs/nfsroot.rst, "ip="):
// client, no server, the gateway, the subnet mask, the VM name as hostname,
// eth0, no autoconfiguration. Kernels without IP autoconfiguration leave it
// to the guest's init (the test guest reads it). With an IPv6 address,
// brokkr.ip6=ADDRESS/64 follows: Linux has no kernel parameter for IPv6,
// so this one is brokkr's (the test guest's init reads it); it is the
// address the guest's SLAAC forms anyway. "" for nil.
func KernelIPParam(ip *spec.StaticIP, vm string) string {
	if ip == nil {
		return ""
	}
	mask := net.IP(net.CIDRMask(ip.Addr.Bits(), 32)).String()
	p := fmt.Sprintf("ip=%s::%s:%s:%s:eth0:off", ip.Addr.Addr(), ip.Gateway, mask, vm)
	if ip.Addr6.IsValid() {
		p += " brokkr.ip6=" + ip.Addr6.String()
	}
	return p
}

// VMStatus is one VM's row in a Report.
type VMStatus struct {
	Name     string
	Phase    string
	Detail   string // the step in progress or what failed ("downloading image 40%")
	PID      int
	Restarts int
	// StateBytes is the size on disk of the saved state of a suspended VM
	// (0 otherwise).
	StateBytes int64
	// Wakes counts the resumes that Engine.Wake asked for (callers of a
	// suspended VM), over the VM's life.
	Wakes int
	// Progress of the step in progress, when it is measurable (an image
	// download): nil otherwise.
	Progress *Progress
}

// Progress is done out of total units (bytes) of the step in progress.
type Progress struct {
	Done, Total int64
}

// Report is what Step returns: one row per VM the engine knows (desired or recorded).
type Report struct {
	VMs []VMStatus
}

// LaunchConfig is what a backend needs to start one VM, with images resolved
// to local files.
type LaunchConfig struct {
	Name        string
	Dir         string // stateDir/vms/<name>: logs, console.log, disk
	RunDir      string // runDir/vms/<name>: API/QMP sockets, pidfile (short paths: sun_path is 108 bytes)
	CPUs        int
	MemoryMiB   int
	Kernel      string
	Initramfs   string
	Cmdline     string
	DiskPath    string
	Tap         string
	MAC         net.HardwareAddr
	ConsoleLog  string
	ConsoleSize int64 // cap on console.log in bytes
	// Place, when set, moves the VMM's process into the VM's own cgroup (a
	// systemd scope, see Placer). The backend calls it right after the
	// process starts, before the guest boots: memory a process touched
	// before a move stays charged to the cgroup it left. An error fails
	// the start (the backend kills what it started).
	Place func(pid int) error
}

// Instance is a running (or adopted) hypervisor process.
type Instance struct {
	PID       int
	StartTime uint64 // /proc/<pid>/stat field 22, to tell a reused pid apart
	Exe       string // /proc/<pid>/exe at start
	APISocket string
	// ConsoleSocket, when set, is a unix socket on which the VMM serves the
	// guest's serial port (CH: serial mode Socket). The engine's worker
	// connects to it and copies the output into LaunchConfig.ConsoleLog,
	// capped at LaunchConfig.ConsoleSize (rotating once to console.log.1).
	// Leave it empty when the backend writes ConsoleLog itself.
	ConsoleSocket string
	// Console, when set, is a connection to ConsoleSocket the backend made
	// as the VMM started and hands over as it is: the engine copies from
	// it rather than connecting, so nothing the guest printed in between
	// is lost (a VMM serves one reader at a time and drops what the guest
	// prints while none is connected). The engine closes it. Not recorded:
	// an adopted VMM's console is connected anew.
	Console net.Conn `json:"-"`
}

// VMState is what a backend's Info says about the guest.
type VMState string

const (
	VMCreated  VMState = "created"
	VMRunning  VMState = "running"
	VMShutdown VMState = "shutdown"
	VMPaused   VMState = "paused"
)

// Placer gives each VMM process a cgroup of its own (supervisor/scope: a
// transient systemd scope), so it is accounted apart from the daemon and a
// stop of the daemon's unit does not reach it.
type Placer interface {
	// Place moves pid into the VM's own unit; a pid already there stays.
	Place(ctx context.Context, vm string, pid int) error
	// Release stops the VM's unit and anything still in it (a VM destroyed).
	Release(ctx context.Context, vm string) error
}

// Hypervisor is the seam to a VMM (cloud-hypervisor, qemu, or a test fake).
// Processes it starts must outlive the daemon (Setsid, no Pdeathsig) and
// call LaunchConfig.Place, when set, as soon as they exist.
//
// Exit watching is the engine's job, not the backend's: after Start or Adopt
// the worker opens a pidfd on Instance.PID and is woken the moment the
// process exits; it also reaps it (waitid on the pidfd) when it is the
// daemon's child. So Start must NOT Wait for (reap) the process it started:
// release it (cmd.Process.Release()) and leave the zombie to the engine.
// On a Start error the backend kills and reaps whatever it started.
type Hypervisor interface {
	// Kind names the backend ("cloud-hypervisor", "qemu").
	Kind() string
	// Start launches the VMM and boots the guest; it returns once the guest
	// is booting (for CH: vm.info says Running) or ctx ends.
	Start(ctx context.Context, cfg LaunchConfig) (Instance, error)
	// Adopt checks that a recorded instance is still that VMM (same pid, start
	// time and executable, API answering with that pid).
	Adopt(ctx context.Context, inst Instance) error
	// Info asks the VMM for the guest's state.
	Info(ctx context.Context, inst Instance) (VMState, error)
	// Stop: power button (pressed again every PowerButtonEvery while the guest
	// runs), wait up to grace, then API shutdown or SIGTERM, then SIGKILL.
	Stop(ctx context.Context, inst Instance, grace time.Duration) error

	// Suspend pauses the guest, writes its whole state (memory and devices)
	// into dir (an empty directory the engine made), calls saved once the
	// state is complete on disk, and then ends the VMM without touching the
	// guest. On an error before saved returned nil (the disk is full, the
	// VMM refuses, saved fails) the guest runs again in the same process
	// and the error says why; dir may then hold a partial state.
	Suspend(ctx context.Context, inst Instance, dir string, saved func() error) error
	// Restore starts a new VMM from the state Suspend wrote into dir for a
	// VM launched with cfg (the same tap, MAC and disk) and returns once the
	// guest is loaded and paused. Like Start it does not reap the process,
	// calls cfg.Place, and on an error kills what it started.
	Restore(ctx context.Context, cfg LaunchConfig, dir string) (Instance, error)
	// Continue runs a guest that is paused in a live VMM: one Restore
	// loaded, or one a daemon left paused when it died inside Suspend. A
	// guest already running is left alone.
	Continue(ctx context.Context, inst Instance) error
}

// Traffic is what a VM's exposures carried, summed over all of them: the
// counters of the pinned slot map.
type Traffic struct {
	Active   uint64 // connections open now
	Accepted uint64 // connections admitted since the exposures exist
}
