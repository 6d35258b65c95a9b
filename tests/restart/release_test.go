package restart

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The previous release, the one an upgrade test starts from: its tag, and
// the commit it names, for a checkout that has not fetched the tag. The
// next release moves both (README, "Versions and upgrades").
const (
	previousRelease       = "v0.19.0"
	previousReleaseCommit = "430c7657d10a8cab926505fa958ef61eed874369"
)

// releaseExposures: every path, capped at 2 where a cap applies, and a nat
// UDP exposure whose flows only the sweep can end.
const releaseExposures = `
stateDir: {{state}}
runDir: {{run}}
bpfDir: {{bpf}}
network:
  bridge: brk-rs0
  cidr: 10.213.9.1/24
hypervisor:
  kind: qemu
exposures:
  - {name: rl-nat, target: 10.213.9.200, guestPort: 7000, hostPort: 7200, mode: nat, maxConns: 2}
  - {name: rl-auto, target: 10.213.9.200, guestPort: 7000, hostPort: 7201, mode: auto, maxConns: 2}
  - {name: rl-proxy, target: 10.213.9.200, guestPort: 7000, hostPort: 7202, mode: proxy, maxConns: 2}
  - {name: rl-udp, target: 10.213.9.200, guestPort: 7001, hostPort: 7203, protocol: udp, mode: proxy}
  - {name: rl-nat-udp, target: 10.213.9.200, guestPort: 7001, hostPort: 7204, protocol: udp, mode: nat}
`

var previous struct {
	once sync.Once
	dir  string // what it was built in; TestMain removes it
	bin  string
	err  error
}

// previousBinary builds the previous release's brokkrd once per run: its
// tree (the tag if the checkout has it, else the commit) is exported with
// git archive into a temporary directory and built there, its modules from
// the module cache or proxy.
func previousBinary(t *testing.T) string {
	t.Helper()
	previous.once.Do(func() {
		rev := previousReleaseCommit
		if out, err := exec.Command("git", "rev-parse", "--verify", "-q", previousRelease+"^{commit}").Output(); err == nil {
			if got := strings.TrimSpace(string(out)); got != previousReleaseCommit {
				previous.err = fmt.Errorf("tag %s is %s, not the commit this test names (%s): update previousReleaseCommit", previousRelease, got, previousReleaseCommit)
				return
			}
			rev = previousRelease
		} else if err := exec.Command("git", "cat-file", "-e", previousReleaseCommit+"^{commit}").Run(); err != nil {
			previous.err = fmt.Errorf("neither tag %s nor commit %s is in this checkout (a shallow clone? git fetch --unshallow --tags)", previousRelease, previousReleaseCommit)
			return
		}
		dir, err := os.MkdirTemp("", "brk-release-")
		if err != nil {
			previous.err = err
			return
		}
		previous.dir = dir
		src := filepath.Join(dir, "src")
		if err := os.Mkdir(src, 0o755); err != nil {
			previous.err = err
			return
		}
		top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
		if err != nil {
			previous.err = fmt.Errorf("git rev-parse --show-toplevel: %w", err)
			return
		}
		archive := exec.Command("sh", "-c", `git archive "$0" | tar -x -C "$1"`, rev, src)
		archive.Dir = strings.TrimSpace(string(top))
		if out, err := archive.CombinedOutput(); err != nil {
			previous.err = fmt.Errorf("git archive %s: %v: %s", rev, err, out)
			return
		}
		bin := filepath.Join(dir, "brokkrd")
		build := exec.Command("go", "build", "-ldflags",
			"-X github.com/brokkr/brokkr/daemon/api.version="+previousRelease+" -X github.com/brokkr/brokkr/daemon/api.commit="+previousReleaseCommit[:12],
			"-o", bin, "./cmd/brokkrd")
		build.Dir = src
		build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly")
		if out, err := build.CombinedOutput(); err != nil {
			previous.err = fmt.Errorf("building %s: %v: %s", previousRelease, err, out)
			return
		}
		previous.bin = bin
	})
	require.NoError(t, previous.err)
	return previous.bin
}

// bpfProgs is what bpftool says about the programs behind the rig's pinned
// links: the program ID attached to each link, by pin name.
func (r *rig) linkProgs() map[string]uint32 {
	r.t.Helper()
	pins, err := filepath.Glob(filepath.Join(r.bpfDir, "*_link"))
	require.NoError(r.t, err)
	require.NotEmpty(r.t, pins, "the daemon pinned its links under bpfDir")
	out := map[string]uint32{}
	for _, p := range pins {
		b, err := exec.Command("bpftool", "-j", "link", "show", "pinned", p).Output()
		require.NoError(r.t, err, "bpftool link show pinned %s", p)
		var l struct {
			ProgID uint32 `json:"prog_id"`
		}
		require.NoError(r.t, json.Unmarshal(b, &l))
		out[filepath.Base(p)] = l.ProgID
	}
	return out
}

// pinned reports whether name is pinned in bpfDir.
func pinned(bpfDir, name string) bool {
	_, err := os.Lstat(filepath.Join(bpfDir, name))
	return err == nil
}

// progLoaded asks bpftool whether the kernel still holds program id.
func progLoaded(id uint32) bool {
	return exec.Command("bpftool", "prog", "show", "id", fmt.Sprint(id)).Run() == nil
}

// sweeps is how often the nat path's sweep has run (the pinned nat_sweep
// map, as bpftool dumps it).
func (r *rig) sweeps() uint64 {
	r.t.Helper()
	b, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", filepath.Join(r.bpfDir, "nat_sweep")).Output()
	require.NoError(r.t, err)
	var d []struct {
		Formatted struct {
			Value struct {
				Sweeps uint64 `json:"sweeps"`
			} `json:"value"`
		} `json:"formatted"`
	}
	require.NoError(r.t, json.Unmarshal(b, &d))
	require.Len(r.t, d, 1)
	return d[0].Formatted.Value.Sweeps
}

// counts is the status's counters of every exposure, by name.
func (r *rig) statusCounts() (map[string]api.Exposure, *api.Status) {
	r.t.Helper()
	st, err := api.NewClient(r.sock).Status(context.Background())
	require.NoError(r.t, err)
	out := map[string]api.Exposure{}
	for _, e := range st.Exposures {
		out[e.Name] = e
	}
	return out, st
}

// want is what one exposure's counters must read.
type want struct{ active, accepted, refused, in, out uint64 }

func (r *rig) requireCounts(what string, w map[string]want) {
	r.t.Helper()
	var got map[string]api.Exposure
	ok := func() bool {
		got, _ = r.statusCounts()
		for name, x := range w {
			g := got[name]
			if g.Active != x.active || g.Accepted != x.accepted || g.Refused != x.refused || g.BytesIn != x.in || g.BytesOut != x.out || g.Dropped != 0 {
				return false
			}
		}
		return true
	}
	// Open kernel flows' bytes reach their slots at the next sweep (2 s).
	deadline := time.Now().Add(8 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			var b strings.Builder
			for name, x := range w {
				g := got[name]
				fmt.Fprintf(&b, "%s: got active %d accepted %d refused %d dropped %d in %d out %d, want %+v\n",
					name, g.Active, g.Accepted, g.Refused, g.Dropped, g.BytesIn, g.BytesOut, x)
			}
			r.t.Fatalf("%s: the counters are not exact:\n%s", what, b.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// releaseFlows are the flows an upgrade test holds open across the hand-over,
// and what the counters must read given what the callers did.
type releaseFlows struct {
	nat, auto, proxy []conn
	udp, natUDP      *net.UDPConn
	local            *caller
	want             map[string]*want
	autoBytes        uint64 // echoed on the socket path's held connections since "hold"
	// answer is the length of the guest's UDP answer on each UDP flow:
	// "<port>:" and the 3 bytes asked, the port being the flow's own.
	answer map[string]uint64
}

// openFlows fills every capped exposure to its cap and opens a UDP flow on
// each UDP exposure.
func (r *rig) openFlows() *releaseFlows {
	t := r.t
	f := &releaseFlows{local: r.startCaller(r.cgroup), answer: map[string]uint64{}, want: map[string]*want{}}
	for _, name := range []string{"rl-nat", "rl-auto", "rl-proxy", "rl-udp", "rl-nat-udp"} {
		f.want[name] = &want{}
	}
	for i := 0; i < 2; i++ {
		f.nat = append(f.nat, r.holdIn("192.0.2.1:7200"))
		f.auto = append(f.auto, f.local.hold("127.0.0.1:7201"))
		f.proxy = append(f.proxy, r.holdIn("192.0.2.1:7202"))
	}
	for _, name := range []string{"rl-nat", "rl-proxy"} {
		*f.want[name] = want{active: 2, accepted: 2, in: 8, out: 8} // "hold" each way, twice
	}
	// Socket-path TCP bytes are counted when a connection ends.
	*f.want["rl-auto"] = want{active: 2, accepted: 2}
	for _, u := range []struct {
		name string
		to   **net.UDPConn
		at   string
	}{{"rl-udp", &f.udp, "192.0.2.1:7203"}, {"rl-nat-udp", &f.natUDP, "192.0.2.1:7204"}} {
		require.NoError(t, r.client.Do(func() error {
			c, err := net.Dial("udp4", u.at)
			if err == nil {
				*u.to = c.(*net.UDPConn)
			}
			return err
		}))
		t.Cleanup(func() { (*u.to).Close() })
		*f.want[u.name] = want{active: 1, accepted: 1}
	}
	f.askUDP(t)
	return f
}

// askUDP asks once on each UDP flow and checks the flow is the one it was
// (the same guest-side port, so the same answer length).
func (f *releaseFlows) askUDP(t *testing.T) {
	t.Helper()
	for name, u := range map[string]*net.UDPConn{"rl-udp": f.udp, "rl-nat-udp": f.natUDP} {
		got, err := udpAsk(u, "ask")
		require.NoError(t, err, name)
		require.True(t, strings.HasSuffix(got, ":ask"), "%s: %q", name, got)
		if n, ok := f.answer[name]; ok {
			require.Equal(t, n, uint64(len(got)), "%s: the same flow (its guest-side port) all along", name)
		}
		f.answer[name] = uint64(len(got))
		f.want[name].in += 3
		f.want[name].out += uint64(len(got))
	}
}

// echoAll echoes "go" on every held TCP connection.
func (f *releaseFlows) echoAll(t *testing.T) {
	t.Helper()
	for _, c := range append(append(f.nat, f.auto...), f.proxy...) {
		c.echo(t, "go")
	}
	for _, name := range []string{"rl-nat", "rl-proxy"} {
		f.want[name].in += 4
		f.want[name].out += 4
	}
	f.autoBytes += 4
}

// probe checks that one more caller is refused on every capped path.
func (f *releaseFlows) probe(t *testing.T, r *rig, when string) {
	t.Helper()
	assert.True(t, r.probeIn("192.0.2.1:7200"), "nat: the cap holds %s", when)
	assert.True(t, f.local.probe("127.0.0.1:7201"), "auto: the cap holds %s", when)
	assert.True(t, r.probeIn("192.0.2.1:7202"), "proxy: the cap holds %s", when)
	for _, name := range []string{"rl-nat", "rl-auto", "rl-proxy"} {
		f.want[name].refused++
	}
}

// closeTCP closes every held TCP connection: their places are given back,
// and the socket path counts their bytes ("hold" and each echo).
func (f *releaseFlows) closeTCP(t *testing.T) {
	t.Helper()
	for _, c := range append(append(f.nat, f.auto...), f.proxy...) {
		c.close(t)
	}
	for _, name := range []string{"rl-nat", "rl-auto", "rl-proxy"} {
		f.want[name].active = 0
	}
	f.want["rl-auto"].in += 8 + f.autoBytes
	f.want["rl-auto"].out += 8 + f.autoBytes
}

func (f *releaseFlows) exact(r *rig, what string) {
	r.t.Helper()
	w := map[string]want{}
	for name, x := range f.want {
		w[name] = *x
	}
	r.requireCounts(what, w)
}

// An upgrade from the previous release hands over with flows open on every
// path: afterwards the tree's programs run, the sweep included (the
// previous release's programs are no longer loaded: a bpf_timer holding one
// keeps it loaded), the flows go on, the caps hold with the places they
// had, and every counter is exact.
func TestUpgradeFromThePreviousRelease(t *testing.T) {
	r := newRig(t, releaseExposures) // skips without root
	old := previousBinary(t)
	r.binA = buildDaemon(t, filepath.Join(r.dir, "tree"), "tree")
	r.start(old)
	r.startGuest()
	_, st := r.statusCounts()
	require.Equal(t, previousRelease, st.Daemon.Version, "the previous release runs first")

	f := r.openFlows()
	f.probe(t, r, "before the upgrade")
	f.exact(r, "before the upgrade")
	before := r.linkProgs()

	r.upgrade(r.binA)
	_, st = r.statusCounts()
	require.Equal(t, "tree", st.Daemon.Version, "the tree's brokkrd runs")
	for _, w := range st.Warnings {
		assert.NotContains(t, w, "nat path", "the tree's nat path programs loaded")
	}
	f.exact(r, "right after the hand-over")

	// Every program of the previous release is attached still (the same
	// program, unchanged) or gone from the kernel: none is held by
	// anything else, such as the sweep's timer.
	after := r.linkProgs()
	attached := map[uint32]bool{}
	for _, id := range after {
		attached[id] = true
	}
	changed := 0
	for pin, id := range before {
		if attached[id] {
			continue
		}
		changed++
		require.Eventually(t, func() bool { return !progLoaded(id) }, 10*time.Second, 50*time.Millisecond,
			"%s's program %d of %s is still loaded after the upgrade", pin, id, previousRelease)
	}
	t.Logf("%d of %d programs replaced by the upgrade: before %v, after %v", changed, len(before), before, after)
	s := r.sweeps()
	require.Eventually(t, func() bool { return r.sweeps() > s }, 10*time.Second, 100*time.Millisecond, "the sweep runs after the upgrade")
	// The previous release's counter maps (exposure_stats, 16,384 slots)
	// were copied into the v2 ones and, no program of it left, unpinned.
	require.Eventually(t, func() bool { return !pinned(r.bpfDir, bpf.V1MapName) }, 10*time.Second, 100*time.Millisecond,
		"the v1 counter map is unpinned once nothing writes it")
	for _, p := range []string{"exposure_limits", "exposure_denied", "exposure_wake", bpf.MigrationMapName} {
		assert.False(t, pinned(r.bpfDir, p), "%s unpinned", p)
	}
	require.True(t, pinned(r.bpfDir, bpf.MapName))
	require.Eventually(t, func() bool {
		_, st := r.statusCounts()
		return !strings.Contains(strings.Join(st.Warnings, "\n"), bpf.V1MapName+" maps are still written")
	}, 10*time.Second, 100*time.Millisecond, "status no longer says the v1 maps are written")

	// The flows carry on, the caps hold with the places they had.
	f.echoAll(t)
	f.askUDP(t)
	f.probe(t, r, "after the upgrade")
	f.exact(r, "after the upgrade, the flows used")

	// Closed, every place is given back; conntrack forgetting the nat UDP
	// flow is for the sweep to notice (the new sweep's).
	f.closeTCP(t)
	r.host.MustRun(t, "conntrack", "-D", "-p", "udp", "--orig-port-dst", "7204")
	f.want["rl-nat-udp"].active = 0
	f.exact(r, "after closing every flow")
}

// An upgrade to a binary whose nat path programs cannot load (here the
// pinned nat_flows replaced by a map of another layout, as a changed map
// would be) keeps the previous release's programs serving: the same
// programs stay attached, status says why, and the counters stay exact —
// nothing counted into another exposure's slot, as the fallback's marks
// read by the old programs would be.
func TestAnUpgradeWhoseProgramsCannotLoadKeepsTheOldOnesServing(t *testing.T) {
	r := newRig(t, releaseExposures) // skips without root
	old := previousBinary(t)
	r.binA = buildDaemon(t, filepath.Join(r.dir, "tree"), "tree")
	r.start(old)
	r.startGuest()
	f := r.openFlows()
	f.probe(t, r, "before the upgrade")
	before := r.linkProgs()

	pin := filepath.Join(r.bpfDir, "nat_flows")
	require.NoError(t, os.Remove(pin))
	out, err := exec.Command("bpftool", "map", "create", pin, "type", "hash", "key", "8", "value", "8", "entries", "16", "name", "nat_flows").CombinedOutput()
	require.NoError(t, err, "bpftool map create: %s", out)

	r.upgrade(r.binA)
	_, st := r.statusCounts()
	require.Equal(t, "tree", st.Daemon.Version)
	assert.Contains(t, strings.Join(st.Warnings, "\n"), "programs did not load", "status says the nat path runs the earlier programs")
	after := r.linkProgs()
	for _, p := range []string{"nat_pre_link", "nat_out_link", "nat_reflect_link"} {
		assert.Equal(t, before[p], after[p], "%s: the previous release's program still attached", p)
	}

	// The previous release's programs still count into its exposure_stats:
	// the migration stays open, its counts carried over.
	assert.True(t, pinned(r.bpfDir, bpf.V1MapName), "the v1 counter map stays while its programs serve")
	assert.True(t, pinned(r.bpfDir, bpf.MigrationMapName))
	assert.Contains(t, strings.Join(st.Warnings, "\n"), bpf.V1MapName+" maps are still written", "status says the v1 maps are carried over")

	f.echoAll(t)
	f.askUDP(t)
	f.probe(t, r, "after the failed load")
	f.exact(r, "after the failed load")
	f.closeTCP(t)
	f.exact(r, "flows closed under the earlier programs")
	c := r.holdIn("192.0.2.1:7200")
	c.close(t)
	f.want["rl-nat"].accepted++
	f.want["rl-nat"].in += 4
	f.want["rl-nat"].out += 4
	f.exact(r, "a new nat caller under the earlier programs")
}

// removePrevious removes what previousBinary built, if it ran.
func removePrevious() {
	if previous.dir != "" {
		os.RemoveAll(previous.dir)
	}
}
