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

// loadedState is the desired state as loadDesired found it.
type loadedState struct {
	c     *config.Config
	model *spec.Desired
	base  []byte      // desired.json's bytes
	j     journalRead // the journal beside it
}

// loadDesired reads stateDir/desired.json and the journal beside it
// (JournalFile): the file with the journal's records replayed in order is
// the desired state. It returns a nil c when there is no desired.json yet.
// The file, and the state after the replay, go through the same parser and
// validation as a config file, so a hand-edited or older file is held to
// the same rules.
func loadDesired(stateDir string) (loadedState, error) {
	path := filepath.Join(stateDir, DesiredFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return loadedState{}, nil
	}
	if err != nil {
		return loadedState{}, fmt.Errorf("reading desired state: %w", err)
	}
	c, m, err := config.Load(b)
	if err != nil {
		return loadedState{}, fmt.Errorf("%s is not a valid desired state (fix or remove it; the daemon will not guess):\n%w", path, err)
	}
	jpath := filepath.Join(stateDir, JournalFile)
	jr, err := readJournal(jpath, b)
	if err != nil {
		return loadedState{}, err
	}
	if len(jr.records) > 0 {
		if c, err = replay(jpath, c, jr.records); err != nil {
			return loadedState{}, err
		}
		var errs config.Errors
		if m, errs = config.Compile(c); len(errs) > 0 {
			return loadedState{}, fmt.Errorf("%s with the %d changes of %s replayed is not a valid desired state (fix or remove the journal, losing its changes; the daemon will not guess):\n%w",
				path, len(jr.records), jpath, errs)
		}
	}
	return loadedState{c: c, model: m, base: b, j: jr}, nil
}

// encodeDesired is desired.json's content for c.
func encodeDesired(c *config.Config) ([]byte, error) {
	b, err := json.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("persisting desired state: %w", err)
	}
	return append(indented(b), '\n'), nil
}

// saveDesired writes the desired state atomically: a temp file in the same
// directory, fsynced, renamed over the old one, and the directory fsynced, so
// a crash leaves either the old file or the new one, never a torn one. It
// returns the bytes written. Only persistWhole calls it: the journal must
// be reset after it.
func saveDesired(stateDir string, c *config.Config) ([]byte, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, fmt.Errorf("persisting desired state: %w", err)
	}
	b, err := encodeDesired(c)
	if err != nil {
		return nil, err
	}
	if err := atomicfile.Write(filepath.Join(stateDir, DesiredFile), b, 0o600); err != nil {
		return nil, fmt.Errorf("persisting desired state: %w", err)
	}
	return b, nil
}

// persistWhole writes c as desired.json and then resets the journal to
// apply to it (see JournalFile for why a crash between the two is safe).
// An error means desired.json was not written: nothing changed. A journal
// that cannot be reset after is logged and left broken: the change is
// persisted (the old journal no longer names desired.json), and the next
// change of one exposure writes the whole state again.
func (d *Daemon) persistWhole(c *config.Config) error {
	b, err := saveDesired(d.host.StateDir, c)
	if err != nil {
		return err
	}
	if err := d.journal.reset(b); err != nil {
		d.log.Warn("the desired state is written whole, but its journal could not be reset; the next exposure change writes the whole state again", "err", err)
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
