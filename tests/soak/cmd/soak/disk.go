package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// listTree lists the files under dir (relative paths), the filler aside.
func listTree(dir string) []string {
	var out []string
	_ = filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err == nil && !info.IsDir() && filepath.Base(p) != "soak-filler" {
			r, _ := filepath.Rel(dir, p)
			out = append(out, r)
		}
		return nil
	})
	sort.Strings(out)
	return out
}

// fill writes a filler file on stateDir's tmpfs until ENOSPC.
func fill(path string) (int64, error) {
	f, err := os.Create(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var n int64
	for _, sz := range []int{1 << 20, 4096, 1} {
		buf := make([]byte, sz)
		for i := 0; i < 1<<20; i++ { // bounded: a 32M tmpfs fills long before
			m, err := f.Write(buf)
			n += int64(m)
			if errors.Is(err, syscall.ENOSPC) {
				break
			}
			if err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// diskFull: stateDir on a small tmpfs that is filled, then an apply of 1,000
// exposures; it must fail clearly and leave the previous state in force.
func (x *h) diskFull() {
	prev := desired{Exposures: append([]expo(nil), stableExposures...)}
	for i := 0; i < 50; i++ {
		prev.Exposures = append(prev.Exposures, expo{Name: fmt.Sprintf("d%04d", i), Mode: "nat", Port: 23000 + i, Cap: 10})
	}
	next := desired{Exposures: append([]expo(nil), stableExposures...)}
	for i := 0; i < envInt("SOAK_EXPOSURES", 1000); i++ {
		next.Exposures = append(next.Exposures, expo{Name: fmt.Sprintf("n%04d", i), Mode: "nat", Port: 24000 + i, Cap: 10})
	}
	if _, err := x.apply(prev, 60*time.Second); err != nil {
		x.fail("disk: apply: %v", err)
		return
	}
	if _, err := x.waitConverged(prev, 60*time.Second); err != nil {
		x.fail("disk: %v", err)
		return
	}
	d0, _ := os.ReadFile(filepath.Join(x.state, "desired.json"))
	files0 := listTree(x.state)
	filler := filepath.Join(x.state, "soak-filler")
	n, err := fill(filler)
	if err != nil {
		x.fail("disk: fill: %v", err)
		return
	}
	defer os.Remove(filler)
	var sfs syscall.Statfs_t
	_ = syscall.Statfs(x.state, &sfs)
	x.figure("disk.filled", strconv.FormatInt(n>>20, 10), fmt.Sprintf("MiB written until ENOSPC; %d bytes left", sfs.Bavail*uint64(sfs.Bsize)))
	_, aerr := x.apply(next, 60*time.Second)
	msg := ""
	if aerr != nil {
		msg = aerr.Error()
	}
	x.check("disk.apply_failed", b2i(aerr != nil), 1, msg)
	x.check("disk.error_names_no_space", b2i(strings.Contains(strings.ToLower(msg), "no space left")), 1, "")
	// The previous desired state stays in force, on disk and in the kernel.
	time.Sleep(2 * time.Second) // two passes
	st, err := x.status()
	if err != nil {
		x.fail("disk: status: %v", err)
		return
	}
	ok, why := converged(st, prev)
	x.check("disk.previous_state_in_force", b2i(ok), 1, why)
	d1, _ := os.ReadFile(filepath.Join(x.state, "desired.json"))
	x.check("disk.desired_json_unchanged", b2i(bytes.Equal(d0, d1)), 1, "")
	extra := diff(listTree(x.state), files0)
	x.check("disk.files_left_behind", int64(len(extra)), 0, strings.Join(extra, " "))
	elems, _, err := nftState()
	if err == nil {
		stale := 0
		for name := range elems {
			if strings.HasPrefix(name, "n") {
				stale++
			}
		}
		x.check("disk.nft_elements_of_failed_apply", int64(stale), 0, "")
	}
	// Space back: a restart resumes the previous state; the apply then works.
	os.Remove(filler)
	x.stopDaemon(syscall.SIGKILL)
	if err := x.startDaemon(); err != nil {
		x.fail("disk: restart: %v", err)
		return
	}
	_, err = x.waitConverged(prev, 60*time.Second)
	x.check("disk.restart_resumes_previous", b2i(err == nil), 1, errStr(err))
	_, err = x.apply(next, 120*time.Second)
	if err == nil {
		_, err = x.waitConverged(next, 120*time.Second)
	}
	x.check("disk.apply_after_space_freed", b2i(err == nil), 1, errStr(err))
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

func errStr(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func diff(a, b []string) []string {
	in := map[string]bool{}
	for _, s := range b {
		in[s] = true
	}
	var out []string
	for _, s := range a {
		if !in[s] {
			out = append(out, s)
		}
	}
	return out
}
