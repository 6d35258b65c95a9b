package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// baseline is what the daemon holds with no connection open.
type baseline struct {
	fds, goroutines, flows int
	active                 uint64
}

func (x *h) measure(names []string) (baseline, error) {
	g, err := x.metric("go_goroutines")
	if err != nil {
		return baseline{}, err
	}
	c, err := x.counters()
	if err != nil {
		return baseline{}, err
	}
	var a uint64
	for _, n := range names {
		a += c[n].Active
	}
	return baseline{fds: fdCount(x.daemonPID()), goroutines: int(g), flows: x.natFlows(), active: a}, nil
}

type caller struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

func (x *h) startCaller(cmd *exec.Cmd) (*caller, error) {
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &caller{cmd: cmd, in: in, out: bufio.NewReaderSize(out, 1<<20)}, nil
}

func (c *caller) held() (int, error) {
	l, err := c.out.ReadString('\n')
	if err != nil {
		return 0, fmt.Errorf("caller: %v (%q)", err, l)
	}
	return strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(l, "held ")))
}

func (c *caller) release() ([]tally, error) {
	c.in.Close()
	b, _ := io.ReadAll(c.out)
	_ = c.cmd.Wait()
	var t []tally
	return t, json.Unmarshal(b, &t)
}

// load holds SOAK_CONNS connections at once, in SOAK_WAVES waves, over
// capped exposures on every path: nat (from the client namespace), auto's
// socket path (a caller on the host itself, in the soak's child cgroup) and
// the proxy; each exposure is offered 10% more callers than its cap.
func (x *h) load() {
	total := envInt("SOAK_CONNS", 10000)
	waves := envInt("SOAK_WAVES", 3)
	hold := time.Duration(envInt("SOAK_HOLD_SECONDS", 15)) * time.Second
	type path struct {
		mode  string
		share float64
		port  int
	}
	paths := []path{{"nat", 0.5, 19100}, {"auto", 0.25, 19110}, {"proxy", 0.25, 19120}}
	d := desired{Exposures: append([]expo(nil), stableExposures...)}
	var names []string
	for _, p := range paths {
		c := int(float64(total)*p.share) / 2
		for i := 0; i < 2; i++ {
			e := expo{Name: fmt.Sprintf("load-%s-%d", p.mode, i), Mode: p.mode, Port: p.port + i, Cap: c}
			d.Exposures = append(d.Exposures, e)
			names = append(names, e.Name)
		}
	}
	if _, err := x.apply(d, 60*time.Second); err != nil {
		x.fail("load: apply: %v", err)
		return
	}
	if _, err := x.waitConverged(d, 60*time.Second); err != nil {
		x.fail("load: %v", err)
		return
	}
	time.Sleep(time.Second)
	base, err := x.measure(names)
	if err != nil {
		x.fail("load: %v", err)
		return
	}
	x.figure("load.baseline", fmt.Sprintf("fds=%d goroutines=%d nat_flows=%d active=%d", base.fds, base.goroutines, base.flows, base.active), fdKinds(x.daemonPID()))
	var nofile syscallRlimit
	nofile.get()
	x.figure("load.rlimit_nofile", strconv.FormatUint(nofile.cur, 10), "of the soak, brokkrd and its callers")
	before, _ := x.counters()
	sum := map[string]*tally{}
	peakHeld, peakFds, peakG, peakFlows := 0, 0, 0, 0
	var holdActiveOff int64
	for w := 1; w <= waves; w++ {
		if time.Until(x.deadline) <= 2*time.Minute {
			// Waves not run are checks not made: a failure, not a pass.
			x.fail("load: %d of %d waves skipped: the time budget was spent", waves-w+1, waves)
			break
		}
		var cliSpec, hostSpec []string
		for _, e := range d.Exposures[len(stableExposures):] {
			spec := fmt.Sprintf("%s:%d=%d", hostIP, e.Port, e.Cap+e.Cap/10)
			if e.Mode == "auto" {
				hostSpec = append(hostSpec, fmt.Sprintf("127.0.0.1:%d=%d", e.Port, e.Cap+e.Cap/10))
			} else {
				cliSpec = append(cliSpec, spec)
			}
		}
		bin := filepath.Join(x.bin, "soak")
		hs := fmt.Sprintf("%ds", int(hold.Seconds())*4)
		cli, err := x.startCaller(inNS(cliNS, bin, "load", "hold", "-hold", hs, strings.Join(cliSpec, ",")))
		if err != nil {
			x.fail("load: %v", err)
			return
		}
		// The host's own caller joins the soak's child cgroup, where
		// brokkrd attached the socket path, before it execs.
		host, err := x.startCaller(inNS(hostNS, "sh", "-c", `echo $$ > "$0/cgroup.procs" && shift && exec "$@"`, x.cg, "x",
			bin, "load", "hold", "-hold", hs, strings.Join(hostSpec, ",")))
		if err != nil {
			x.fail("load: %v", err)
			return
		}
		n1, e1 := cli.held()
		n2, e2 := host.held()
		if e1 != nil || e2 != nil {
			x.fail("load: wave %d: %v %v", w, e1, e2)
			return
		}
		held := n1 + n2
		peakHeld = max(peakHeld, held)
		during, err := x.measure(names)
		if err == nil {
			peakFds, peakG, peakFlows = max(peakFds, during.fds), max(peakG, during.goroutines), max(peakFlows, during.flows)
			holdActiveOff += int64(during.active) - int64(held)
		}
		time.Sleep(hold)
		t1, e1 := cli.release()
		t2, e2 := host.release()
		if e1 != nil || e2 != nil {
			x.fail("load: wave %d: results: %v %v", w, e1, e2)
			return
		}
		for _, t := range append(t1, t2...) {
			s := sum[t.Addr]
			if s == nil {
				s = &tally{Addr: t.Addr}
				sum[t.Addr] = s
			}
			s.OK += t.OK
			s.Refused += t.Refused
			s.Errors += t.Errors
			s.BytesIn += t.BytesIn
			s.BytesOut += t.BytesOut
			s.RefusedLate += t.RefusedLate
			if t.LastRefusal != "" {
				s.LastRefusal = t.LastRefusal
			}
			if t.LastErr != "" {
				s.LastErr = t.LastErr
			}
		}
		x.figure(fmt.Sprintf("load.wave%d.held", w), strconv.Itoa(held), fmt.Sprintf("of %d offered; daemon fds %d, goroutines %d, nat_flows %d during the hold", offered(d), during.fds, during.goroutines, during.flows))
	}
	x.figure("load.connections.held.peak", strconv.Itoa(peakHeld), fmt.Sprintf("at once, SOAK_CONNS=%d", total))
	x.check("load.active_minus_held.during", holdActiveOff, 0, "exposure_stats_v2 active against the callers' open connections, summed over waves")
	// Back to baseline: wait for the kernel to release the last places.
	var after baseline
	// nat_flows entries of flows closed by FIN or RST go at once; others
	// when conntrack forgets them (its timeouts reach 120 s), so wait that long.
	t0 := time.Now()
	end := t0.Add(150 * time.Second)
	// The kernel's part (nat_flows, active) is timed on its own: the
	// daemon's fds and goroutines may keep the whole from the baseline.
	kernelBack := -1.0
	for {
		after, err = x.measure(names)
		if err == nil && kernelBack < 0 && after.flows == base.flows && after.active == base.active {
			kernelBack = time.Since(t0).Seconds()
		}
		if err == nil && after == base || time.Now().After(end) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	x.figure("load.after.seconds_to_baseline", fmt.Sprintf("%.1f", time.Since(t0).Seconds()), "s, after the last wave closed")
	if kernelBack >= 0 {
		x.figure("load.after.nat_flows_seconds_to_baseline", fmt.Sprintf("%.1f", kernelBack), "s until nat_flows and active were at the baseline")
	} else {
		x.figure("load.after.nat_flows_seconds_to_baseline", "never", fmt.Sprintf("within %.0f s", time.Since(t0).Seconds()))
	}
	if after.flows != base.flows {
		kinds, detail := x.natFlowsLeft()
		x.figure("load.after.nat_flows_left", kinds, detail)
	}
	if after.fds != base.fds {
		x.figure("load.after.fd_kinds", fdKinds(x.daemonPID()), "")
	}
	x.check("load.after.fds_minus_baseline", int64(after.fds-base.fds), 0, fmt.Sprintf("/proc/PID/fd of brokkrd, peak %d", peakFds))
	x.check("load.after.goroutines_minus_baseline", int64(after.goroutines-base.goroutines), 0, fmt.Sprintf("go_goroutines, peak %d", peakG))
	x.check("load.after.nat_flows_minus_baseline", int64(after.flows-base.flows), 0, fmt.Sprintf("entries of nat_flows, peak %d", peakFlows))
	x.check("load.after.active", int64(after.active), 0, "sum of active over the load exposures")
	c, err := x.counters()
	if err != nil {
		x.fail("load: %v", err)
		return
	}
	var socketDropped int64
	for _, e := range d.Exposures[len(stableExposures):] {
		// Each gauge on its own: a gauge below zero would hide in the sum.
		x.check("load."+e.Name+".active_after", int64(c[e.Name].Active), 0, "")
		addr := fmt.Sprintf("%s:%d", hostIP, e.Port)
		if e.Mode == "auto" {
			addr = fmt.Sprintf("127.0.0.1:%d", e.Port)
		}
		t := sum[addr]
		if t == nil {
			x.fail("load: %s: no caller tallies for %s", e.Name, addr)
			continue
		}
		a, b := c[e.Name], before[e.Name]
		p := "load." + e.Name
		x.figure(p+".client", fmt.Sprintf("ok=%d refused=%d (after connect %d) errors=%d", t.OK, t.Refused, t.RefusedLate, t.Errors), strings.TrimSpace(t.LastErr+" "+t.LastRefusal))
		// A dropped caller (admitted, not carried) sees a refusal too, so the
		// client's view is: ok = accepted - dropped, refused = refused + dropped.
		dr := int64(a.Dropped - b.Dropped)
		x.check(p+".accepted_minus_dropped_minus_client", int64(a.Accepted-b.Accepted)-dr-t.OK, 0, "")
		x.check(p+".refused_plus_dropped_minus_client", int64(a.Refused-b.Refused)+dr-t.Refused, 0, "")
		x.check(p+".bytes_in_minus_client", int64(a.BytesIn-b.BytesIn)-t.BytesIn, 0, "")
		x.check(p+".bytes_out_minus_client", int64(a.BytesOut-b.BytesOut)-t.BytesOut, 0, "")
		x.check(p+".dropped", dr, 0, "admitted but not carried to a live guest under its cap")
		x.check(p+".client_errors", t.Errors, 0, "neither carried nor refused")
		if e.Mode == "auto" {
			socketDropped += dr
		}
	}
	// A figure, not a check: each exposure's dropped is checked above.
	x.figure("load.socket_path.dropped", strconv.FormatInt(socketDropped, 10), "auto exposures' host callers admitted and then refused at connect, against a live guest")
}

func offered(d desired) int {
	n := 0
	for _, e := range d.Exposures[len(stableExposures):] {
		n += e.Cap + e.Cap/10
	}
	return n
}

// fdKinds summarises a process's descriptors by what they point at.
func fdKinds(pid int) string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, _ := os.ReadDir(dir)
	k := map[string]int{}
	for _, e := range ents {
		l, _ := os.Readlink(filepath.Join(dir, e.Name()))
		if i := strings.IndexAny(l, ":["); i > 0 {
			l = l[:i]
		}
		k[l]++
	}
	return fmt.Sprint(k)
}
