package proxy

import (
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sleepers is a Waker: VMs put to sleep by the test, woken when it says.
type sleepers struct {
	mu     sync.Mutex
	asleep map[string]chan struct{}
	asked  map[string]int
}

func newSleepers() *sleepers {
	return &sleepers{asleep: map[string]chan struct{}{}, asked: map[string]int{}}
}

func (s *sleepers) Wake(vm string) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := s.asleep[vm]
	if ch != nil {
		s.asked[vm]++
	}
	return ch
}

func (s *sleepers) sleep(vm string) {
	s.mu.Lock()
	s.asleep[vm] = make(chan struct{})
	s.mu.Unlock()
}

func (s *sleepers) wakeUp(vm string) {
	s.mu.Lock()
	close(s.asleep[vm])
	delete(s.asleep, vm)
	s.mu.Unlock()
}

func (s *sleepers) askedFor(vm string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.asked[vm]
}

// freePort is a loopback port nothing listens on (yet).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// echoOn serves the echo of echoServer on a given loopback port.
func echoOn(t *testing.T, port int, tag string) {
	t.Helper()
	ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	require.NoError(t, err)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 64)
				n, _ := c.Read(buf)
				_, _ = c.Write(append([]byte(tag), buf[:n]...))
			})
		}
	})
}

// Twenty callers arrive at once while the VM sleeps and its guest does not
// listen: each is held (not reset, not refused), one wake is asked for per
// caller from the same sleeper, and once the VM runs every one of them is
// carried to the guest and answered.
func TestCallersOfASleepingVMAreHeldUntilItRuns(t *testing.T) {
	for _, late := range []bool{false, true} {
		name := "guest listens when the VM runs"
		if late {
			// A state that did not load boots the VM cold: it runs before
			// its guest listens, and the proxy dials until it does.
			name = "guest listens after the VM runs"
		}
		t.Run(name, func(t *testing.T) {
			w := newSleepers()
			g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
			m := NewManager(g.resolve, nil, WithWaker(w, 20*time.Second))
			t.Cleanup(m.StopAll)
			port := freePort(t)
			spec := tcpSpec("web", port)
			w.sleep("vm1")
			st := only(t, m, spec)

			const callers = 20
			answers := make(chan string, callers)
			var wg sync.WaitGroup
			for i := range callers {
				wg.Go(func() {
					c, err := net.Dial("tcp", st.BoundAddr)
					if err != nil {
						answers <- "dial: " + err.Error()
						return
					}
					defer c.Close()
					_ = c.SetDeadline(time.Now().Add(15 * time.Second))
					msg := fmt.Sprintf("caller-%02d", i)
					if _, err := io.WriteString(c, msg); err != nil {
						answers <- "write: " + err.Error()
						return
					}
					buf := make([]byte, len("g:")+len(msg))
					if _, err := io.ReadFull(c, buf); err != nil {
						answers <- "read: " + err.Error()
						return
					}
					answers <- string(buf)
				})
			}
			eventually(t, "every caller asked for the wake", func() bool { return w.askedFor("vm1") == callers })
			time.Sleep(200 * time.Millisecond) // held: nobody answered, nobody was reset
			assert.Empty(t, answers)
			cs := only(t, m, spec).Counters
			assert.EqualValues(t, callers, cs.Active, "held callers hold their places under the cap")
			assert.Zero(t, cs.Dropped+cs.Refused)
			if late {
				w.wakeUp("vm1")
				time.Sleep(300 * time.Millisecond)
				echoOn(t, port, "g:")
			} else {
				echoOn(t, port, "g:")
				w.wakeUp("vm1")
			}
			wg.Wait()
			close(answers)
			got := map[string]bool{}
			for a := range answers {
				got[a] = true
			}
			for i := range callers {
				assert.True(t, got[fmt.Sprintf("g:caller-%02d", i)], "caller %d: answers %v", i, got)
			}
			eventually(t, "every caller counted", func() bool { return only(t, m, spec).Counters.Accepted == callers })
			cs = only(t, m, spec).Counters
			assert.Zero(t, cs.Dropped, "none dropped")
			assert.Zero(t, cs.Refused, "none refused")
		})
	}
}

// A VM that does not come back within the hold: its caller is reset and
// counted as dropped, and its place under the cap is given back.
func TestACallerHeldPastTheHoldIsDropped(t *testing.T) {
	w := newSleepers()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, nil, WithWaker(w, 300*time.Millisecond))
	t.Cleanup(m.StopAll)
	spec := tcpSpec("web", freePort(t))
	w.sleep("vm1")
	st := only(t, m, spec)
	t0 := time.Now()
	requireReset(t, st.BoundAddr)
	assert.GreaterOrEqual(t, time.Since(t0), 300*time.Millisecond, "held for the hold")
	eventually(t, "counted as dropped", func() bool { return only(t, m, spec).Counters.Dropped == 1 })
	cs := only(t, m, spec).Counters
	assert.Zero(t, cs.Accepted)
	assert.Zero(t, cs.Active, "the place is given back")
	assert.Equal(t, 1, w.askedFor("vm1"))
}

// A VM that is awake is dialled at once: nothing is asked of the Waker
// beyond the lookup.
func TestAnAwakeVMIsDialledAtOnce(t *testing.T) {
	w := newSleepers()
	g := &guests{addrs: map[string]string{"vm1": "127.0.0.1"}}
	m := NewManager(g.resolve, nil, WithWaker(w, time.Minute))
	t.Cleanup(m.StopAll)
	port := freePort(t)
	echoOn(t, port, "g:")
	st := only(t, m, tcpSpec("web", port))
	assert.Equal(t, "g:hi", roundTrip(t, dial(t, st.BoundAddr), "g:", "hi"))
	assert.Zero(t, w.askedFor("vm1"))
}
