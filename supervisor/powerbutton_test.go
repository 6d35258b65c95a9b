package supervisor

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// fakeClock is the time the tests' waits move on: a wait of d takes
// exactly d.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// A fake guest that hears only presses made after `listens` (a guest still
// booting drops the earlier ones) and has exited by the next wait after a
// heard press.
type buttonGuest struct {
	clock   *fakeClock
	start   time.Time
	listens time.Duration
	heard   bool
	presses []time.Duration // when each press came, from the start
}

func newButtonGuest(listens time.Duration) *buttonGuest {
	c := &fakeClock{t: time.Unix(1e9, 0)}
	return &buttonGuest{clock: c, start: c.t, listens: listens}
}

func (g *buttonGuest) press() error {
	at := g.clock.t.Sub(g.start)
	g.presses = append(g.presses, at)
	g.heard = g.heard || at >= g.listens
	return nil
}

func (g *buttonGuest) waitExit(d time.Duration) bool {
	g.clock.t = g.clock.t.Add(d)
	return g.heard
}

func (g *buttonGuest) run(grace, every time.Duration, done func() bool) (bool, error) {
	return pressPowerButton(g.clock.now, grace, every, g.press, g.waitExit, done)
}

func never() bool { return false }

func ms(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

func TestAPressDroppedWhileBootingIsFollowedByAnother(t *testing.T) {
	g := newButtonGuest(30 * time.Millisecond)
	exited, err := g.run(time.Second, 20*time.Millisecond, never)
	assert.NoError(t, err)
	assert.True(t, exited, "the press at 40 ms was heard")
	assert.Equal(t, ms(0, 20, 40), g.presses, "no more presses once the guest has gone")
}

func TestAGuestThatNeverListensGetsPressesForTheWholeGrace(t *testing.T) {
	g := newButtonGuest(time.Hour)
	exited, err := g.run(100*time.Millisecond, 30*time.Millisecond, never)
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.Equal(t, 100*time.Millisecond, g.clock.t.Sub(g.start), "the grace is waited out, and no longer")
	assert.Equal(t, ms(0, 30, 60, 90), g.presses)
}

func TestAFailedFirstPressReturnsAtOnce(t *testing.T) {
	boom := errors.New("api down")
	waited := false
	exited, err := PressPowerButton(time.Hour, 0, func() error { return boom },
		func(time.Duration) bool { waited = true; return false }, never)
	assert.ErrorIs(t, err, boom)
	assert.False(t, exited)
	assert.False(t, waited, "nothing heard the press, so there is nothing to wait for")
}

func TestLaterPressFailuresAreIgnored(t *testing.T) {
	g := newButtonGuest(time.Hour)
	press := func() error {
		_ = g.press()
		if len(g.presses) > 1 {
			return errors.New("closing")
		}
		return nil
	}
	exited, err := pressPowerButton(g.clock.now, 50*time.Millisecond, 10*time.Millisecond, press, g.waitExit, never)
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.Equal(t, ms(0, 10, 20, 30, 40), g.presses, "pressing goes on after a failed press")
}

func TestAnEndedContextStopsThePressing(t *testing.T) {
	g := newButtonGuest(time.Hour)
	exited, err := g.run(time.Hour, 10*time.Millisecond, func() bool { return true })
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.Equal(t, ms(0), g.presses)
}
