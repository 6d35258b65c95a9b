package main

import (
	"encoding/csv"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/netplane/nft"
)

// changes: what a change costs against the number of exposures, through
// netplane/nft as the daemon drives it (MarksOnly: marks + DNAT, the nat
// path's table). At each size, per round:
//   - apply: one Converge of that many exposures into an emptied table;
//   - add / remove: one exposure more, then less, through Update (the
//     incremental path), 5 of each;
//   - more: one exposure more through Converge of the whole desired state;
//   - nochange: Converge of the unchanged desired state (the level-
//     triggered pass);
//   - foreign: the same pass after another program committed to a table of
//     its own in the namespace.
//
// Rounds go over every size in turn (interleaved), so a busy spell of the
// machine spreads over all sizes; each figure is the median over rounds
// with the lowest and highest sample beside it. Wall time, and the
// process's CPU (user+system: the kernel's work on a commit is done in the
// committing syscall).
func changes(args []string) error {
	fs := flag.NewFlagSet("changes", flag.ExitOnError)
	ns := fs.String("ns", "", "host namespace path")
	guest := fs.String("guest", "10.213.0.11", "guest address")
	gport := fs.Int("guestport", 7000, "guest port")
	hostAddrs := fs.String("hostaddrs", "10.99.0.1,10.99.1.1", "host addresses, filled in order, 55,000 ports each")
	sizes := fs.String("sizes", "10,1000,10000,100000", "")
	rounds := fs.Int("rounds", 3, "interleaved rounds")
	csvPath := fs.String("csv", "", "write one CSV row per size here")
	cpuProf := fs.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	memProf := fs.String("memprofile", "", "write an allocation profile of the whole run to this file")
	onto := fs.Int("onto", 0, "converge this many of the exposures first, outside the timing, so the apply lands on a running table (0: an emptied one)")
	_ = fs.Parse(args)
	if *memProf != "" {
		runtime.MemProfileRate = 64 << 10
		defer func() {
			if f, err := os.Create(*memProf); err == nil {
				_ = pprof.Lookup("allocs").WriteTo(f, 0)
				f.Close()
			}
		}()
	}
	stop, err := cpuProfile(*cpuProf)
	if err != nil {
		return err
	}
	defer stop()
	g := netip.MustParseAddr(*guest)
	var addrs []netip.Addr
	for _, a := range strings.Split(*hostAddrs, ",") {
		addrs = append(addrs, netip.MustParseAddr(a))
	}
	const portBase, perAddr = 10000, 55000
	exp := func(i int) nft.Exposure {
		return nft.Exposure{Name: fmt.Sprintf("x%06d", i), Protocol: "tcp", HostAddr: addrs[i/perAddr],
			HostPort: uint16(portBase + i%perAddr), GuestAddr: g, GuestPort: uint16(*gport), MarkID: uint32(i + 1)}
	}
	var ks []int
	for _, f := range strings.Split(*sizes, ",") {
		k, err := strconv.Atoi(f)
		if err != nil || k < 1 || k+6 > perAddr*len(addrs) {
			return fmt.Errorf("size %q: 1 .. %d", f, perAddr*len(addrs)-6)
		}
		ks = append(ks, k)
	}
	t, err := nft.Open(*ns)
	if err != nil {
		return err
	}
	defer t.Close()
	samples := map[int]map[string][]sample{}
	for _, k := range ks {
		samples[k] = map[string][]sample{}
	}
	for round := 0; round < *rounds; round++ {
		for _, k := range ks {
			if err := t.Delete(); err != nil {
				return err
			}
			r := nft.Rules{Bridge: "br0", Subnet: netip.MustParsePrefix("10.213.0.1/24"), Masquerade: true, DHCP: true, Cap: nft.MarksOnly{}}
			r.Exposures = make([]nft.Exposure, k)
			for i := range r.Exposures {
				r.Exposures[i] = exp(i)
			}
			m := samples[k]
			if n := min(*onto, k); n > 0 {
				first := r
				first.Exposures = r.Exposures[:n]
				if _, err := t.Converge(first); err != nil {
					return fmt.Errorf("%d exposures: the first %d: %w", k, n, err)
				}
			}
			runtime.GC() // the previous size's garbage is not this apply's
			s, err := timed(func() error { _, err := t.Converge(r); return err })
			if err != nil {
				return fmt.Errorf("%d exposures: apply: %w", k, err)
			}
			m["apply"] = append(m["apply"], s)
			for i := 0; i < 5; i++ {
				e := exp(k + i)
				s, err := timed(func() error { _, err := t.Update([]nft.Exposure{e}, nil, nil); return err })
				if err != nil {
					return fmt.Errorf("%d exposures: add: %w", k, err)
				}
				m["add"] = append(m["add"], s)
				s, err = timed(func() error { _, err := t.Update(nil, []string{e.Name}, nil); return err })
				if err != nil {
					return fmt.Errorf("%d exposures: remove: %w", k, err)
				}
				m["remove"] = append(m["remove"], s)
			}
			more := r
			more.Exposures = append(append([]nft.Exposure(nil), r.Exposures...), exp(k))
			s, err = timed(func() error { _, err := t.Converge(more); return err })
			if err != nil {
				return fmt.Errorf("%d exposures: more: %w", k, err)
			}
			m["more"] = append(m["more"], s)
			s, err = timed(func() error { _, err := t.Converge(more); return err })
			if err != nil {
				return err
			}
			m["nochange"] = append(m["nochange"], s)
			other := fmt.Sprintf("brk-bench-other-%d-%d", round, k)
			if out, err := exec.Command("nsenter", "--net="+*ns, "nft", "add", "table", "ip", other).CombinedOutput(); err != nil {
				return fmt.Errorf("another program's commit: %v: %s", err, out)
			}
			s, err = timed(func() error { _, err := t.Converge(more); return err })
			if err != nil {
				return err
			}
			m["foreign"] = append(m["foreign"], s)
			_ = exec.Command("nsenter", "--net="+*ns, "nft", "delete", "table", "ip", other).Run()
			fmt.Printf("round=%d n=%d apply=%v add=%v remove=%v more=%v nochange=%v foreign=%v\n", round+1, k,
				us(m["apply"][len(m["apply"])-1].wall), us(m["add"][len(m["add"])-1].wall), us(m["remove"][len(m["remove"])-1].wall),
				us(m["more"][len(m["more"])-1].wall), us(m["nochange"][len(m["nochange"])-1].wall), us(m["foreign"][len(m["foreign"])-1].wall))
		}
	}
	if err := t.Delete(); err != nil {
		return err
	}
	var w *csv.Writer
	if *csvPath != "" {
		f, err := os.Create(*csvPath)
		if err != nil {
			return err
		}
		defer f.Close()
		fmt.Fprintf(f, "# natscale changes %s kernel=%s cores=%d rounds=%d load=%s\n", time.Now().UTC().Format(time.RFC3339),
			kernelRelease(), runtime.NumCPU(), *rounds, loadavg())
		w = csv.NewWriter(f)
		_ = w.Write(changesHeader)
	}
	for _, k := range ks {
		rec := []string{strconv.Itoa(k)}
		line := fmt.Sprintf("n=%d", k)
		for _, metric := range changesMetrics {
			ss := samples[k][metric]
			wall := summarize(ss, func(s sample) time.Duration { return s.wall })
			cpu := summarize(ss, func(s sample) time.Duration { return s.cpu })
			rec = append(rec, ms(wall.med), ms(wall.lo), ms(wall.hi), ms(cpu.med))
			line += fmt.Sprintf(" %s=%v [%v..%v] cpu=%v", metric, us(wall.med), us(wall.lo), us(wall.hi), us(cpu.med))
		}
		fmt.Println("median " + line)
		if w != nil {
			_ = w.Write(rec)
		}
	}
	if w != nil {
		w.Flush()
		return w.Error()
	}
	return nil
}

// changesMetrics are the CSV's measurements, each as median, lowest and
// highest wall time and median CPU time (tests/bench/plot reads them).
var changesMetrics = []string{"apply", "add", "remove", "more", "nochange", "foreign"}

var changesHeader = func() []string {
	h := []string{"exposures"}
	for _, m := range changesMetrics {
		h = append(h, m+"_ms", m+"_lo_ms", m+"_hi_ms", m+"_cpu_ms")
	}
	return h
}()

type sample struct{ wall, cpu time.Duration }

// timed runs fn and returns its wall and CPU time.
func timed(fn func() error) (sample, error) {
	c0, t0 := cpuTime(), time.Now()
	err := fn()
	return sample{time.Since(t0), cpuTime() - c0}, err
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

type spread struct{ med, lo, hi time.Duration }

func summarize(ss []sample, f func(sample) time.Duration) spread {
	if len(ss) == 0 {
		return spread{}
	}
	d := make([]time.Duration, len(ss))
	for i, s := range ss {
		d[i] = f(s)
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	med := d[len(d)/2]
	if len(d)%2 == 0 {
		med = (d[len(d)/2-1] + d[len(d)/2]) / 2
	}
	return spread{med, d[0], d[len(d)-1]}
}

func ms(d time.Duration) string { return strconv.FormatFloat(float64(d)/1e6, 'f', 3, 64) }

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], "/")
}
