package bpf

import (
	"context"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/internal/nstest"
)

// events collects the slots of wake events until the test ends.
func events(t *testing.T, w *Wake) <-chan int {
	t.Helper()
	ch := make(chan int, 16)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			slot, err := w.Next(t.Context())
			if err != nil {
				return
			}
			ch <- slot
		}
	})
	t.Cleanup(func() { w.Close(); wg.Wait() })
	return ch
}

func openWake(t *testing.T, pins string) *Wake {
	t.Helper()
	w, err := OpenWake(pins)
	require.NoError(t, err)
	return w
}

// A suspended guest: its link down, as a tap nobody reads is to the bridge.
func suspendGuest(t *testing.T, host *nstest.NS, port string, down bool) {
	t.Helper()
	state := "up"
	if down {
		state = "down"
	}
	host.MustRun(t, "ip", "link", "set", port, state)
}

// wakeAndResume waits for one wake event for slot, then brings the guest
// back and clears the flag, as the daemon does on a resume; and checks no
// second event comes for the same wake.
func wakeAndResume(t *testing.T, ev <-chan int, w *Wake, slot int, resume func()) {
	t.Helper()
	select {
	case got := <-ev:
		assert.Equal(t, slot, got)
	case <-time.After(10 * time.Second):
		t.Fatal("no wake event for the first caller")
	}
	asked, err := w.Asleep(slot)
	require.NoError(t, err)
	assert.True(t, asked)
	resume()
	require.NoError(t, w.Awake(slot))
}

// Callers of an asleep exposure on the nat path: the first one's packet
// sends one wake event however many callers come; their SYNs find no guest
// and are lost, and their retransmissions reach it once it is back: every
// caller connects and is answered, counted accepted, none refused or
// dropped, no RST.
func TestTheNatPathAsksOnceToWakeAndItsCallersGetThrough(t *testing.T) {
	tp := newNatTopo(t, 0)
	np := tp.load(t)
	defer np.Close()
	w := openWake(t, tp.pins)
	ev := events(t, w)

	warm, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080") // the host knows the guest's MAC
	require.NoError(t, err)
	roundTrip(t, warm, []byte("awake"))
	warm.Close()
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	select {
	case s := <-ev:
		t.Fatalf("a wake event (slot %d) for an exposure not asleep", s)
	default:
	}

	if np.Hooks() == "tc" {
		// The tc programs see a caller's packet only once it leaves for
		// the guest, past the neighbour entry, which a sleeping guest
		// does not answer for (and which the bridge's carrier going down
		// flushes): brokkrd pins an asleep VM's entry (netplane
		// link.PinNeighbours); so does this test.
		f := strings.Fields(tp.guest.MustRun(t, "ip", "-o", "link", "show", "eth0"))
		mac := f[slices.Index(f, "link/ether")+1]
		tp.host.MustRun(t, "ip", "neigh", "replace", "10.213.0.11", "lladdr", mac, "nud", "permanent", "dev", "br0")
	}
	suspendGuest(t, tp.host, "g1p", true)
	require.NoError(t, w.Sleep(tp.slot.Index()))
	const callers = 3
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	for range callers {
		wg.Go(func() {
			var c net.Conn
			err := tp.client.Do(func() (err error) {
				c, err = net.DialTimeout("tcp4", "10.99.0.1:8080", 20*time.Second)
				return err
			})
			if err == nil {
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				if _, err = c.Write([]byte("woken")); err == nil {
					buf := make([]byte, 5)
					_, err = c.Read(buf)
				}
				c.Close()
			}
			errs <- err
		})
	}
	wakeAndResume(t, ev, w, tp.slot.Index(), func() {
		time.Sleep(300 * time.Millisecond) // a resume takes a while
		suspendGuest(t, tp.host, "g1p", false)
	})
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err, "a caller of the woken guest")
	}
	select {
	case s := <-ev:
		t.Fatalf("a second wake event (slot %d) for one wake", s)
	default:
	}
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 1+callers, c.Accepted)
	assert.Zero(t, c.Refused, "none refused")
	assert.Zero(t, c.Dropped, "the wait is not counted as dropped")

	// Awake: no event.
	d, err := dial(t, tp.client, "tcp4", "10.99.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, d, []byte("x"))
	d.Close()
	select {
	case s := <-ev:
		t.Fatalf("a wake event (slot %d) once awake", s)
	case <-time.After(200 * time.Millisecond):
	}
}

// The socket path: a host-local caller's connect to an asleep exposure
// sends the wake event and goes on to the guest; it completes once the
// guest is back.
func TestTheSocketPathAsksToWakeAndItsCallerGetsThrough(t *testing.T) {
	tp := newSockTopo(t, ProtoTCP, 0)
	lb := tp.load(t)
	defer lb.Close()
	require.NoError(t, lb.SetTarget(anyHost, ProtoTCP, 8080, SockTarget{Guest: guest("10.213.0.11:7000"), Slot: tp.slot.Index()}))
	w := openWake(t, tp.pins)
	// A Next whose context ends returns, and the next one waits afresh: a
	// daemon whose Run ends and starts again (a failed hand-over) keeps
	// its wake events.
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	_, err := w.Next(ctx)
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	ev := events(t, w)
	warm, err := dial(t, tp.host, "tcp4", "127.0.0.1:8080")
	require.NoError(t, err)
	roundTrip(t, warm, []byte("awake"))
	warm.Close()

	suspendGuest(t, tp.host, "g1p", true)
	require.NoError(t, w.Sleep(tp.slot.Index()))
	done := make(chan error, 1)
	go func() {
		var c net.Conn
		err := tp.host.Do(func() (err error) {
			c, err = net.DialTimeout("tcp4", "127.0.0.1:8080", 20*time.Second)
			return err
		})
		if err == nil {
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			if _, err = c.Write([]byte("woken")); err == nil {
				buf := make([]byte, 5)
				_, err = c.Read(buf)
			}
			c.Close()
		}
		done <- err
	}()
	wakeAndResume(t, ev, w, tp.slot.Index(), func() {
		time.Sleep(300 * time.Millisecond)
		suspendGuest(t, tp.host, "g1p", false)
	})
	require.NoError(t, <-done, "the caller of the woken guest")
	eventually(t, "active 0", func() bool { return tp.slot.Read().Active == 0 })
	c := tp.slot.Read()
	assert.EqualValues(t, 2, c.Accepted)
	assert.Zero(t, c.Refused)
	assert.Zero(t, c.Dropped)
}

// Sleep and Awake set a slot's flag; the maps are pinned and found again
// by a second open.
func TestWakeFlags(t *testing.T) {
	pins := nstest.PrivateBPFFS(t)
	w := openWake(t, pins)
	defer w.Close()
	require.NoError(t, w.Sleep(7))
	asleep, err := w.Asleep(7)
	require.NoError(t, err)
	assert.True(t, asleep)
	w2 := openWake(t, pins)
	defer w2.Close()
	asleep, err = w2.Asleep(7)
	require.NoError(t, err)
	assert.True(t, asleep, "the pinned map, found again")
	require.NoError(t, w2.Awake(7))
	asleep, _ = w.Asleep(7)
	assert.False(t, asleep)
	assert.Error(t, w.Sleep(Slots), "a slot out of range")
}
