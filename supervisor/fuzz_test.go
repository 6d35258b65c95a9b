package supervisor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Whatever bytes are on disk, reading a record never panics, and it either
// fails with an error naming the file or yields this VM's record.
func FuzzReadRecord(f *testing.F) {
	f.Add([]byte(`{"version":1,"name":"vm","spec":{"Name":"vm","CPUs":1},"instance":{"PID":42,"StartTime":7}}`))
	f.Add([]byte(`{"version":1,"name":"other"}`))
	f.Add([]byte(`{"version":2,"name":"vm"}`))
	f.Add([]byte(`{"version":1,"name":"vm","instance":{"PID":`))
	f.Add([]byte{})
	f.Add([]byte("\x00\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "record.json"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		r, err := readRecord(dir, "vm")
		if err != nil {
			if !strings.Contains(err.Error(), filepath.Join(dir, "record.json")) {
				t.Fatalf("error does not name the file: %v", err)
			}
			return
		}
		if r == nil || r.Name != "vm" || r.Version != recordVersion {
			t.Fatalf("accepted a record that is not this VM's: %+v", r)
		}
		// What was accepted survives a write and a read unchanged.
		if err := writeRecord(dir, r); err != nil {
			t.Fatal(err)
		}
		if _, err := readRecord(dir, "vm"); err != nil {
			t.Fatalf("re-read of a written record: %v", err)
		}
	})
}

// ValidateSpec never panics and accepts only specs whose names can be
// directory names.
func FuzzValidateSpec(f *testing.F) {
	f.Add("vm", 1, 64, "/k", "running", "always")
	f.Add("../etc", 1, 64, "/k", "running", "always")
	f.Add("vm", 0, 64, "", "off", "sometimes")
	f.Fuzz(func(t *testing.T, name string, cpus, mem int, kernel, power, restart string) {
		s := VMSpec{Name: name, CPUs: cpus, MemoryMiB: mem, Kernel: Source{Location: kernel}, Power: Power(power), Restart: Restart(restart)}
		if ValidateSpec(&s) == nil && (!NameRE.MatchString(name) || filepath.Base(name) != name || name == "." || name == "..") {
			t.Fatalf("accepted name %q", name)
		}
	})
}
