package daemon

import (
	"bytes"
	"os"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
)

// StartWithFile settles which wins when brokkrd starts with a config file
// and stateDir/desired.json exists. The file's content hash is recorded
// whenever the file is applied (config.AppliedFile):
//
//   - unchanged since it was last applied: desired.json wins, since it also
//     holds what came after (brokkr apply, vm start/stop);
//   - changed (or never applied): the file is applied, as SIGHUP would, and
//     the plan says what that changed. An edit is never silently ignored.
//
// An error means the file was rejected as a whole; brokkrd refuses to start
// rather than run on a state the operator did not write.
func (d *Daemon) StartWithFile(path string, data []byte, cfg *config.Config) (applied bool, plan api.Plan, err error) {
	rec, err := config.ReadApplied(d.host.StateDir)
	if err != nil {
		return false, api.Plan{}, err
	}
	if rec != nil && rec.Path == path && rec.SHA256 == config.FileHash(data) {
		return false, api.Plan{}, nil
	}
	plan, err = d.Apply(cfg, false)
	if err != nil {
		return true, plan, err
	}
	return true, plan, config.RecordApplied(d.host.StateDir, path, data)
}

// FileApplied records that the file at path, with this content, was
// applied (brokkrd's SIGHUP reload).
func (d *Daemon) FileApplied(path string, data []byte) error {
	return config.RecordApplied(d.host.StateDir, path, data)
}

// noteAPIApply records an apply through the API whose body is the recorded
// config file's current content: `systemctl reload` runs `brokkr apply -f
// /etc/brokkr/brokkr.yaml`, and the next start must know that edit was
// applied, or it would apply it again over later vm start/stop.
func (d *Daemon) noteAPIApply(body []byte) {
	rec, err := config.ReadApplied(d.host.StateDir)
	if err != nil || rec == nil || rec.Path == "" {
		return
	}
	cur, err := os.ReadFile(rec.Path)
	if err != nil || !bytes.Equal(cur, body) {
		return
	}
	if err := config.RecordApplied(d.host.StateDir, rec.Path, body); err != nil {
		d.log.Warn("recording the applied config file", "err", err)
	}
}
