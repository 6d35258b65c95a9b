package proxy

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// logRecorder keeps every record logged through it.
type logRecorder struct {
	mu   sync.Mutex
	recs []loggedLine
}

type loggedLine struct {
	level slog.Level
	msg   string
	attrs map[string]any
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	l := loggedLine{level: rec.Level, msg: rec.Message, attrs: map[string]any{}}
	rec.Attrs(func(a slog.Attr) bool { l.attrs[a.Key] = a.Value.Any(); return true })
	r.mu.Lock()
	r.recs = append(r.recs, l)
	r.mu.Unlock()
	return nil
}
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

// lines are the records whose message is msg, for the exposure id.
func (r *logRecorder) lines(msg, id string) []loggedLine {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []loggedLine
	for _, l := range r.recs {
		if l.msg == msg && l.attrs["exposure"] == id {
			out = append(out, l)
		}
	}
	return out
}

// fakeClock is the limiter's clock, moved by the test.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func loggedManager(t *testing.T) (*Manager, *logRecorder, *fakeClock) {
	t.Helper()
	rec, clock := &logRecorder{}, &fakeClock{t: time.Unix(1_000_000, 0)}
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, nil, WithLogger(slog.New(rec)))
	m.logs.now = clock.now
	t.Cleanup(m.StopAll)
	return m, rec, clock
}

const refusedMsg = "proxy: caller refused at the connection cap"

// A flood of callers past the cap writes one line per exposure per
// interval; the next Converge after the interval reports how many were held
// back. Another exposure's refusals are not held back by the first's.
func TestCapRefusalsAreLoggedRateLimitedWithASuppressedCount(t *testing.T) {
	m, rec, clock := loggedManager(t)
	web, api := tcpSpec("web", echoServer(t, "g:")), tcpSpec("api", echoServer(t, "g:"))
	web.MaxConns, api.MaxConns = 1, 1
	st := m.Converge([]Spec{web, api})
	hold(t, st[0].BoundAddr)
	hold(t, st[1].BoundAddr)
	for range 5 {
		requireReset(t, st[0].BoundAddr)
	}
	requireReset(t, st[1].BoundAddr)
	eventually(t, "six refusals counted", func() bool {
		s := m.Converge([]Spec{web, api})
		return s[0].Counters.Refused == 5 && s[1].Counters.Refused == 1
	})

	got := rec.lines(refusedMsg, "web")
	require.Len(t, got, 1, "one line for a burst of refusals")
	assert.Equal(t, slog.LevelWarn, got[0].level)
	assert.EqualValues(t, 1, got[0].attrs["maxConns"])
	assert.NotContains(t, got[0].attrs, "suppressed")
	require.Len(t, rec.lines(refusedMsg, "api"), 1, "each exposure has its own limit")

	clock.add(LogEvery)
	m.Converge([]Spec{web, api})
	got = rec.lines(refusedMsg, "web")
	require.Len(t, got, 2, "the interval over, the held-back refusals are reported")
	assert.EqualValues(t, 4, got[1].attrs["suppressed"])
	assert.Len(t, rec.lines(refusedMsg, "api"), 1, "nothing was held back for api")

	clock.add(LogEvery)
	m.Converge([]Spec{web, api})
	assert.Len(t, rec.lines(refusedMsg, "web"), 2, "a quiet interval writes nothing")
	requireReset(t, st[0].BoundAddr)
	eventually(t, "a refusal after a quiet interval is logged at once", func() bool {
		return len(rec.lines(refusedMsg, "web")) == 3
	})
}

// A descriptor shortage is logged once when it starts (not once per failed
// accept), its end once, and a dead accept loop as an error naming why.
func TestShortageAndADeadAcceptLoopAreLogged(t *testing.T) {
	m, rec, _ := loggedManager(t)
	sl := &scriptedListener{errs: make(chan error, 8)}
	for range 3 {
		sl.errs <- syscall.EMFILE
	}
	m.listenTCP = func(c checked) (net.Listener, error) {
		ln, err := listenTCP(c)
		sl.Listener = ln
		return sl, err
	}
	spec := tcpSpec("web", echoServer(t, "g:"))
	st := only(t, m, spec)
	eventually(t, "the loop retries past the shortage", func() bool { return len(sl.callTimes()) >= 4 })
	short := rec.lines("proxy: out of descriptors; accepting paused, the port stays bound", "web")
	require.Len(t, short, 1, "one line per shortage, not per failed accept")
	assert.Equal(t, slog.LevelWarn, short[0].level)
	assert.ErrorIs(t, short[0].attrs["err"].(error), syscall.EMFILE)

	assert.Equal(t, "g:hi", roundTrip(t, dial(t, st.BoundAddr), "g:", "hi"))
	eventually(t, "the end of the shortage is logged", func() bool {
		return len(rec.lines("proxy: accepting again after a descriptor shortage", "web")) == 1
	})

	sl.errs <- errors.New("broken")
	dial(t, st.BoundAddr)
	const deadMsg = "proxy: accept loop ended; the listener is rebound on the next converge"
	eventually(t, "the dead loop is logged", func() bool { return len(rec.lines(deadMsg, "web")) == 1 })
	dead := rec.lines(deadMsg, "web")[0]
	assert.Equal(t, slog.LevelError, dead.level)
	assert.Contains(t, dead.attrs["err"].(error).Error(), "broken")
}
