package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/atomicfile"
	"github.com/brokkr/brokkr/internal/spec"
)

// DesiredFile is the name of the persisted desired state under stateDir.
const DesiredFile = "desired.json"

// loadDesired reads stateDir/desired.json and its model. It returns nils
// when there is none yet. The file goes through the same parser and
// validation as a config file, so a hand-edited or older file is held to the
// same rules.
func loadDesired(stateDir string) (*config.Config, *spec.Desired, error) {
	path := filepath.Join(stateDir, DesiredFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("reading desired state: %w", err)
	}
	c, m, err := config.Load(b)
	if err != nil {
		return nil, nil, fmt.Errorf("%s is not a valid desired state (fix or remove it; the daemon will not guess):\n%w", path, err)
	}
	return c, m, nil
}

// saveDesired writes the desired state atomically: a temp file in the same
// directory, fsynced, renamed over the old one, and the directory fsynced, so
// a crash leaves either the old file or the new one, never a torn one.
func saveDesired(stateDir string, c *config.Config) error {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return fmt.Errorf("persisting desired state: %w", err)
	}
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return fmt.Errorf("persisting desired state: %w", err)
	}
	b = append(b, '\n')
	if err := atomicfile.Write(filepath.Join(stateDir, DesiredFile), b, 0o600); err != nil {
		return fmt.Errorf("persisting desired state: %w", err)
	}
	return nil
}
