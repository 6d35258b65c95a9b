package daemon

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/supervisor"
)

// The board holds callers of a VM from its suspend to its run, routes one
// wake however many callers come (again only after wakeAgain), and lets
// them go when the VM runs (or gives up: stopped).
func TestWakesHoldRouteAndRelease(t *testing.T) {
	w := NewWakes()
	var mu sync.Mutex
	routed := map[string]int{}
	assert.Nil(t, w.Wake("web"), "an awake VM is not held")

	w.Phase("web", supervisor.PhaseRunning)
	assert.Nil(t, w.Wake("web"))
	w.Phase("web", supervisor.PhaseSuspending)
	early := w.Wake("web") // before the daemon set its route
	require.NotNil(t, early)
	w.Phase("web", supervisor.PhaseSuspended)
	assert.Equal(t, early, w.Wake("web"), "one sleeper from suspending to resuming")
	w.Route(func(vm string) {
		mu.Lock()
		routed[vm]++
		mu.Unlock()
	})
	for range 20 {
		require.Equal(t, early, w.Wake("web"))
	}
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return routed["web"]
	}
	require.Eventually(t, func() bool { return count() == 1 }, 5*time.Second, 5*time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, 1, count(), "one wake for all callers")
	assert.True(t, w.Asleep("web"))

	w.Phase("web", supervisor.PhaseResuming)
	select {
	case <-early:
		t.Fatal("released before the VM runs")
	default:
	}
	w.Phase("web", supervisor.PhaseRunning)
	select {
	case <-early:
	default:
		t.Fatal("not released when the VM runs")
	}
	assert.Nil(t, w.Wake("web"))
	assert.False(t, w.Asleep("web"))

	w.Phase("db", supervisor.PhaseSuspended)
	held := w.Wake("db")
	w.Phase("db", supervisor.PhaseStopped)
	select {
	case <-held:
	default:
		t.Fatal("a VM that is stopped instead releases its callers (their dial fails)")
	}
}

func TestMarkAsleep(t *testing.T) {
	st := api.Status{
		VMs: []api.VM{{Name: "a", Phase: supervisor.PhaseSuspended}, {Name: "b", Phase: supervisor.PhaseRunning}},
		Exposures: []api.Exposure{
			{Name: "a-http", VM: "a", State: "active"},
			{Name: "a-warn", VM: "a", State: "active", Reason: "proxy: out of descriptors"},
			{Name: "a-bad", VM: "a", State: "failed", Reason: "nat: bind"},
			{Name: "b-http", VM: "b", State: "active"},
			{Name: "ext", Target: "10.213.0.9", State: "active"},
		},
	}
	markAsleep(&st)
	assert.Equal(t, "suspended: wakes on first caller", st.Exposures[0].Reason)
	assert.Equal(t, "suspended: wakes on first caller; proxy: out of descriptors", st.Exposures[1].Reason)
	assert.Equal(t, "nat: bind", st.Exposures[2].Reason, "a failed exposure keeps its reason")
	assert.Empty(t, st.Exposures[3].Reason)
	assert.Empty(t, st.Exposures[4].Reason)
}

// A caller's wake of a VM whose desired power is suspended makes it running
// (persisted) and tells the supervisor it is a wake, before the spec that
// resumes it (or the resume goes uncounted); one whose idleSuspend
// suspended it (desired running) only goes to the supervisor.
func TestWakeVMRoutesByDesiredPower(t *testing.T) {
	r := newRig(t, rigConfig)
	require.NoError(t, r.d.SetPower("db", spec.PowerSuspended))
	var powerAtWake []string
	r.sup.onWake = func(vm string) { powerAtWake = append(powerAtWake, vm+" "+string(r.d.Desired().VMs[1].Power)) }
	r.d.WakeVM("db")
	assert.Equal(t, []string{"db suspended"}, powerAtWake, "the wake reaches the supervisor before the spec that acts on it")
	assert.Equal(t, "running", r.d.Desired().VMs[1].Power, "woken: desired running")
	b, err := os.ReadFile(filepath.Join(r.host.StateDir, DesiredFile))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"power": "running"`)
	r.d.WakeVM("web")
	r.d.WakeVM("ghost")
	var wakes []string
	for _, c := range r.calls.get() {
		if strings.HasPrefix(c, "supervisor.Wake") {
			wakes = append(wakes, c)
		}
	}
	assert.Equal(t, []string{"supervisor.Wake db", "supervisor.Wake web"}, wakes)
}

// idleSuspend's traffic is the sum of the VM's exposures' slots.
func TestVMTrafficSumsTheVMsSlots(t *testing.T) {
	r := newRig(t, rigConfig)
	for name, n := range map[string]uint64{"web-auto": 1, "web-nat": 2, "lo-auto": 7, "ext": 9} {
		sl, err := r.store.Attach(name, 6, 1)
		require.NoError(t, err)
		sl.AddAccepted(n)
		require.True(t, sl.Reserve()) // one connection open on each
	}
	tr, ok := r.d.VMTraffic("web")
	require.True(t, ok)
	assert.Equal(t, supervisor.Traffic{Active: 2, Accepted: 3}, tr, "web-auto and web-nat")
	tr, _ = r.d.VMTraffic("db")
	assert.Equal(t, supervisor.Traffic{Active: 1, Accepted: 7}, tr)
}

// Every VM has its brokkr_vm_resume_seconds series from the start; a wake
// observed shows in it.
func TestResumeSecondsPerVM(t *testing.T) {
	r := newRig(t, rigConfig)
	r.d.Pass(context.Background())
	r.d.ObserveResume("web", 800*time.Millisecond)
	text := scrape(t, r)
	assert.Contains(t, text, `brokkr_vm_resume_seconds_count{vm="web"} 1`)
	assert.Contains(t, text, `brokkr_vm_resume_seconds_bucket{vm="web",le="0.75"} 0`)
	assert.Contains(t, text, `brokkr_vm_resume_seconds_bucket{vm="web",le="1"} 1`)
	assert.Contains(t, text, `brokkr_vm_resume_seconds_count{vm="db"} 0`)
	assert.Contains(t, text, `brokkr_vm_wakes_total{vm="db"} 0`)
}

// The kernel paths' flags follow the board: set for the VM's nat and
// socket-path exposures while it sleeps (not for a proxy-only one, not for
// another VM's), cleared when it runs, and re-armed once a wake asked has
// stood for wakeAgain.
func TestKernelWakeFlagsFollowTheBoard(t *testing.T) {
	pins := nstest.PrivateBPFFS(t)
	kw, err := bpf.OpenWake(pins)
	require.NoError(t, err)
	defer kw.Close()
	r := newRig(t, rigConfig)
	slots := map[string]int{}
	for _, e := range []string{"web-auto", "web-nat", "web-proxy", "lo-auto"} {
		sl, err := r.store.Attach(e, 6, 1)
		require.NoError(t, err)
		slots[e] = sl.Index()
	}
	board := NewWakes()
	k := newKernelWakes(r.d, kw, board)
	require.NotNil(t, k)
	flags := func() map[string]bool {
		out := map[string]bool{}
		for e, s := range slots {
			v, err := kw.Asleep(s)
			require.NoError(t, err)
			out[e] = v
		}
		return out
	}
	board.Phase("web", supervisor.PhaseSuspending)
	assert.Equal(t, map[string]bool{"web-auto": true, "web-nat": true, "web-proxy": false, "lo-auto": false}, flags())
	board.Phase("web", supervisor.PhaseSuspended)
	board.Phase("web", supervisor.PhaseRunning)
	assert.Equal(t, map[string]bool{"web-auto": false, "web-nat": false, "web-proxy": false, "lo-auto": false}, flags())
	board.Phase("db", supervisor.PhaseSuspended)
	assert.True(t, flags()["lo-auto"])
	// A pass re-writes nothing that is right, and puts back what is not.
	require.NoError(t, kw.Awake(slots["lo-auto"]))
	k.mu.Lock()
	delete(k.set, slots["lo-auto"])
	k.mu.Unlock()
	k.sync()
	assert.True(t, flags()["lo-auto"])
}

// `brokkr vm resume` is a wake too, and goes to the supervisor before its
// spec for the same reason; an unknown VM is refused before either.
func TestVMResumeWakesBeforeItsSpec(t *testing.T) {
	r := newRig(t, rigConfig)
	require.NoError(t, r.d.suspendAction("db", "suspend"))
	var powerAtWake []string
	r.sup.onWake = func(vm string) { powerAtWake = append(powerAtWake, vm+" "+string(r.d.Desired().VMs[1].Power)) }
	require.NoError(t, r.d.suspendAction("db", "resume"))
	assert.Equal(t, []string{"db suspended"}, powerAtWake)
	assert.Equal(t, "running", r.d.Desired().VMs[1].Power)
	assert.ErrorIs(t, r.d.suspendAction("ghost", "resume"), ErrNoSuchVM)
	assert.Len(t, powerAtWake, 1, "no wake for a VM that is not there")
}
