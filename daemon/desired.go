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
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("persisting desired state: %w", err)
	}
	b = append(indented(b), '\n')
	if err := atomicfile.Write(filepath.Join(stateDir, DesiredFile), b, 0o600); err != nil {
		return fmt.Errorf("persisting desired state: %w", err)
	}
	return nil
}

// indented is compact JSON (json.Marshal's, no whitespace) laid out as
// json.MarshalIndent(v, "", "  ") lays it out, byte for byte, in one pass
// that looks only at quotes and escapes: MarshalIndent's indenting re-scans
// the whole encoding with the JSON state machine, which cost three times
// the encoding itself at 10,000 exposures, on every one-exposure change.
func indented(b []byte) []byte {
	out := make([]byte, 0, 3*len(b)) // about what the layout adds to a desired state
	pad := []byte("\n")
	depth := 0
	newline := func() {
		for len(pad) < 1+2*depth {
			pad = append(pad, ' ', ' ')
		}
		out = append(out, pad[:1+2*depth]...)
	}
	for i := 0; i < len(b); i++ {
		switch c := b[i]; c {
		case '"':
			// Copy the string whole: its end is the first quote not
			// escaped (json.Marshal escapes quotes and backslashes).
			j := i + 1
			for j < len(b) && b[j] != '"' {
				if b[j] == '\\' {
					j++ // what it escapes
				}
				j++
			}
			j = min(j, len(b)-1)
			out = append(out, b[i:j+1]...)
			i = j
		case '{', '[':
			out = append(out, c)
			depth++
			if i+1 < len(b) && b[i+1] != '}' && b[i+1] != ']' {
				newline()
			}
		case '}', ']':
			depth--
			if i > 0 && b[i-1] != '{' && b[i-1] != '[' {
				newline()
			}
			out = append(out, c)
		case ',':
			out = append(out, c)
			newline()
		case ':':
			out = append(out, c, ' ')
		default:
			out = append(out, c)
		}
	}
	return out
}
