package images

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// Disk copy methods PrepareDisk reports.
const (
	MethodExisting = "existing" // the VM's disk was already there
	MethodReflink  = "reflink"  // FICLONE: shared extents, copy-on-write
	MethodSparse   = "sparse"   // data ranges copied, holes kept
)

// PrepareDisk makes the VM's disk at dst from base (see CloneDisk) and logs
// how it was made.
func (c *Cache) PrepareDisk(ctx context.Context, base, dst string, size int64) error {
	method, err := CloneDisk(ctx, base, dst, size)
	if err != nil {
		return err
	}
	c.log.Info("disk ready", "disk", dst, "base", base, "method", method)
	return nil
}

// CloneDisk makes the VM's disk at dst from the base image: a reflink
// clone where the filesystem supports it, else a sparse copy, then grown to
// size bytes (0 = the base's size). A disk that already exists is the VM's
// own data and is kept; it is only grown, never shrunk or replaced. The copy
// stops early when ctx ends (the partial file is removed).
func CloneDisk(ctx context.Context, base, dst string, size int64) (method string, err error) {
	bfi, err := os.Stat(base)
	if err != nil {
		return "", fmt.Errorf("disk: base image: %w", err)
	}
	if size != 0 && size < bfi.Size() {
		return "", fmt.Errorf("disk: size %d bytes is smaller than the image (%d bytes)", size, bfi.Size())
	}
	if size == 0 {
		size = bfi.Size()
	}
	if fi, err := os.Stat(dst); err == nil {
		if fi.Size() < size {
			if err := os.Truncate(dst, size); err != nil {
				return "", fmt.Errorf("disk: growing %s: %w", dst, err)
			}
		}
		return MethodExisting, nil
	}
	tmp := dst + ".tmp"
	_ = os.Remove(tmp)
	method, err = cloneFile(ctx, base, tmp)
	if err == nil {
		err = finishDisk(tmp, dst, size)
	}
	if err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("disk: %s from %s: %w", dst, base, err)
	}
	return method, nil
}

func finishDisk(tmp, dst string, size int64) error {
	f, err := os.OpenFile(tmp, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}

// cloneFile copies src to a new file dst, by reflink when possible.
func cloneFile(ctx context.Context, src, dst string) (string, error) {
	in, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return "", err
	}
	defer out.Close()
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err == nil {
		return MethodReflink, nil
	}
	if err := sparseCopy(ctx, in, out); err != nil {
		return "", err
	}
	return MethodSparse, nil
}

// sparseCopy copies only the data ranges of in (SEEK_DATA/SEEK_HOLE), so
// holes stay holes in out. out is sized to in first.
func sparseCopy(ctx context.Context, in, out *os.File) error {
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	inFd := int(in.Fd())
	var off int64
	for off < size {
		data, err := unix.Seek(inFd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole is left
		}
		if err != nil {
			return fmt.Errorf("SEEK_DATA: %w", err)
		}
		hole, err := unix.Seek(inFd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("SEEK_HOLE: %w", err)
		}
		if err := copyRange(ctx, in, out, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// copyRange copies n bytes at off from in to the same offset in out, in the
// kernel (copy_file_range) when it can, else through a buffer.
func copyRange(ctx context.Context, in, out *os.File, off, n int64) error {
	roff, woff := off, off
	for n > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		c, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 64<<20)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL) {
				_, err := io.Copy(io.NewOffsetWriter(out, roff), io.NewSectionReader(in, roff, n))
				return err
			}
			return fmt.Errorf("copy_file_range: %w", err)
		}
		if c == 0 {
			return fmt.Errorf("copy_file_range: source ended early at %d", roff)
		}
		n -= int64(c)
	}
	return nil
}
