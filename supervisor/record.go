package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/brokkr/brokkr/internal/atomicfile"
)

// recordVersion is bumped when the record layout changes incompatibly.
const recordVersion = 1

// record is what survives a daemon restart for one VM: the spec its running
// process was started from, the process's identity, and the restart count.
type record struct {
	Version  int       `json:"version"`
	Name     string    `json:"name"`
	Spec     VMSpec    `json:"spec"`
	Instance *Instance `json:"instance,omitempty"`
	// Starting: a start was under way when this was written. A daemon
	// killed inside Start leaves a VMM that no record names; the next one
	// finds it by its run directory and kills it before starting afresh.
	Starting  bool      `json:"starting,omitempty"`
	StartedAt time.Time `json:"startedAt,omitzero"`
	Restarts  int       `json:"restarts"`

	// Suspend and resume (docs/ARCHITECTURE.md, "Suspend and resume"): at
	// most one of the flags is set, and each says what the next daemon
	// does if this one dies there.
	//
	// Suspending: a suspend is under way and its state is not complete;
	// the VMM (Instance) runs, maybe paused: it is continued and the
	// partial state removed.
	Suspending bool `json:"suspending,omitempty"`
	// Suspended: the state in the VM's suspend directory is complete. An
	// Instance still set is a VMM that had not ended yet: it is ended.
	Suspended *savedState `json:"suspended,omitempty"`
	// Resuming: Restore was under way. Without an Instance, the VMM it
	// started (its guest never ran) is killed and the state kept; with
	// one, the guest is continued (or, its VMM dead, the state is dropped
	// for a cold boot: that guest may have run on its disk since).
	Resuming bool `json:"resuming,omitempty"`
	Wakes    int  `json:"wakes,omitempty"`
}

// savedState describes a suspended VM's state on disk.
type savedState struct {
	Bytes int64     `json:"bytes"` // size on disk
	At    time.Time `json:"at"`
	Kind  string    `json:"kind"` // the backend that wrote it
	// Idle: suspended by idleSuspend (desired power stays running), so a
	// wake resumes it.
	Idle bool `json:"idle,omitempty"`
}

func recordPath(vmDir string) string { return filepath.Join(vmDir, "record.json") }

// readRecord returns (nil, nil) when there is no record. Any other failure
// (unreadable, not JSON, another VM's record, an unknown version) is an
// error naming the file: the caller reports it and never overwrites it.
func readRecord(vmDir, name string) (*record, error) {
	p := recordPath(vmDir)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("record %s: %w", p, err)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("record %s is corrupt: %w", p, err)
	}
	if r.Version != recordVersion {
		return nil, fmt.Errorf("record %s: version %d, want %d", p, r.Version, recordVersion)
	}
	if r.Name != name {
		return nil, fmt.Errorf("record %s: names VM %q, want %q", p, r.Name, name)
	}
	return &r, nil
}

// writeRecord replaces the record atomically: a reader (or a daemon that
// crashes halfway) sees the old record or the new one, never a torn file.
func writeRecord(vmDir string, r *record) error {
	r.Version = recordVersion
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(recordPath(vmDir), b, 0o600)
}
