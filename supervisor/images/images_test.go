package images

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/brokkr/brokkr/supervisor"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func sum(b []byte) string { h := sha256.Sum256(b); return hex.EncodeToString(h[:]) }

func payload(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i/251)
	}
	return b
}

// imageServer serves body at /img, counting requests. With chunk > 0 it
// sends the body in chunks with a pause between them (a slow server).
type imageServer struct {
	*httptest.Server
	hits atomic.Int32
}

func newImageServer(t *testing.T, body []byte, chunk int, pause time.Duration) *imageServer {
	s := &imageServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/img" {
			http.NotFound(w, r)
			return
		}
		s.hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if chunk <= 0 {
			_, _ = w.Write(body)
			return
		}
		for off := 0; off < len(body); off += chunk {
			_, _ = w.Write(body[off:min(off+chunk, len(body))])
			w.(http.Flusher).Flush()
			select {
			case <-time.After(pause):
			case <-r.Context().Done():
				return
			}
		}
	}))
	t.Cleanup(s.Close)
	return s
}

func cacheFiles(t *testing.T, c *Cache) []string {
	entries, err := os.ReadDir(c.Dir())
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestFetchURLVerifiesAndCaches(t *testing.T) {
	body := payload(300_000)
	srv := newImageServer(t, body, 0, 0)
	c, err := New(t.TempDir())
	require.NoError(t, err)
	src := supervisor.Source{Location: srv.URL + "/img", SHA256: sum(body)}
	p, err := c.Fetch(t.Context(), src, nil)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(c.Dir(), sum(body)), p, "content-addressed by sha256")
	got, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Equal(t, body, got)
	// Cached: no second request, even with the hash in upper case.
	src.SHA256 = string(bytes.ToUpper([]byte(src.SHA256)))
	p2, err := c.Fetch(t.Context(), src, nil)
	require.NoError(t, err)
	assert.Equal(t, p, p2)
	assert.Equal(t, int32(1), srv.hits.Load())
	// A new Cache over the same stateDir finds it too.
	c2, err := New(filepath.Dir(c.Dir()))
	require.NoError(t, err)
	_, err = c2.Fetch(t.Context(), src, nil)
	require.NoError(t, err)
	assert.Equal(t, int32(1), srv.hits.Load())
}

func TestFetchWrongHashKeepsNothing(t *testing.T) {
	body := payload(50_000)
	srv := newImageServer(t, body, 0, 0)
	c, err := New(t.TempDir())
	require.NoError(t, err)
	wrong := sum([]byte("something else"))
	loc := srv.URL + "/img"
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: loc, SHA256: wrong}, nil)
	require.Error(t, err)
	msg := err.Error()
	assert.Contains(t, msg, loc, "names the source")
	assert.Contains(t, msg, sum(body), "names the hash it got")
	assert.Contains(t, msg, wrong, "names the hash it wanted")
	assert.Empty(t, cacheFiles(t, c), "the bad download is not kept")
	// The next attempt downloads again rather than trusting anything.
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: loc, SHA256: wrong}, nil)
	require.Error(t, err)
	assert.Equal(t, int32(2), srv.hits.Load())
}

// Several VMs asking for one slow image share one download, and each sees
// its progress climb to 100%.
func TestFetchSharedWithProgress(t *testing.T) {
	body := payload(64 << 10)
	srv := newImageServer(t, body, 4<<10, 15*time.Millisecond) // 16 chunks, ~240 ms
	c, err := New(t.TempDir())
	require.NoError(t, err)
	src := supervisor.Source{Location: srv.URL + "/img", SHA256: sum(body)}

	const callers = 5
	var wg sync.WaitGroup
	details := make([][]string, callers)
	paths := make([]string, callers)
	errs := make([]error, callers)
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var last int64 = -1
			paths[i], errs[i] = c.Fetch(t.Context(), src, func(done, total int64) {
				if done < last {
					errs[i] = fmt.Errorf("progress went back from %d to %d", last, done)
				}
				last = done
				assert.Equal(t, int64(len(body)), total)
				details[i] = append(details[i], fmt.Sprintf("%d/%d", done, total))
			})
		}()
	}
	wg.Wait()
	assert.Equal(t, int32(1), srv.hits.Load(), "one download for %d callers", callers)
	first := details[0]
	for i := 0; i < callers; i++ {
		require.NoError(t, errs[i])
		assert.Equal(t, paths[0], paths[i])
	}
	// The first caller joined before any byte arrived.
	require.NotEmpty(t, first)
	assert.Equal(t, fmt.Sprintf("%d/%d", len(body), len(body)), first[len(first)-1], "the last report is the whole")
	assert.Greater(t, len(first), 3, "intermediate progress is reported: %v", first)
	t.Logf("caller 0 saw %v", first)
}

// A caller whose context ends returns at once; the shared download goes on
// and lands in the cache for the next caller.
func TestFetchCallerCancelDoesNotStopSharedDownload(t *testing.T) {
	body := payload(32 << 10)
	// The server holds the download after its first chunk until released:
	// the first caller can only return by giving up, whatever the load.
	release := make(chan struct{})
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body[:4<<10])
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		_, _ = w.Write(body[4<<10:])
	}))
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer srv.Close()
	defer free() // before Close, which waits for the handler
	c, err := New(t.TempDir())
	require.NoError(t, err)
	src := supervisor.Source{Location: srv.URL + "/img", SHA256: sum(body)}
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { _, err := c.Fetch(ctx, src, nil); done <- err }()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		free()
		<-done
		t.Fatal("Fetch waited for the download instead of returning when its context ended")
	}
	require.ErrorIs(t, err, context.DeadlineExceeded)
	free()
	p, err := c.Fetch(t.Context(), src, nil) // joins the running download
	require.NoError(t, err)
	assert.FileExists(t, p)
	assert.Equal(t, int32(1), hits.Load())
}

func TestFetchStalledServer(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1000")
		_, _ = w.Write([]byte("partial"))
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	c, err := New(t.TempDir(), WithStallTimeout(150*time.Millisecond))
	require.NoError(t, err)
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: srv.URL + "/img", SHA256: sum(nil)}, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "stalled")
	assert.Empty(t, cacheFiles(t, c))
}

func TestFetchHTTPError(t *testing.T) {
	srv := newImageServer(t, nil, 0, 0)
	c, err := New(t.TempDir())
	require.NoError(t, err)
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: srv.URL + "/missing", SHA256: sum(nil)}, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "404")
	assert.Contains(t, err.Error(), "/missing")
}

func TestFetchLocalPath(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "vmlinuz")
	body := payload(10_000)
	require.NoError(t, os.WriteFile(src, body, 0o644))
	c, err := New(t.TempDir())
	require.NoError(t, err)

	// No sha256 given: hashed, copied, addressed by its hash.
	var seen []string
	p, err := c.Fetch(t.Context(), supervisor.Source{Location: src}, func(d, t int64) { seen = append(seen, fmt.Sprintf("%d/%d", d, t)) })
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(c.Dir(), sum(body)), p)
	assert.Contains(t, seen, fmt.Sprintf("%d/%d", len(body), len(body)), "the whole file is reported")
	// The copy does not change when the source file does.
	require.NoError(t, os.WriteFile(src, []byte("changed"), 0o644))
	got, _ := os.ReadFile(p)
	assert.Equal(t, body, got)
	// ...and the changed file is hashed again, not served from memory.
	p2, err := c.Fetch(t.Context(), supervisor.Source{Location: src}, nil)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(c.Dir(), sum([]byte("changed"))), p2)

	// With a sha256 it is checked.
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: src, SHA256: sum(body)}, nil)
	require.NoError(t, err, "the old content is still cached under its hash")
	other := filepath.Join(dir, "other")
	require.NoError(t, os.WriteFile(other, []byte("x"), 0o644))
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: other, SHA256: sum([]byte("y"))}, nil)
	require.ErrorContains(t, err, "sha256 mismatch")
	_, err = c.Fetch(t.Context(), supervisor.Source{Location: filepath.Join(dir, "absent")}, nil)
	require.ErrorContains(t, err, "absent")
}

func TestValidate(t *testing.T) {
	good := sum(nil)
	ok := []supervisor.Source{
		{Location: "/boot/vmlinuz"},
		{Location: "https://example.org/k", SHA256: good},
		{Location: "http://10.0.0.1:8080/k", SHA256: "  " + good + " "},
	}
	for _, s := range ok {
		assert.NoError(t, Validate(s), s.Location)
	}
	bad := map[string]supervisor.Source{
		"empty":           {},
		"sha256 is requ":  {Location: "https://example.org/k"},
		"absolute":        {Location: "images/k"},
		"only http":       {Location: "ftp://example.org/k", SHA256: good},
		"64 hex digits":   {Location: "/k", SHA256: "abc"},
		"not hex":         {Location: "/k", SHA256: good[:63] + "z"},
		"not a valid URL": {Location: "http://", SHA256: good},
	}
	for want, s := range bad {
		err := Validate(s)
		if assert.Error(t, err, want) {
			assert.Contains(t, err.Error(), want)
		}
	}
}

func FuzzValidate(f *testing.F) {
	f.Add("https://example.org/k", sum(nil))
	f.Add("/boot/vmlinuz", "")
	f.Add("http://[::1", "zz")
	f.Fuzz(func(t *testing.T, loc, sha string) {
		err := Validate(supervisor.Source{Location: loc, SHA256: sha})
		if err == nil && sha != "" {
			if _, err := NormalizeSHA256(sha); err != nil {
				t.Fatalf("accepted a bad sha256 %q", sha)
			}
		}
		if err == nil && isURL(loc) && sha == "" {
			t.Fatal("accepted a URL without sha256")
		}
	})
}

// A guest's kernel or disk copied from a world-readable source is root's
// only in the cache, and so is the cache directory, even one made 0755 by an
// older brokkr.
func TestCachedImagesAreRootOnly(t *testing.T) {
	src := filepath.Join(t.TempDir(), "vmlinuz")
	require.NoError(t, os.WriteFile(src, payload(1000), 0o644))
	state := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(state, "images"), 0o755))
	c, err := New(state)
	require.NoError(t, err)
	p, err := c.Fetch(t.Context(), supervisor.Source{Location: src}, nil)
	require.NoError(t, err)
	fi, err := os.Stat(p)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o400), fi.Mode().Perm(), "cached image mode")
	di, err := os.Stat(c.Dir())
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), di.Mode().Perm(), "cache directory mode")
}
