package daemon

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"slices"
	"sync"

	"github.com/brokkr/brokkr/daemon/config"
	"github.com/brokkr/brokkr/internal/atomicfile"
)

// JournalFile holds, under stateDir beside desired.json, the changes of one
// exposure (PUT and DELETE /v1/exposures) made since desired.json was last
// written whole: desired.json with the journal's records replayed in order
// is the desired state. A change is acknowledged once its record is on disk
// (fsync'd); changes that arrive while an fsync is in flight share the next
// one (group commit), so concurrent clients do not queue one fsync each.
//
// The file is a header naming the desired.json it applies to, then records:
//
//	brokkr desired journal v1\n
//	base sha256:<64 hex digits of desired.json's bytes>\n
//	record := length uint32 BE | CRC-32C of payload uint32 BE | payload
//	payload := {"put": <exposure, as an entry of desired.json's exposures>}
//	         | {"remove": "<name>"}
//
// Compaction (past compactRecords or compactBytes, and on every whole
// apply, reload, fleet document or power change) writes desired.json whole
// (atomically: temp file, fsync, rename, directory fsync) and then replaces
// the journal by a header naming the new desired.json (atomically too). A
// crash between the two leaves the new desired.json and the old journal,
// whose base is not that desired.json: its records are already in it, and
// the journal is set aside at start. A crash before the rename leaves the
// old desired.json, which the old journal names: replayed.
//
// A torn last record (a crash in the middle of its write; never
// acknowledged) is dropped at start: a frame that runs past the end of the
// file, a last record whose checksum fails, or zeros to the end (pages not
// written back). Anything else that does not read is an error naming the
// file, the record and its offset; nothing is guessed.
const JournalFile = "desired.journal"

const (
	journalMagic = "brokkr desired journal v1\n"
	journalBase  = "base sha256:"
	// journalHeaderLen is the header's length: magic, base line.
	journalHeaderLen = len(journalMagic) + len(journalBase) + 64 + 1
	// maxJournalRecord bounds one record (an exposure is well under 1 KiB).
	maxJournalRecord = 1 << 20
	// compactRecords and compactBytes bound the journal: past either,
	// the change that crossed it writes desired.json whole.
	compactRecords = 1000
	compactBytes   = 4 << 20
)

var crc32c = crc32.MakeTable(crc32.Castagnoli)

// journalRecord is one change: an exposure put (created or replaced) or
// removed by name.
type journalRecord struct {
	Put    json.RawMessage `json:"put,omitempty"`
	Remove string          `json:"remove,omitempty"`
}

// journal is the open journal file. Appends are serialised by the caller
// (the daemon's applyMu); wait may be called concurrently.
type journal struct {
	path string
	// maxRecords and maxBytes bound the journal (compactRecords,
	// compactBytes; smaller in tests).
	maxRecords int
	maxBytes   int64
	// sync is (*os.File).Sync; tests count or fail it.
	sync func(*os.File) error

	mu      sync.Mutex
	cond    *sync.Cond
	f       *os.File
	size    int64 // bytes in the file
	records int   // records since the header
	// written counts the records written (write(2)), synced those known
	// on disk; a record's number is its value of written.
	written, synced uint64
	syncing         bool
	// err, when set, is why the journal cannot take a record (a write or
	// an fsync failed): until the next reset, which the next change does.
	err error
}

func newJournal(stateDir string) *journal {
	j := &journal{path: stateDir + "/" + JournalFile, maxRecords: compactRecords, maxBytes: compactBytes,
		sync: (*os.File).Sync}
	j.cond = sync.NewCond(&j.mu)
	return j
}

// header is the journal's header for a desired.json of these bytes.
func journalHeader(base []byte) []byte {
	sum := sha256.Sum256(base)
	return []byte(journalMagic + journalBase + hex.EncodeToString(sum[:]) + "\n")
}

// reset replaces the journal by an empty one whose base is desired.json
// with these bytes (just written whole): every record written before is in
// it, so all of them count as on disk.
func (j *journal) reset(base []byte) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	for j.syncing {
		j.cond.Wait()
	}
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
	// All written records are in base: their waiters are answered.
	j.synced = j.written
	j.cond.Broadcast()
	h := journalHeader(base)
	if err := atomicfile.Write(j.path, h, 0o600); err != nil {
		j.err = fmt.Errorf("resetting %s: %w", j.path, err)
		return j.err
	}
	f, err := os.OpenFile(j.path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		j.err = fmt.Errorf("opening %s: %w", j.path, err)
		return j.err
	}
	j.f, j.size, j.records, j.err = f, int64(len(h)), 0, nil
	return nil
}

// broken is why the journal cannot take a record, or nil: a write or an
// fsync failed, or the file at its path is no longer the one open (another
// process, a daemon started on this stateDir to take over from this one,
// compacted it; this process goes on from its own state, written whole).
func (j *journal) broken() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.err != nil {
		return j.err
	}
	if j.f == nil {
		return fmt.Errorf("%s is not open", j.path)
	}
	mine, err := j.f.Stat()
	if err == nil {
		var there os.FileInfo
		if there, err = os.Stat(j.path); err == nil && !os.SameFile(mine, there) {
			err = errors.New("replaced by another process")
		}
	}
	if err != nil {
		j.err = fmt.Errorf("%s: %w", j.path, err)
	}
	return j.err
}

// full says the journal is past its bound: compact it.
func (j *journal) full() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.records >= j.maxRecords || j.size >= j.maxBytes
}

// append writes one record (not yet synced) and returns its number, for
// wait. On an error nothing of it counts, and the journal takes no more
// records until reset.
func (j *journal) append(rec journalRecord) (uint64, error) {
	payload, err := json.Marshal(rec)
	if err != nil {
		return 0, err
	}
	frame := make([]byte, 8, 8+len(payload))
	binary.BigEndian.PutUint32(frame[0:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(frame[4:8], crc32.Checksum(payload, crc32c))
	frame = append(frame, payload...)
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.err != nil {
		return 0, j.err
	}
	if j.f == nil {
		return 0, fmt.Errorf("%s is not open", j.path)
	}
	if _, err := j.f.Write(frame); err != nil {
		// A part of the frame may be in the file: cut it off; either way
		// the journal is reset before it takes another record.
		_ = j.f.Truncate(j.size)
		j.err = fmt.Errorf("appending to %s: %w", j.path, err)
		return 0, j.err
	}
	j.size += int64(len(frame))
	j.records++
	j.written++
	return j.written, nil
}

// wait returns once record seq is on disk: it runs an fsync for every
// record written so far, or, when one is in flight, waits for it and then
// runs the next if seq was not in it.
func (j *journal) wait(seq uint64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	for j.synced < seq {
		if j.err != nil {
			return j.err
		}
		if j.syncing {
			j.cond.Wait()
			continue
		}
		j.syncing = true
		f, upto := j.f, j.written
		j.mu.Unlock()
		err := j.sync(f)
		j.mu.Lock()
		j.syncing = false
		if err != nil {
			j.err = fmt.Errorf("syncing %s: %w", j.path, err)
		} else if upto > j.synced {
			j.synced = upto
		}
		j.cond.Broadcast()
	}
	return nil
}

func (j *journal) close() {
	j.mu.Lock()
	defer j.mu.Unlock()
	for j.syncing {
		j.cond.Wait()
	}
	if j.f != nil {
		_ = j.f.Close()
		j.f = nil
	}
}

// journalRead is what readJournal found.
type journalRead struct {
	missing bool // no journal file
	stale   bool // its base is not this desired.json: already compacted into it
	records []journalRecord
	torn    int64 // bytes of a torn last record dropped (0: none)
}

// readJournal reads the journal at path against desired.json's bytes.
func readJournal(path string, base []byte) (journalRead, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return journalRead{missing: true}, nil
	}
	if err != nil {
		return journalRead{}, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) < journalHeaderLen || !bytes.HasPrefix(data, []byte(journalMagic+journalBase)) || data[journalHeaderLen-1] != '\n' {
		return journalRead{}, fmt.Errorf("%s: not a brokkr desired-state journal (its header is not %q); fix or remove it, the daemon will not guess", path, journalMagic+journalBase+"<sha256>")
	}
	if !bytes.Equal(data[:journalHeaderLen], journalHeader(base)) {
		return journalRead{stale: true}, nil
	}
	var out journalRead
	off := journalHeaderLen
	for n := 1; off < len(data); n++ {
		rest := data[off:]
		bad := func(format string, a ...any) error {
			return fmt.Errorf("%s: record %d (at byte %d): %s; the journal is damaged (fix or remove it, losing its changes; the daemon will not guess)",
				path, n, off, fmt.Sprintf(format, a...))
		}
		if len(rest) < 8 {
			out.torn = int64(len(rest)) // a frame header cut short: the last write, torn
			break
		}
		size, sum := binary.BigEndian.Uint32(rest[0:4]), binary.BigEndian.Uint32(rest[4:8])
		if size == 0 || size > maxJournalRecord {
			if allZero(rest) {
				out.torn = int64(len(rest))
				break
			}
			return journalRead{}, bad("length %d is not a record's", size)
		}
		if int(size) > len(rest)-8 {
			out.torn = int64(len(rest)) // runs past the end: the last write, torn
			break
		}
		payload := rest[8 : 8+size]
		if crc32.Checksum(payload, crc32c) != sum {
			if after := rest[8+size:]; allZero(after) {
				out.torn = int64(len(rest))
				break
			}
			return journalRead{}, bad("checksum mismatch")
		}
		var rec journalRecord
		dec := json.NewDecoder(bytes.NewReader(payload))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rec); err != nil {
			return journalRead{}, bad("not a record: %v", err)
		}
		if (rec.Put == nil) == (rec.Remove == "") {
			return journalRead{}, bad("a record is exactly one of put or remove")
		}
		out.records = append(out.records, rec)
		off += 8 + int(size)
	}
	return out, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// replay makes c's exposures what the records say, in order: a put
// replaces the exposure of its name in place or is added after the others,
// a remove takes one out (WithExposure and WithoutExposure, one after the
// other, without copying the list per record).
func replay(path string, c *config.Config, recs []journalRecord) (*config.Config, error) {
	exps := slices.Clone(c.Exposures)
	gone := make([]bool, len(exps))
	at := make(map[string]int, len(exps))
	for i, e := range exps {
		at[e.Name] = i
	}
	for i, rec := range recs {
		if rec.Remove != "" {
			k, found := at[rec.Remove]
			if !found {
				return nil, fmt.Errorf("%s: record %d removes exposure %q, which is not in the desired state there; the journal does not belong to this desired.json", path, i+1, rec.Remove)
			}
			gone[k] = true
			delete(at, rec.Remove)
			continue
		}
		e, err := config.DecodeExposure(rec.Put)
		if err != nil {
			return nil, fmt.Errorf("%s: record %d: not an exposure: %w", path, i+1, err)
		}
		if e.Name == "" {
			return nil, fmt.Errorf("%s: record %d: an exposure without a name", path, i+1)
		}
		if k, ok := at[e.Name]; ok {
			exps[k] = e
			continue
		}
		at[e.Name] = len(exps)
		exps = append(exps, e)
		gone = append(gone, false)
	}
	out := make([]config.Exposure, 0, len(at))
	for i, e := range exps {
		if !gone[i] {
			out = append(out, e)
		}
	}
	cp := *c
	cp.Exposures = out
	return &cp, nil
}

// openJournal readies the journal at start, on the state loadDesired
// found: replayed records (and a torn tail) are compacted into
// desired.json at once, so the journal starts empty on the file the daemon
// runs from; a stale journal (a compaction cut short between its two
// writes: its records are in desired.json) or none is replaced by an empty
// one on desired.json as it is.
func openJournal(j *journal, opts Options, desired *config.Config, loaded loadedState) error {
	switch {
	case loaded.j.torn > 0:
		opts.Logger.Warn("the journal's last record was torn (a crash while it was written; it was never acknowledged): dropped",
			"file", j.path, "bytes", loaded.j.torn, "records", len(loaded.j.records))
	case loaded.j.stale:
		opts.Logger.Info("the journal is already in desired.json (a compaction was cut short): set aside", "file", j.path)
	}
	if len(loaded.j.records) == 0 && loaded.j.torn == 0 {
		return j.reset(loaded.base)
	}
	b, err := saveDesired(opts.Host.StateDir, withHost(desired, opts.Host))
	if err != nil {
		return err
	}
	return j.reset(b)
}
