// Command soak is brokkr's reliability harness (issue 10), run by
// tests/soak/soak.sh, which creates the namespaces, the private bpffs, the
// child cgroup and the stateDir tmpfs and removes them afterwards. As the
// driver it runs the phases and prints one measured figure per line
// ("figure NAME VALUE [UNIT]"); the subcommands `serve` and `load` run inside
// the namespaces as the guest's servers and the callers.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/tests/chfake"
)

const (
	hostNS   = "brk-soak-host"
	cliNS    = "brk-soak-cli"
	tgtNS    = "brk-soak-tgt"
	bridge   = "brk-soak0"
	hostIP   = "10.99.50.1"
	targetIP = "10.213.50.200"
	echoPort = 7000
)

func main() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "serve":
			serve(os.Args[2:])
			return
		case "load":
			loadClient(os.Args[2:])
			return
		}
	}
	os.Exit(drive())
}

// h is the driver's world.
type h struct {
	work, bin, cg   string
	state, run, bpf string
	cfgPath, sock   string
	log             *os.File
	daemon          *exec.Cmd
	done            chan struct{}
	deadline        time.Time
	failures        int
	client          *api.Client
	// qemu, once set (the qemu phase), makes the VMs real QEMU guests
	// booting this kernel and initramfs; before, they are fake
	// cloud-hypervisor VMs.
	qemu *guestImage
}

type guestImage struct{ kernel, initramfs string }

func (x *h) hvKind() string {
	if x.qemu != nil {
		return "qemu"
	}
	return "cloud-hypervisor"
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func drive() int {
	work := os.Getenv("SOAK_WORK")
	if work == "" {
		fmt.Fprintln(os.Stderr, "soak: run through tests/soak/soak.sh (SOAK_WORK unset)")
		return 2
	}
	x := &h{work: work, bin: filepath.Join(work, "bin"), cg: os.Getenv("SOAK_CGROUP"),
		state: filepath.Join(work, "state"), run: filepath.Join(work, "run"), bpf: filepath.Join(work, "bpf", "brokkr"),
		cfgPath: filepath.Join(work, "brokkr.yaml")}
	x.sock = filepath.Join(x.run, "brokkr.sock")
	x.client = api.NewClient(x.sock)
	x.deadline = time.Now().Add(time.Duration(envInt("SOAK_MINUTES", 20)) * time.Minute)
	var err error
	if x.log, err = os.Create(filepath.Join(work, "brokkrd.log")); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	phases := os.Getenv("SOAK_PHASES")
	if phases == "" {
		phases = "faults,load,disk,fuzz,perm,qemu"
	}
	x.figure("soak.start", time.Now().UTC().Format(time.RFC3339), fmt.Sprintf("kernel=%s cores=%d budget=%dmin", kernel(), nproc(), envInt("SOAK_MINUTES", 20)))
	if err := x.setup(); err != nil {
		x.fail("setup: %v", err)
		x.tail()
		return 1
	}
	for _, p := range strings.Split(phases, ",") {
		if time.Now().After(x.deadline) {
			// A phase not run proves nothing: the soak fails rather than
			// pass on what it did not do (SOAK_MINUTES for more time).
			x.figure("phase."+p, "skipped", "time budget spent")
			x.fail("phase %s skipped: the time budget (SOAK_MINUTES=%d) was spent before it", p, envInt("SOAK_MINUTES", 20))
			continue
		}
		t0 := time.Now()
		switch p {
		case "faults":
			x.faults()
		case "load":
			x.load()
		case "disk":
			x.diskFull()
		case "fuzz":
			x.fuzz()
		case "perm":
			x.perm()
		case "qemu":
			x.qemuFaults()
		default:
			x.fail("unknown phase %q", p)
		}
		x.figure("phase."+p+".seconds", fmt.Sprintf("%.0f", time.Since(t0).Seconds()), "s")
	}
	x.stopDaemon(syscall.SIGTERM)
	x.figure("soak.failures", strconv.Itoa(x.failures), "")
	if x.failures > 0 {
		x.tail()
		return 1
	}
	return 0
}

func kernel() string {
	b, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return strings.TrimSpace(string(b))
}

func nproc() int {
	out, _ := exec.Command("nproc").Output()
	n, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return n
}

// figure prints one measured figure per line.
func (x *h) figure(name, value, note string) {
	if note != "" {
		fmt.Printf("%-44s %s  (%s)\n", name, value, note)
	} else {
		fmt.Printf("%-44s %s\n", name, value)
	}
}

// check prints a figure that must equal want, and counts a failure if not.
func (x *h) check(name string, got, want int64, note string) {
	mark := ""
	if got != want {
		mark = fmt.Sprintf(" FAIL want %d", want)
		x.failures++
	}
	x.figure(name, strconv.FormatInt(got, 10)+mark, note)
}

func (x *h) fail(f string, a ...any) {
	x.failures++
	fmt.Printf("FAIL %s\n", fmt.Sprintf(f, a...))
}

func (x *h) tail() {
	out, _ := exec.Command("tail", "-n", "30", x.log.Name()).Output()
	fmt.Fprintf(os.Stderr, "--- brokkrd.log (last lines) ---\n%s", out)
}

// inNS runs a command in one of the soak's namespaces.
func inNS(ns string, args ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"--net=/run/netns/" + ns, "--"}, args...)...)
}

func runIn(ns string, args ...string) (string, error) {
	out, err := inNS(ns, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// setup writes the chfake wrapper and a dummy kernel, starts brokkrd on an
// empty desired state and puts the target namespace and its servers on
// brokkr's bridge.
func (x *h) setup() error {
	wd, _ := os.Getwd()
	spec, err := chfake.FindSpec(wd)
	if err != nil {
		return err
	}
	if err := chfake.WriteLauncher(filepath.Join(x.bin, "cloud-hypervisor"), filepath.Join(x.bin, "chfake"), spec); err != nil {
		return err
	}
	for _, f := range []string{"vmlinuz", "initramfs"} {
		if err := os.WriteFile(filepath.Join(x.work, f), []byte("not a kernel: the fake hypervisor never reads it\n"), 0o644); err != nil {
			return err
		}
	}
	if err := x.writeConfig(desired{}); err != nil {
		return err
	}
	if err := x.startDaemon(); err != nil {
		return err
	}
	if _, err := x.waitConverged(desired{}, 30*time.Second); err != nil {
		return err
	}
	cmds := [][]string{
		{"ip", "-n", hostNS, "link", "add", "brk-soak-g", "type", "veth", "peer", "name", "eth0", "netns", tgtNS},
		{"ip", "-n", hostNS, "link", "set", "brk-soak-g", "master", bridge, "up"},
		{"ip", "-n", tgtNS, "addr", "add", targetIP + "/24", "dev", "eth0"},
		{"ip", "-n", tgtNS, "link", "set", "eth0", "up"},
		{"ip", "-n", tgtNS, "route", "add", "default", "via", "10.213.50.1"},
	}
	for _, c := range cmds {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v %s", c, err, out)
		}
	}
	srv := inNS(tgtNS, filepath.Join(x.bin, "soak"), "serve", fmt.Sprintf("%s:%d", targetIP, echoPort))
	srv.Stderr = os.Stderr
	if err := srv.Start(); err != nil {
		return err
	}
	// The server is killed with the namespace by soak.sh's cleanup.
	time.Sleep(300 * time.Millisecond)
	return nil
}

func (x *h) startDaemon() error {
	cmd := inNS(hostNS, filepath.Join(x.bin, "brokkrd"), "--config", x.cfgPath)
	cmd.Env = append(os.Environ(), "BROKKR_CGROUP="+x.cg, "PATH="+x.bin+":"+os.Getenv("PATH"))
	cmd.Stdout, cmd.Stderr = x.log, x.log
	if err := cmd.Start(); err != nil {
		return err
	}
	x.daemon = cmd
	x.done = make(chan struct{})
	go func(c *exec.Cmd, d chan struct{}) { _ = c.Wait(); close(d) }(cmd, x.done)
	for i := 0; i < 300; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := x.client.Status(ctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-x.done:
			return fmt.Errorf("brokkrd exited at start (%v)", cmd.ProcessState)
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("brokkrd's socket did not answer within 30s")
}

// daemonPID is brokkrd's own pid (nsenter execs it, so it is the child's).
func (x *h) daemonPID() int { return x.daemon.Process.Pid }

func (x *h) stopDaemon(sig syscall.Signal) {
	if x.daemon == nil {
		return
	}
	_ = x.daemon.Process.Signal(sig)
	select {
	case <-x.done:
	case <-time.After(60 * time.Second):
		_ = x.daemon.Process.Kill()
		<-x.done
	}
	x.daemon = nil
	x.client.CloseIdle()
}

func (x *h) status() (*api.Status, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return x.client.Status(ctx)
}

func (x *h) metrics() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return x.client.Metrics(ctx)
}

// metric reads one unlabelled sample from /metrics.
func (x *h) metric(name string) (float64, error) {
	m, err := x.metrics()
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(strings.NewReader(m))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == name {
			return strconv.ParseFloat(f[1], 64)
		}
	}
	return 0, fmt.Errorf("%s not in /metrics", name)
}

func fdCount(pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return -1
	}
	return len(ents)
}

// bpfEntry is one slot of exposure_stats_v2 as bpftool prints it.
type bpfEntry struct {
	Name     string `json:"name"`
	Active   uint64 `json:"active"`
	Accepted uint64 `json:"accepted"`
	Refused  uint64 `json:"refused"`
	Dropped  uint64 `json:"dropped"`
	BytesIn  uint64 `json:"bytes_in"`
	BytesOut uint64 `json:"bytes_out"`
}

// bpftoolDump reads a pinned map with bpftool, as an operator would.
func bpftoolDump(path string) ([]json.RawMessage, error) {
	out, err := exec.Command("bpftool", "-j", "map", "dump", "pinned", path).Output()
	if err != nil {
		return nil, fmt.Errorf("bpftool map dump %s: %v", path, err)
	}
	var raw []json.RawMessage
	return raw, json.Unmarshal(out, &raw)
}

func (x *h) counters() (map[string]bpfEntry, error) {
	got := map[string]bpfEntry{}
	vals, err := bpftoolSlots(x.bpf)
	if err != nil {
		return nil, err
	}
	for _, v := range vals {
		var e bpfEntry
		if json.Unmarshal(v, &e) == nil && e.Name != "" {
			got[e.Name] = e
		}
	}
	return got, nil
}

// bpftoolSlots is bpftool's formatted exposure_stats_v2 entry of every
// occupied slot, by slot: `bpftool map lookup` of each, as an operator
// would for one exposure (the slots found with bpf.Dump: a dump of all
// 131,072 entries takes bpftool seconds).
func bpftoolSlots(bpfDir string) (map[uint32]json.RawMessage, error) {
	pin := filepath.Join(bpfDir, bpf.MapName)
	entries, err := bpf.Dump(pin)
	if err != nil {
		return nil, err
	}
	out := map[uint32]json.RawMessage{}
	for _, en := range entries {
		k := en.Slot
		raw, err := exec.Command("bpftool", "-j", "map", "lookup", "pinned", pin, "key",
			strconv.Itoa(k&0xff), strconv.Itoa(k>>8&0xff), strconv.Itoa(k>>16&0xff), "0").Output()
		if err != nil {
			return nil, fmt.Errorf("bpftool map lookup %s %d: %v", pin, k, err)
		}
		var w struct {
			Value     json.RawMessage `json:"value"`
			Formatted *struct {
				Value json.RawMessage `json:"value"`
			} `json:"formatted"`
		}
		if err := json.Unmarshal(raw, &w); err != nil {
			return nil, err
		}
		v := w.Value
		if w.Formatted != nil {
			v = w.Formatted.Value
		}
		out[uint32(k)] = v
	}
	return out, nil
}

func (x *h) natFlows() int {
	raw, err := bpftoolDump(filepath.Join(x.bpf, "nat_flows"))
	if err != nil {
		return -1
	}
	return len(raw)
}
