// Package atomicfile writes state files so that a crash leaves either the old
// or the new content, never a torn file: records, leases and desired state.
package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
)

// Write puts data at path: a temp file in the same directory (so the rename
// cannot cross filesystems), fsynced, renamed over path, then the directory
// fsynced so the rename itself survives a power cut.
func Write(path string, data []byte, perm os.FileMode) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Chmod(perm); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	return errors.Join(d.Sync(), d.Close())
}
