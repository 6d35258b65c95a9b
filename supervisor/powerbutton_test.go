package supervisor

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// A fake guest that hears only presses made after `listens` (a guest still
// booting drops the earlier ones) and has exited by the next wait after a
// heard press.
type buttonGuest struct {
	start   time.Time
	listens time.Duration
	heard   bool
	presses int
}

func (g *buttonGuest) press() error {
	g.presses++
	g.heard = g.heard || time.Since(g.start) >= g.listens
	return nil
}

func (g *buttonGuest) waitExit(d time.Duration) bool {
	time.Sleep(d)
	return g.heard
}

func never() bool { return false }

func TestAPressDroppedWhileBootingIsFollowedByAnother(t *testing.T) {
	g := &buttonGuest{start: time.Now(), listens: 30 * time.Millisecond}
	exited, err := PressPowerButton(time.Second, 20*time.Millisecond, g.press, g.waitExit, never)
	assert.NoError(t, err)
	assert.True(t, exited, "the second or third press was heard")
	assert.GreaterOrEqual(t, g.presses, 2)
	assert.Less(t, g.presses, 5, "no more presses once the guest has gone")
}

func TestAGuestThatNeverListensGetsPressesForTheWholeGrace(t *testing.T) {
	g := &buttonGuest{start: time.Now(), listens: time.Hour}
	t0 := time.Now()
	exited, err := PressPowerButton(100*time.Millisecond, 30*time.Millisecond, g.press, g.waitExit, never)
	took := time.Since(t0)
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.GreaterOrEqual(t, took, 100*time.Millisecond, "the grace is waited out")
	assert.Less(t, took, 500*time.Millisecond, "and no longer")
	// Pressed at 0, 30, 60 and 90 ms; a slow sleep can leave out the last.
	assert.GreaterOrEqual(t, g.presses, 3)
	assert.LessOrEqual(t, g.presses, 4)
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
	n := 0
	press := func() error {
		n++
		if n > 1 {
			return errors.New("closing")
		}
		return nil
	}
	exited, err := PressPowerButton(50*time.Millisecond, 10*time.Millisecond, press,
		func(d time.Duration) bool { time.Sleep(d); return false }, never)
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.GreaterOrEqual(t, n, 4)
}

func TestAnEndedContextStopsThePressing(t *testing.T) {
	g := &buttonGuest{start: time.Now(), listens: time.Hour}
	exited, err := PressPowerButton(time.Hour, 10*time.Millisecond, g.press, g.waitExit, func() bool { return true })
	assert.NoError(t, err)
	assert.False(t, exited)
	assert.Equal(t, 1, g.presses)
}
