package radv

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// When each guest is solicited: every 2 s for its first 32 s, then 4, 8,
// 16, 32 s apart and once a minute from then on while it never answers;
// once a minute while it answers; every 2 s again, backing off, once it
// stopped answering for longer than it counts as seen.
func TestSolicitationsBackOffForAGuestThatNeverAnswers(t *testing.T) {
	clock := time.Unix(0, 0)
	s := &Server{t: defaults, now: func() time.Time { return clock }, bindings: map[netip.Addr]*guest{}}
	mac, _ := net.ParseMAC("52:54:00:00:00:01")
	a := netip.MustParseAddr("fd00::5054:ff:fe00:1")
	s.SetBindings([]Binding{{MAC: mac, Addr: a}})
	var at []time.Duration
	run := func(until time.Duration) {
		for ; clock.Sub(time.Unix(0, 0)) <= until; clock = clock.Add(time.Second) {
			if len(s.due(clock)) > 0 {
				at = append(at, clock.Sub(time.Unix(0, 0)))
			}
		}
	}
	run(4 * time.Minute)
	var gaps []time.Duration
	for i := 1; i < len(at); i++ {
		gaps = append(gaps, at[i]-at[i-1])
	}
	assert.Equal(t, []time.Duration{
		2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second,
		2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second, 2 * time.Second,
		2 * time.Second, 2 * time.Second, // 0..32 s
		4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second, time.Minute, time.Minute,
	}, gaps[:22])

	// It answers: the next solicitation a minute after the answer.
	s.bindings[a].seenAt = clock
	at, gaps = nil, nil
	start := clock
	run(clock.Sub(time.Unix(0, 0)) + 61*time.Second)
	assert.Equal(t, []time.Duration{time.Minute}, []time.Duration{at[0] - start.Sub(time.Unix(0, 0))})
	assert.Len(t, at, 1)

	// Silent past seenFor: asked again soon, backing off.
	at = nil
	clock = clock.Add(defaults.seenFor)
	base := clock.Sub(time.Unix(0, 0))
	run(base + 15*time.Second)
	assert.Equal(t, []time.Duration{base, base + 4*time.Second, base + 12*time.Second}, at,
		"at once, then doubling (the guest is no longer booting)")
}
