// Package api is the wire format of brokkrd's HTTP+JSON API on its unix
// socket (docs/ARCHITECTURE.md, "External contract") and a small client for it, shared by the CLI, the
// daemon and the end-to-end tests so the three cannot disagree.
package api

import "strconv"

// DefaultSocket is where the CLI looks for the daemon unless told otherwise.
const DefaultSocket = "/run/brokkr/brokkr.sock"

// Status is GET /v1/status and `brokkr status -o json`.
type Status struct {
	VMs       []VM       `json:"vms"`
	Exposures []Exposure `json:"exposures"`
	// Warnings are conditions an operator should know about that belong to
	// no single row: counters kept in memory only, an engine that stalled.
	Warnings []string `json:"warnings,omitempty"`
	// Daemon is the answering daemon's build (absent from daemons older
	// than the field; clients must not require it).
	Daemon *Build `json:"daemon,omitempty"`
	// Source is set when the desired state comes from outside this host
	// (fleet mode); single hosts never show it.
	Source *Source `json:"source,omitempty"`
}

// Source is the state of a remote desired-state source (fleet mode: etcd).
type Source struct {
	Kind  string `json:"kind"` // "etcd"
	Node  string `json:"node"`
	State string `json:"state"` // connected | disconnected
	// Revision is the etcd revision of the desired document this node runs
	// (0: none applied yet; the node runs its local state).
	Revision int64 `json:"revision"`
	// Rejected is the revision of the newest document that was not applied,
	// and Errors say why, naming fields as `brokkr validate` does.
	Rejected int64    `json:"rejectedRevision,omitempty"`
	Errors   []string `json:"errors,omitempty"`
	Detail   string   `json:"detail,omitempty"` // e.g. the connection error, or "no desired document"
	// ReportedAt is set only in the copy written to etcd (when it was written).
	ReportedAt string `json:"reportedAt,omitempty"`
}

// Source states.
const (
	SourceConnected    = "connected"
	SourceDisconnected = "disconnected"
)

// VM is one VM's row.
type VM struct {
	Name     string `json:"name"`
	Phase    string `json:"phase"`
	Detail   string `json:"detail"`
	Address  string `json:"address"`
	Address6 string `json:"address6"` // "" where the guests have no IPv6
	MAC      string `json:"mac"`
	Tap      string `json:"tap"`
	PID      int    `json:"pid"`
	Restarts int    `json:"restarts"`
	Power    string `json:"power,omitempty"` // desired power
	// StateBytes is the size on disk of a suspended VM's saved state.
	StateBytes int64 `json:"stateBytes,omitempty"`
	// Wakes counts the resumes callers asked for (a suspended VM's first
	// caller), over the VM's life.
	Wakes int `json:"wakes,omitempty"`
	// Progress of the step in progress when it is measurable (an image
	// download, in bytes); absent otherwise.
	Progress *Progress `json:"progress,omitempty"`
}

// Progress is done out of total units of a VM's step in progress.
type Progress struct {
	Done  int64 `json:"done"`
	Total int64 `json:"total"`
}

// Exposure is one exposure's row; State is active | pending | failed.
type Exposure struct {
	Name        string `json:"name"`
	VM          string `json:"vm,omitempty"`
	Target      string `json:"target,omitempty"`
	Target6     string `json:"target6,omitempty"`
	State       string `json:"state"`
	Mode        string `json:"mode"`
	Reason      string `json:"reason"`
	HostAddress string `json:"hostAddress"`
	HostPort    int    `json:"hostPort"` // the first port of a range
	// HostPortLast is the last port of a host port range ("hostPort:
	// 30000-30099"), absent for one port.
	HostPortLast int    `json:"hostPortLast,omitempty"`
	Protocol     string `json:"protocol"`
	GuestPort    int    `json:"guestPort"`
	// GuestPortLast is the last port of a guest range (each host port to
	// its own), absent when every host port goes to GuestPort.
	GuestPortLast int    `json:"guestPortLast,omitempty"`
	MaxConns      int    `json:"maxConns"`
	Active        uint64 `json:"active"`
	Accepted      uint64 `json:"accepted"`
	Refused       uint64 `json:"refused"`
	Dropped       uint64 `json:"dropped"`
	Denied        uint64 `json:"denied"` // callers allowFrom turned away
	BytesIn       uint64 `json:"bytesIn"`
	BytesOut      uint64 `json:"bytesOut"`

	// ProxyProtocol: the PROXY header (v1, v2) the proxy writes; "" none.
	ProxyProtocol string `json:"proxyProtocol,omitempty"`
}

// HostPorts is the host port or range as the config writes it ("8080",
// "30000-30099").
func (e Exposure) HostPorts() string { return portText(e.HostPort, e.HostPortLast) }

// GuestPorts is the guest port or range.
func (e Exposure) GuestPorts() string { return portText(e.GuestPort, e.GuestPortLast) }

func portText(first, last int) string {
	if last > first {
		return strconv.Itoa(first) + "-" + strconv.Itoa(last)
	}
	return strconv.Itoa(first)
}

// Changes lists names added, changed and removed between two configs.
type Changes struct {
	Added   []string `json:"added"`
	Changed []string `json:"changed"`
	Removed []string `json:"removed"`
}

// Empty reports whether nothing changes.
func (c Changes) Empty() bool { return len(c.Added)+len(c.Changed)+len(c.Removed) == 0 }

// Plan is the answer to POST /v1/apply: what changes (and, without dryRun,
// was applied).
type Plan struct {
	DryRun         bool     `json:"dryRun"`
	Applied        bool     `json:"applied"`
	NetworkChanged bool     `json:"networkChanged"`
	VMs            Changes  `json:"vms"`
	Exposures      Changes  `json:"exposures"`
	Warnings       []string `json:"warnings,omitempty"`
}

// Error is the body of every non-2xx answer.
type Error struct {
	Error  string   `json:"error"`
	Errors []string `json:"errors,omitempty"` // one per field, for a rejected config
}
