// Command bpfcost measures what brokkr's BPF programs cost per run while a
// load goes on: it turns on the kernel's run-time statistics for its own
// lifetime only (BPF_ENABLE_STATS: the statistics stop when the process
// exits, nothing stays switched on), waits, and prints each brk_* program's
// runs and mean nanoseconds per run over the window.
//
//	bpfcost -d 10s [-ids 12,13]
//
// -ids counts only the programs of those IDs (e.g. the ones a benchmark's
// pinned links run), not every brk_* program on the machine.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

type sample struct {
	name  string
	runs  uint64
	nanos time.Duration
}

func snapshot(only map[ebpf.ProgramID]bool) (map[ebpf.ProgramID]sample, error) {
	out := map[ebpf.ProgramID]sample{}
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if errors.Is(err, os.ErrNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		id = next
		if only != nil && !only[id] {
			continue
		}
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // gone meanwhile
		}
		info, ierr := p.Info()
		st, serr := p.Stats()
		p.Close()
		if ierr != nil || serr != nil || !strings.HasPrefix(info.Name, "brk_") {
			continue
		}
		out[id] = sample{name: info.Name, runs: st.RunCount, nanos: st.Runtime}
	}
}

func main() {
	d := flag.Duration("d", 10*time.Second, "measurement window")
	ids := flag.String("ids", "", "comma-separated program IDs to count (default: every brk_* program)")
	flag.Parse()
	var only map[ebpf.ProgramID]bool
	if *ids != "" {
		only = map[ebpf.ProgramID]bool{}
		for _, f := range strings.Split(*ids, ",") {
			n, err := strconv.ParseUint(strings.TrimSpace(f), 10, 32)
			check(err)
			only[ebpf.ProgramID(n)] = true
		}
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	check(err)
	defer stats.Close()
	before, err := snapshot(only)
	check(err)
	time.Sleep(*d)
	after, err := snapshot(only)
	check(err)
	byName := map[string]sample{}
	for id, a := range after {
		b := before[id]
		s := byName[a.name]
		s.name = a.name
		s.runs += a.runs - b.runs
		s.nanos += a.nanos - b.nanos
		byName[a.name] = s
	}
	var names []string
	for n := range byName {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		s := byName[n]
		if s.runs == 0 {
			continue
		}
		fmt.Printf("bpf %s: %d runs, %.0f ns per run\n", n, s.runs, float64(s.nanos.Nanoseconds())/float64(s.runs))
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "bpfcost:", err)
		os.Exit(1)
	}
}
