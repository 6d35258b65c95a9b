// Package images keeps the hypervisor's inputs (kernels, initramfs, disk
// images) in a content-addressed cache, stateDir/images/<sha256>, fetched
// from local paths or http(s) URLs and verified before use, and makes each
// VM's disk as a sparse copy of its base image.
package images

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/brokkr/brokkr/supervisor"
)

// Progress is told how far a fetch has come: done bytes of total (total is
// -1 when the server does not say). It is called from the fetching
// goroutine, never after its Fetch has returned, and must neither block nor
// call back into the Cache.
type Progress func(done, total int64)

// Cache is the content-addressed image store. Safe for concurrent use.
type Cache struct {
	dir          string
	client       *http.Client
	stallTimeout time.Duration
	log          *slog.Logger

	group singleflight.Group

	mu       sync.Mutex
	watchers map[string]map[int]Progress // flight key -> caller id -> callback
	nextID   int
	local    map[string]localStamp // local path -> what it was when last hashed
}

// localStamp remembers a hashed local file so an unchanged file given
// without a sha256 is not read again on every start.
type localStamp struct {
	size, mtime int64
	ino         uint64
	sha         string
}

func stampOf(path string) (localStamp, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return localStamp{}, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return localStamp{}, false
	}
	return localStamp{size: fi.Size(), mtime: fi.ModTime().UnixNano(), ino: st.Ino}, true
}

// Option configures a Cache.
type Option func(*Cache)

// WithStallTimeout is how long a download may go without receiving a byte
// before it fails (default 60 s). Large images take long; silent ones fail.
func WithStallTimeout(d time.Duration) Option { return func(k *Cache) { k.stallTimeout = d } }

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(k *Cache) { k.log = l } }

// New opens (creating) the cache in stateDir/images.
func New(stateDir string, opts ...Option) (*Cache, error) {
	c := &Cache{
		dir:          filepath.Join(stateDir, "images"),
		client:       &http.Client{},
		stallTimeout: 60 * time.Second,
		log:          slog.Default(),
		watchers:     map[string]map[int]Progress{},
		local:        map[string]localStamp{},
	}
	for _, o := range opts {
		o(c)
	}
	// Cached images are guests' kernels and disks: root's only, like the
	// rest of stateDir, whatever the source file's mode was. Chmod also
	// tightens a directory an older brokkr made 0755.
	if err := os.MkdirAll(c.dir, 0o700); err != nil {
		return nil, fmt.Errorf("images: %w", err)
	}
	if err := os.Chmod(c.dir, 0o700); err != nil {
		return nil, fmt.Errorf("images: %w", err)
	}
	// Partial downloads of a previous run are worthless.
	if tmps, err := filepath.Glob(filepath.Join(c.dir, ".tmp-*")); err == nil {
		for _, t := range tmps {
			_ = os.Remove(t)
		}
	}
	return c, nil
}

// Dir is the cache directory.
func (c *Cache) Dir() string { return c.dir }

// NormalizeSHA256 checks that s is a sha256 in hex and returns it in lower case.
func NormalizeSHA256(s string) (string, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	if len(s) != 64 {
		return "", fmt.Errorf("sha256 %q: want 64 hex digits, got %d characters", s, len(s))
	}
	if _, err := hex.DecodeString(s); err != nil {
		return "", fmt.Errorf("sha256 %q: not hex", s)
	}
	return s, nil
}

// isURL reports whether the location is fetched over http(s).
func isURL(loc string) bool {
	return strings.HasPrefix(loc, "http://") || strings.HasPrefix(loc, "https://")
}

// Validate checks a Source without fetching it: a URL must parse and carry
// a sha256; a local path must be absolute; a given sha256 must be well formed.
func Validate(src supervisor.Source) error {
	if src.Location == "" {
		return errors.New("location is empty")
	}
	if isURL(src.Location) {
		u, err := url.Parse(src.Location)
		if err != nil || u.Host == "" {
			return fmt.Errorf("location %q is not a valid URL", src.Location)
		}
		if src.SHA256 == "" {
			return fmt.Errorf("location %q is a URL: sha256 is required", src.Location)
		}
	} else if strings.Contains(src.Location, "://") {
		return fmt.Errorf("location %q: only http and https URLs are supported", src.Location)
	} else if !filepath.IsAbs(src.Location) {
		return fmt.Errorf("location %q: a local path must be absolute", src.Location)
	}
	if src.SHA256 != "" {
		if _, err := NormalizeSHA256(src.SHA256); err != nil {
			return err
		}
	}
	return nil
}

// Fetch returns the path of src's content in the cache, fetching and
// verifying it first if needed. Concurrent fetches of one image share a
// single download, and every caller's progress is told about it. When ctx
// ends the caller returns at once; a download others (or nobody) still wait
// for runs on into the cache.
// progress may be nil. (Its type is spelled out, not Progress, so that
// *Cache satisfies supervisor.ImageFetcher.)
func (c *Cache) Fetch(ctx context.Context, src supervisor.Source, progress func(done, total int64)) (string, error) {
	if err := Validate(src); err != nil {
		return "", fmt.Errorf("image %s: %w", src.Location, err)
	}
	want := ""
	if src.SHA256 != "" {
		want, _ = NormalizeSHA256(src.SHA256)
		if p := filepath.Join(c.dir, want); fileExists(p) {
			return p, nil // only verified content is ever renamed into place
		}
	}
	key := want
	var before localStamp // the local file as it was before the copy
	if key == "" {
		key = "path:" + src.Location
		var ok bool
		if before, ok = stampOf(src.Location); ok {
			if p, ok := c.knownLocal(src.Location, before); ok {
				return p, nil
			}
		}
	}
	id := c.watch(key, progress)
	defer c.unwatch(key, id)
	ch := c.group.DoChan(key, func() (any, error) {
		// Not the first caller's ctx: the download is shared.
		return c.fetch(context.WithoutCancel(ctx), src.Location, want, func(done, total int64) { c.report(key, done, total) })
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return "", r.Err
		}
		p := r.Val.(string)
		if want == "" {
			c.rememberLocal(src.Location, before, filepath.Base(p))
		}
		return p, nil
	case <-ctx.Done():
		return "", fmt.Errorf("image %s: %w", src.Location, ctx.Err())
	}
}

// knownLocal returns the cached copy of a local file hashed before, if the
// file is unchanged (now, its current stamp, has the same size, mtime and
// inode) and the copy is still there.
func (c *Cache) knownLocal(path string, now localStamp) (string, bool) {
	c.mu.Lock()
	was, seen := c.local[path]
	c.mu.Unlock()
	if !seen || was.size != now.size || was.mtime != now.mtime || was.ino != now.ino {
		return "", false
	}
	p := filepath.Join(c.dir, was.sha)
	return p, fileExists(p)
}

// rememberLocal records the file's stamp after hashing, unless the file
// changed while it was copied (then the next fetch hashes it again).
func (c *Cache) rememberLocal(path string, before localStamp, sha string) {
	st, ok := stampOf(path)
	if !ok || st != before {
		return
	}
	st.sha = sha
	c.mu.Lock()
	c.local[path] = st
	c.mu.Unlock()
}

func (c *Cache) watch(key string, p Progress) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.nextID++
	if p != nil {
		if c.watchers[key] == nil {
			c.watchers[key] = map[int]Progress{}
		}
		c.watchers[key][c.nextID] = p
	}
	return c.nextID
}

func (c *Cache) unwatch(key string, id int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.watchers[key], id)
	if len(c.watchers[key]) == 0 {
		delete(c.watchers, key)
	}
}

// report calls the watchers under the lock, so a caller that has left
// (unwatch) is never called afterwards.
func (c *Cache) report(key string, done, total int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.watchers[key] {
		p(done, total)
	}
}

// fetch copies the source into a temp file in the cache while hashing it,
// checks the hash, and renames the file to its hash. A mismatch removes it.
func (c *Cache) fetch(ctx context.Context, loc, want string, progress Progress) (string, error) {
	tmp, err := os.CreateTemp(c.dir, ".tmp-*")
	if err != nil {
		return "", fmt.Errorf("image %s: %w", loc, err)
	}
	keep := false
	defer func() {
		tmp.Close()
		if !keep {
			os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	w := &progressWriter{w: io.MultiWriter(tmp, h), progress: progress, total: -1}
	if isURL(loc) {
		err = c.download(ctx, loc, w)
	} else {
		err = copyLocal(loc, w)
	}
	if err != nil {
		return "", fmt.Errorf("image %s: %w", loc, err)
	}
	got := hex.EncodeToString(h.Sum(nil))
	if want != "" && got != want {
		return "", fmt.Errorf("image %s: sha256 mismatch: the source has %s, the config wants %s (the download was discarded)", loc, got, want)
	}
	if err := tmp.Sync(); err != nil {
		return "", fmt.Errorf("image %s: %w", loc, err)
	}
	if err := tmp.Chmod(0o400); err != nil {
		return "", fmt.Errorf("image %s: %w", loc, err)
	}
	dst := filepath.Join(c.dir, got)
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", fmt.Errorf("image %s: %w", loc, err)
	}
	keep = true
	if d, err := os.Open(c.dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	c.log.Info("image cached", "source", loc, "sha256", got, "bytes", w.done)
	return dst, nil
}

func copyLocal(path string, w *progressWriter) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil {
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("not a regular file")
		}
		w.total = fi.Size()
	}
	_, err = io.Copy(w, f)
	return err
}

func (c *Cache) download(ctx context.Context, loc string, w *progressWriter) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, loc, nil)
	if err != nil {
		return err
	}
	// The stall timer cancels the request when no byte arrives for a while;
	// each read that returns data rearms it.
	errStalled := fmt.Errorf("download stalled: no data for %s", c.stallTimeout)
	stall := time.AfterFunc(c.stallTimeout, func() { cancel(errStalled) })
	defer stall.Stop()
	resp, err := c.client.Do(req)
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
			return cause
		}
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET: %s", resp.Status)
	}
	w.total = resp.ContentLength
	buf := make([]byte, 256<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			stall.Reset(c.stallTimeout)
			if _, err := w.Write(buf[:n]); err != nil {
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
				return cause
			}
			return rerr
		}
	}
	if w.total >= 0 && w.done != w.total {
		return fmt.Errorf("GET: got %d of %d bytes", w.done, w.total)
	}
	return nil
}

// progressWriter counts bytes and reports each new whole percent (or each
// MiB when the size is unknown), plus the end.
type progressWriter struct {
	w        io.Writer
	progress Progress
	done     int64
	total    int64
	last     int64
}

func (p *progressWriter) Write(b []byte) (int, error) {
	n, err := p.w.Write(b)
	p.done += int64(n)
	if p.progress != nil {
		step := p.done >> 20
		if p.total > 0 {
			step = p.done * 100 / p.total
		}
		if step != p.last || p.done == p.total {
			p.last = step
			p.progress(p.done, p.total)
		}
	}
	return n, err
}

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}
