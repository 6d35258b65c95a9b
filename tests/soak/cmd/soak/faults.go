package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
)

var stableExposures = []expo{
	{Name: "stable-nat", Mode: "nat", Port: 19000, Cap: 0},
	{Name: "stable-capped", Mode: "nat", Port: 19001, Cap: 64},
}

// randomDesired is the two stable exposures (which carry a trickle of calls
// through every kill, so counters can be checked exactly) plus a random
// subset of up to maxExp exposures in random modes and caps, and a random
// subset of the fake VMs. Odd rounds are big, even ones small, so most
// applies add or remove hundreds of exposures at once.
func randomDesired(rng *rand.Rand, round, maxExp, maxVM int) desired {
	d := desired{Exposures: append([]expo(nil), stableExposures...)}
	frac := 0.7 + 0.3*rng.Float64()
	if round%2 == 0 {
		frac = 0.3 * rng.Float64()
	}
	for i := 0; i < maxExp; i++ {
		if rng.Float64() >= frac {
			continue
		}
		mode := "nat"
		switch r := rng.Float64(); {
		case r < 0.25:
			mode = "auto"
		case r < 0.40:
			mode = "proxy"
		}
		d.Exposures = append(d.Exposures, expo{Name: fmt.Sprintf("x%04d", i), Mode: mode, Port: 20000 + i, Cap: 1 + rng.Intn(512)})
	}
	for i := 0; i < maxVM; i++ {
		if rng.Intn(2) == 0 {
			d.VMs = append(d.VMs, fmt.Sprintf("vm%d", i))
		}
	}
	return d
}

type faultTotals struct {
	orphans, dups, missingVMM, nftStale, nftMissing, lost, corrupt, tapsLeaked, tapsMissing, backwards int
	restartMax, convergeMax                                                                            time.Duration
}

func (x *h) faults() {
	x.killDuringConverges("faults", envInt("SOAK_KILLS", 50), envInt("SOAK_EXPOSURES", 1000), envInt("SOAK_VMS", 8))
}

// killDuringConverges SIGKILLs brokkrd at random moments of converges to
// random desired states (up to maxExp exposures and maxVM VMs) and checks
// what survived each restart; its figures are named p.*.
func (x *h) killDuringConverges(p string, kills, maxExp, maxVM int) {
	seed := int64(envInt("SOAK_SEED", int(time.Now().UnixNano()%1e9)))
	rng := rand.New(rand.NewSource(seed))
	x.figure(p+".seed", strconv.FormatInt(seed, 10), "SOAK_SEED replays the same sequence")

	base := desired{Exposures: stableExposures}
	if _, err := x.apply(base, 60*time.Second); err != nil {
		x.fail(p+": apply base: %v", err)
		return
	}
	if _, err := x.waitConverged(base, 60*time.Second); err != nil {
		x.fail(p+": base: %v", err)
		return
	}
	before, err := x.counters()
	if err != nil {
		x.fail(p+": %v", err)
		return
	}
	// The trickle runs in the client namespace through both stable
	// exposures for the whole phase; it ends when its stdin closes.
	tr := inNS(cliNS, filepath.Join(x.bin, "soak"), "load", "trickle", "-dur", "30m",
		fmt.Sprintf("%s:%d,%s:%d", hostIP, 19000, hostIP, 19001))
	trIn, _ := tr.StdinPipe()
	trOut, _ := tr.StdoutPipe()
	tr.Stderr = os.Stderr
	if err := tr.Start(); err != nil {
		x.fail(p+": trickle: %v", err)
		return
	}

	var tot faultTotals
	cur := base
	done, maxSeen, vmsSeen := 0, 0, 0
	for k := 1; k <= kills; k++ {
		if time.Until(x.deadline) < 3*time.Minute { // leave time for the other phases
			// Kills not made are checks not made: a failure, not a pass.
			x.fail("%s: %d of %d kills skipped: the time budget was spent", p, kills-k+1, kills)
			break
		}
		next := randomDesired(rng, k, maxExp, maxVM)
		maxSeen = max(maxSeen, len(next.Exposures))
		vmsSeen = max(vmsSeen, len(next.VMs))
		prev, _ := x.counters()
		prevDesired := cur
		res := make(chan error, 1)
		go func() { _, err := x.apply(next, 120*time.Second); res <- err }()
		// A random moment of the converge: while the apply is being
		// validated and persisted, or after, while the engines work.
		time.Sleep(time.Duration(rng.Intn(3000)) * time.Millisecond)
		x.stopDaemon(syscall.SIGKILL)
		acked := false
		select {
		case err := <-res:
			acked = err == nil
		case <-time.After(2 * time.Second):
		}
		t0 := time.Now()
		if err := x.startDaemon(); err != nil {
			x.fail(p+": kill %d: restart: %v", k, err)
			return
		}
		tot.restartMax = max(tot.restartMax, time.Since(t0))
		st, err := x.status()
		if err != nil {
			x.fail(p+": kill %d: status: %v", k, err)
			return
		}
		// An acknowledged apply must survive; one cut short may have
		// landed or not, but nothing in between.
		switch sk := statusKey(st); {
		case sk == next.key():
			cur = next
		case !acked && sk == prevDesired.key():
		default:
			tot.lost++
			fmt.Printf("kill %d: desired state after restart is neither the applied nor the previous one (acked=%v)\n  status: %s\n  applied: %s\n", k, acked, short(sk), short(next.key()))
			cur = next
		}
		st, err = x.waitConverged(cur, 120*time.Second)
		if err != nil {
			x.fail(p+": kill %d: %v", k, err)
			return
		}
		tot.convergeMax = max(tot.convergeMax, time.Since(t0))
		x.checkAfterRestart(k, cur, prevDesired, st, prev, &tot)
		done++
	}
	trIn.Close()
	var tallies []tally
	b, _ := io.ReadAll(trOut)
	_ = tr.Wait()
	if err := json.Unmarshal(b, &tallies); err != nil || len(tallies) != 2 {
		x.fail(p+": trickle output %q: %v", b, err)
		return
	}
	x.figure(p+".kills", strconv.Itoa(done), fmt.Sprintf("SIGKILL of brokkrd at a random moment of a converge, of %d asked", kills))
	x.figure(p+".exposures.max", strconv.Itoa(maxSeen), "exposures in the largest desired state")
	x.figure(p+".vms.max", strconv.Itoa(vmsSeen), x.hvKind()+" VMs at most")
	x.check(p+".vmm.orphan", int64(tot.orphans), 0, "VMM processes of VMs not desired")
	x.check(p+".vmm.duplicate", int64(tot.dups), 0, "second VMM processes for one VM")
	x.check(p+".vmm.missing", int64(tot.missingVMM), 0, "desired VMs without their status pid alive")
	x.check(p+".nft.stale", int64(tot.nftStale), 0, "map elements of exposures not desired")
	x.check(p+".nft.missing", int64(tot.nftMissing), 0, "desired nat/auto exposures without exactly one element and chain")
	x.check(p+".records.lost", int64(tot.lost), 0, "desired states lost or VM records missing")
	x.check(p+".records.corrupt", int64(tot.corrupt), 0, "records or desired.json not parsing")
	x.check(p+".taps.leaked", int64(tot.tapsLeaked), 0, "taps of no desired VM")
	x.check(p+".taps.missing", int64(tot.tapsMissing), 0, "")
	x.check(p+".counters.backwards", int64(tot.backwards), 0, "a counter lower after a restart than before the kill")
	x.figure(p+".restart_to_socket.max", fmt.Sprintf("%.2f", tot.restartMax.Seconds()), "s")
	x.figure(p+".restart_to_converged.max", fmt.Sprintf("%.2f", tot.convergeMax.Seconds()), "s")
	// Counters of the trickle's exposures against what its callers saw.
	time.Sleep(500 * time.Millisecond)
	after, err := x.counters()
	if err != nil {
		x.fail(p+": %v", err)
		return
	}
	for i, e := range stableExposures {
		t := tallies[i]
		a, b := after[e.Name], before[e.Name]
		x.figure(p+".trickle."+e.Name+".calls", strconv.FormatInt(t.OK, 10), fmt.Sprintf("refused %d, errors %d %s", t.Refused, t.Errors, t.LastErr))
		x.check(p+".trickle."+e.Name+".accepted_minus_calls", int64(a.Accepted-b.Accepted)-t.OK, 0, "counted in the kernel across every kill, against the callers")
		x.check(p+".trickle."+e.Name+".bytes_minus_sent", int64(a.BytesIn-b.BytesIn+a.BytesOut-b.BytesOut)-t.BytesIn-t.BytesOut, 0, "")
		// Every call was carried to a live target: none may count as dropped.
		x.check(p+".trickle."+e.Name+".dropped", int64(a.Dropped-b.Dropped), 0, "admitted but not carried, across every kill")
	}
}

func (x *h) checkAfterRestart(k int, cur, prevDesired desired, st *api.Status, prev map[string]bpfEntry, tot *faultTotals) {
	// VMM processes: exactly the status pid for each desired VM, none else.
	procs := x.vmmProcs()
	want := map[string]int{}
	for _, v := range st.VMs {
		want[v.Name] = v.PID
	}
	for name, pids := range procs {
		p, ok := want[name]
		if !ok {
			tot.orphans += len(pids)
			fmt.Printf("kill %d: orphan VMM %s %v\n", k, name, pids)
			continue
		}
		if len(pids) > 1 {
			tot.dups += len(pids) - 1
			fmt.Printf("kill %d: duplicate VMM %s %v\n", k, name, pids)
		}
		if pids[0] != p && len(pids) == 1 {
			tot.orphans++
			fmt.Printf("kill %d: VMM %s pid %d is not status's %d\n", k, name, pids[0], p)
		}
	}
	for name := range want {
		if len(procs[name]) == 0 {
			tot.missingVMM++
		}
	}
	// nft against desired state.
	elems, targets, err := nftState()
	if err != nil {
		x.fail("kill %d: %v", k, err)
		return
	}
	wantNft := map[string]bool{}
	for _, e := range cur.Exposures {
		if e.Mode != "proxy" {
			wantNft[e.Name] = true
		}
	}
	for n, c := range elems {
		if !wantNft[n] {
			tot.nftStale += c
		}
	}
	for n, c := range targets {
		if !wantNft[n] {
			tot.nftStale += c
		}
	}
	for n := range wantNft {
		if elems[n] != 1 || targets[n] != 1 {
			tot.nftMissing++
			fmt.Printf("kill %d: %s has %d dispatch elements, %d target elements\n", k, n, elems[n], targets[n])
		}
	}
	// Records: desired.json parses; each desired VM has its record.
	var dj any
	if b, err := os.ReadFile(filepath.Join(x.state, "desired.json")); err != nil || json.Unmarshal(b, &dj) != nil {
		tot.corrupt++
	}
	for _, v := range cur.VMs {
		b, err := os.ReadFile(filepath.Join(x.state, "vms", v, "record.json"))
		if err != nil {
			tot.lost++
			fmt.Printf("kill %d: record of %s: %v\n", k, v, err)
			continue
		}
		var r struct {
			Name string `json:"name"`
		}
		if json.Unmarshal(b, &r) != nil || r.Name != v {
			tot.corrupt++
		}
	}
	// Taps: one per desired VM, no other.
	tp, err := taps()
	if err != nil {
		x.fail("kill %d: %v", k, err)
		return
	}
	wantTap := map[string]bool{}
	for _, v := range st.VMs {
		wantTap[v.Tap] = true
	}
	have := map[string]bool{}
	for _, t := range tp {
		have[t] = true
		if !wantTap[t] {
			tot.tapsLeaked++
			fmt.Printf("kill %d: leaked tap %s\n", k, t)
		}
	}
	for t := range wantTap {
		if !have[t] {
			tot.tapsMissing++
		}
	}
	// Counters of exposures desired before and after, unchanged, never lower.
	now, err := x.counters()
	if err != nil {
		x.fail("kill %d: %v", k, err)
		return
	}
	same := map[string]bool{}
	for _, a := range prevDesired.Exposures {
		for _, b := range cur.Exposures {
			if a == b {
				same[a.Name] = true
			}
		}
	}
	for n := range same {
		p, c := prev[n], now[n]
		if c.Accepted < p.Accepted || c.Refused < p.Refused || c.Dropped < p.Dropped || c.BytesIn < p.BytesIn || c.BytesOut < p.BytesOut {
			tot.backwards++
			fmt.Printf("kill %d: %s went backwards: %+v -> %+v\n", k, n, p, c)
		}
	}
}

// short keeps a status key readable in a failure line.
func short(s string) string {
	if len(s) > 300 {
		return s[:150] + " ... " + s[len(s)-150:]
	}
	return s
}
