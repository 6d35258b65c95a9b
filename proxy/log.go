package proxy

import (
	"context"
	"log/slog"
	"net/netip"
	"sync"
	"time"
)

// LogEvery is the rate limit of the proxy's log lines: at most one line per
// exposure and kind of event (a cap refusal, a descriptor shortage, a dead
// accept loop) in this interval, so a flood of refusals cannot flood the
// journal. What is held back is counted and reported ("suppressed") with the
// next line of that kind, or by the next Converge once the interval is over.
const LogEvery = 10 * time.Second

// Option configures a Manager.
type Option func(*Manager)

// WithLogger sets the Manager's logger (default: slog.Default() when the
// Manager is made).
func WithLogger(l *slog.Logger) Option { return func(m *Manager) { m.logs.log = l } }

// WithHolders names, in a listener's bind failure with EADDRINUSE, the
// processes holding its port (proto "tcp" or "udp"); "" when none is found.
func WithHolders(f func(proto string, addr netip.AddrPort) string) Option {
	return func(m *Manager) { m.holders = f }
}

// Events the proxy logs.
const (
	evRefused  = "refused"
	evDenied   = "denied"
	evShortage = "shortage"
	evRecover  = "recovered"
	evDeadLoop = "dead-loop"
)

type logKey struct{ exposure, event string }

type logState struct {
	at         time.Time // when the last line of this kind was written
	suppressed int       // lines held back since
	level      slog.Level
	msg        string
	args       []any // of the last held-back event, for the flush
}

// logLimiter writes at most one line per (exposure, event) per interval.
type logLimiter struct {
	log   *slog.Logger
	every time.Duration
	now   func() time.Time

	mu    sync.Mutex
	state map[logKey]*logState
}

func newLogLimiter() logLimiter {
	return logLimiter{log: slog.Default(), every: LogEvery, now: time.Now, state: map[logKey]*logState{}}
}

func (l *logLimiter) event(level slog.Level, exposure, event, msg string, args ...any) {
	now := l.now()
	l.mu.Lock()
	k := logKey{exposure, event}
	s := l.state[k]
	if s == nil {
		s = &logState{}
		l.state[k] = s
	}
	if !s.at.IsZero() && now.Sub(s.at) < l.every {
		s.suppressed++
		s.level, s.msg, s.args = level, msg, args
		l.mu.Unlock()
		return
	}
	n := s.suppressed
	s.at, s.suppressed, s.args = now, 0, nil
	l.mu.Unlock()
	l.write(level, exposure, msg, n, args)
}

// flush reports what was held back once its interval is over, and forgets
// kinds that have been quiet for a whole interval.
func (l *logLimiter) flush() {
	now := l.now()
	type line struct {
		level    slog.Level
		exposure string
		msg      string
		n        int
		args     []any
	}
	var out []line
	l.mu.Lock()
	for k, s := range l.state {
		if now.Sub(s.at) < l.every {
			continue
		}
		if s.suppressed == 0 {
			delete(l.state, k)
			continue
		}
		out = append(out, line{s.level, k.exposure, s.msg, s.suppressed, s.args})
		s.at, s.suppressed, s.args = now, 0, nil
	}
	l.mu.Unlock()
	for _, x := range out {
		l.write(x.level, x.exposure, x.msg, x.n, x.args)
	}
}

func (l *logLimiter) write(level slog.Level, exposure, msg string, suppressed int, args []any) {
	attrs := append([]any{"exposure", exposure}, args...)
	if suppressed > 0 {
		attrs = append(attrs, "suppressed", suppressed, "interval", l.every)
	}
	l.log.Log(context.Background(), level, msg, attrs...)
}
