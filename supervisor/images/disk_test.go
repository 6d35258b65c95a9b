package images

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const mib = 1 << 20

// sparseBase writes a 64 MiB file with data only at 0 and 32 MiB.
func sparseBase(t *testing.T, dir string) (string, []byte, []byte) {
	p := filepath.Join(dir, "base.raw")
	f, err := os.Create(p)
	require.NoError(t, err)
	defer f.Close()
	a, b := bytes.Repeat([]byte("A"), mib), bytes.Repeat([]byte("B"), 4096)
	_, err = f.WriteAt(a, 0)
	require.NoError(t, err)
	_, err = f.WriteAt(b, 32*mib)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(64*mib))
	return p, a, b
}

func allocated(t *testing.T, p string) int64 {
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(p, &st))
	return st.Blocks * 512
}

func TestPrepareDiskSparseAndGrown(t *testing.T) {
	dir := t.TempDir()
	base, a, b := sparseBase(t, dir)
	dst := filepath.Join(dir, "vm", "disk.raw")
	require.NoError(t, os.MkdirAll(filepath.Dir(dst), 0o755))
	method, err := CloneDisk(t.Context(), base, dst, 128*mib)
	require.NoError(t, err)
	t.Logf("copy method on this filesystem: %s", method)
	assert.Contains(t, []string{MethodReflink, MethodSparse}, method)
	fi, err := os.Stat(dst)
	require.NoError(t, err)
	assert.Equal(t, int64(128*mib), fi.Size(), "grown to the requested size")
	got, err := os.ReadFile(dst)
	require.NoError(t, err)
	assert.Equal(t, a, got[:mib])
	assert.Equal(t, b, got[32*mib:32*mib+4096])
	assert.Equal(t, make([]byte, 16*mib), got[mib:17*mib], "holes read as zeros")
	if method == MethodSparse {
		assert.Less(t, allocated(t, dst), int64(4*mib), "holes are not written: %d bytes allocated", allocated(t, dst))
	}
	assert.NoFileExists(t, dst+".tmp")
}

func TestSparseCopyDirect(t *testing.T) {
	// The fallback path, whatever the filesystem supports.
	dir := t.TempDir()
	base, a, _ := sparseBase(t, dir)
	in, err := os.Open(base)
	require.NoError(t, err)
	defer in.Close()
	out, err := os.Create(filepath.Join(dir, "copy"))
	require.NoError(t, err)
	defer out.Close()
	require.NoError(t, sparseCopy(t.Context(), in, out))
	fi, _ := out.Stat()
	assert.Equal(t, int64(64*mib), fi.Size())
	got := make([]byte, mib)
	_, err = out.ReadAt(got, 0)
	require.NoError(t, err)
	assert.Equal(t, a, got)
	assert.Less(t, allocated(t, out.Name()), int64(4*mib))
}

// A VM's existing disk holds its data: kept, only ever grown.
func TestPrepareDiskKeepsExisting(t *testing.T) {
	dir := t.TempDir()
	base, _, _ := sparseBase(t, dir)
	dst := filepath.Join(dir, "disk.raw")
	_, err := CloneDisk(t.Context(), base, dst, 0)
	require.NoError(t, err)
	fi, _ := os.Stat(dst)
	assert.Equal(t, int64(64*mib), fi.Size(), "size 0 = the image's size")
	f, err := os.OpenFile(dst, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt([]byte("guest data"), 10*mib)
	require.NoError(t, err)
	f.Close()

	method, err := CloneDisk(t.Context(), base, dst, 96*mib)
	require.NoError(t, err)
	assert.Equal(t, MethodExisting, method)
	got, _ := os.ReadFile(dst)
	assert.Equal(t, "guest data", string(got[10*mib:10*mib+10]))
	assert.Len(t, got, 96*mib)
	_, err = CloneDisk(t.Context(), base, dst, 80*mib)
	require.NoError(t, err)
	fi, _ = os.Stat(dst)
	assert.Equal(t, int64(96*mib), fi.Size(), "never shrunk")
}

func TestPrepareDiskErrors(t *testing.T) {
	dir := t.TempDir()
	base, _, _ := sparseBase(t, dir)
	_, err := CloneDisk(t.Context(), base, filepath.Join(dir, "d"), 1*mib)
	require.ErrorContains(t, err, "smaller than the image")
	_, err = CloneDisk(t.Context(), filepath.Join(dir, "nope"), filepath.Join(dir, "d"), 0)
	require.ErrorContains(t, err, "base image")
	_, err = CloneDisk(t.Context(), base, filepath.Join(dir, "no-such-dir", "d"), 0)
	require.Error(t, err)
	assert.NoFileExists(t, filepath.Join(dir, "d"))
}

func TestCloneDiskCanceled(t *testing.T) {
	dir := t.TempDir()
	base, _, _ := sparseBase(t, dir)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	dst := filepath.Join(dir, "d")
	_, err := CloneDisk(ctx, base, dst, 0)
	if err == nil {
		t.Skip("the filesystem reflinked the whole file before ctx was looked at")
	}
	require.ErrorIs(t, err, context.Canceled)
	assert.NoFileExists(t, dst)
	assert.NoFileExists(t, dst+".tmp")
}

// The Cache plugs into the engine as its ImageFetcher.
func TestCacheIsImageFetcher(t *testing.T) {
	c, err := New(t.TempDir())
	require.NoError(t, err)
	base, _, _ := sparseBase(t, t.TempDir())
	dst := filepath.Join(t.TempDir(), "disk.raw")
	require.NoError(t, c.PrepareDisk(t.Context(), base, dst, 0))
	assert.FileExists(t, dst)
}
