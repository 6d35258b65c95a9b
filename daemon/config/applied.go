package config

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/brokkr/brokkr/internal/atomicfile"
)

// AppliedFile, under stateDir, records which config file was last applied
// and its content's hash. brokkrd compares it with the file when it starts:
// a file changed since it was applied is applied again (README: "Which wins,
// the file or desired.json").
const AppliedFile = "config-applied.json"

// Applied is the record.
type Applied struct {
	Path      string    `json:"path"`
	SHA256    string    `json:"sha256"`
	AppliedAt time.Time `json:"appliedAt"`
}

// FileHash is the hash Applied records: of the bytes, not of the parsed
// config, so a comment edited is a change too (the operator edited the
// file; brokkrd says it applied it rather than leave them guessing).
func FileHash(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// ReadApplied returns the record, or nil when there is none.
func ReadApplied(stateDir string) (*Applied, error) {
	b, err := os.ReadFile(filepath.Join(stateDir, AppliedFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", AppliedFile, err)
	}
	var a Applied
	if err := json.Unmarshal(b, &a); err != nil {
		// A torn or hand-edited record only means "not known to be
		// applied": the file gets applied, which is the safe side.
		return nil, nil
	}
	return &a, nil
}

// RecordApplied writes the record atomically.
func RecordApplied(stateDir, path string, data []byte) error {
	b, err := json.MarshalIndent(Applied{Path: path, SHA256: FileHash(data), AppliedAt: time.Now().UTC()}, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.Write(filepath.Join(stateDir, AppliedFile), append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("recording the applied config: %w", err)
	}
	return nil
}
