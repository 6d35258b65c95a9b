package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
)

// expo is one exposure of a desired state; every one targets the target
// namespace's echo server (a `target:` exposure, no VM needed).
type expo struct {
	Name     string
	Mode     string // nat | auto | proxy
	Port     int
	Cap      int
	HostAddr string // "" = 0.0.0.0
}

type desired struct {
	Exposures []expo
	VMs       []string
}

func (d desired) yaml(x *h) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "stateDir: %s\nrunDir: %s\nbpfDir: %s\n", x.state, x.run, x.bpf)
	fmt.Fprintf(&b, "network:\n  bridge: %s\n  cidr: 10.213.50.1/24\n", bridge)
	if x.qemu != nil {
		b.WriteString("hypervisor:\n  kind: qemu\n  maxConcurrentCreates: 2\n")
	} else {
		fmt.Fprintf(&b, "hypervisor:\n  kind: cloud-hypervisor\n  path: %s\n  maxConcurrentCreates: 4\n", filepath.Join(x.bin, "cloud-hypervisor"))
	}
	if len(d.VMs) == 0 {
		b.WriteString("vms: []\n")
	} else {
		b.WriteString("vms:\n")
	}
	for _, v := range d.VMs {
		if x.qemu != nil {
			fmt.Fprintf(&b, "  - {name: %s, memory: 256M, kernel: %s, initramfs: %s}\n", v, x.qemu.kernel, x.qemu.initramfs)
			continue
		}
		fmt.Fprintf(&b, "  - {name: %s, memory: 64M, kernel: %s/vmlinuz, initramfs: %s/initramfs}\n", v, x.work, x.work)
	}
	if len(d.Exposures) == 0 {
		b.WriteString("exposures: []\n")
	} else {
		b.WriteString("exposures:\n")
	}
	for _, e := range d.Exposures {
		fmt.Fprintf(&b, "  - {name: %s, target: %s, guestPort: %d, hostPort: %d, mode: %s, maxConns: %d", e.Name, targetIP, echoPort, e.Port, e.Mode, e.Cap)
		if e.HostAddr != "" {
			fmt.Fprintf(&b, ", hostAddress: %s", e.HostAddr)
		}
		b.WriteString("}\n")
	}
	return b.Bytes()
}

func (x *h) writeConfig(d desired) error { return os.WriteFile(x.cfgPath, d.yaml(x), 0o600) }

func (x *h) apply(d desired, timeout time.Duration) (*api.Plan, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return x.client.Apply(ctx, d.yaml(x), false)
}

func (d desired) names() []string {
	var n []string
	for _, e := range d.Exposures {
		n = append(n, e.Name)
	}
	sort.Strings(n)
	return n
}

func (d desired) key() string {
	vms := append([]string(nil), d.VMs...)
	sort.Strings(vms)
	return strings.Join(d.names(), ",") + "|" + strings.Join(vms, ",")
}

// statusKey is the desired state status reports: its exposures and the VMs
// it has a desired power for. A VM deleted from the desired state stays in
// status, without a power, until its destroy has finished; it is not part of
// the desired state, so a restart in the middle of that destroy must not
// look like a lost apply.
func statusKey(st *api.Status) string {
	var n, v []string
	for _, e := range st.Exposures {
		n = append(n, e.Name)
	}
	for _, m := range st.VMs {
		if m.Power != "" {
			v = append(v, m.Name)
		}
	}
	sort.Strings(n)
	sort.Strings(v)
	return strings.Join(n, ",") + "|" + strings.Join(v, ",")
}

// leaving lists the VMs status shows on their way out (no desired power).
func leaving(st *api.Status) []string {
	var v []string
	for _, m := range st.VMs {
		if m.Power == "" {
			v = append(v, m.Name)
		}
	}
	return v
}

// converged: status lists exactly d, every exposure active, every VM running.
func converged(st *api.Status, d desired) (bool, string) {
	if statusKey(st) != d.key() {
		return false, "status lists another set of VMs or exposures"
	}
	if l := leaving(st); len(l) > 0 {
		return false, fmt.Sprintf("vms %v are still being destroyed", l)
	}
	for _, e := range st.Exposures {
		if e.State != "active" {
			return false, fmt.Sprintf("exposure %s is %s: %s", e.Name, e.State, e.Reason)
		}
	}
	for _, v := range st.VMs {
		if v.Phase != "running" || v.PID == 0 {
			return false, fmt.Sprintf("vm %s is %s: %s", v.Name, v.Phase, v.Detail)
		}
	}
	return true, ""
}

func (x *h) waitConverged(d desired, timeout time.Duration) (*api.Status, error) {
	end := time.Now().Add(timeout)
	why := "no status"
	for time.Now().Before(end) {
		st, err := x.status()
		if err == nil {
			ok, w := converged(st, d)
			if ok {
				return st, nil
			}
			why = w
		} else {
			why = err.Error()
		}
		time.Sleep(200 * time.Millisecond)
	}
	return nil, fmt.Errorf("not converged within %v: %s", timeout, why)
}

// vmmProcs maps VM name to the live fake hypervisor processes under this
// soak's runDir (the API socket path names the VM).
func (x *h) vmmProcs() map[string][]int {
	out := map[string][]int{}
	ents, _ := os.ReadDir("/proc")
	// Every VMM names its VM's run directory in its arguments (the fake's
	// API socket; qemu's QMP socket, console socket and pidfile).
	dir := filepath.Join(x.run, "vms") + "/"
	exe := []byte(filepath.Join(x.bin, "chfake"))
	if x.qemu != nil {
		exe = []byte("qemu-system-")
	}
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil || !bytes.Contains(b, exe) {
			continue
		}
		if st, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "stat")); err == nil && bytes.Contains(st, []byte(") Z ")) {
			continue // a zombie is no VMM
		}
		for _, a := range bytes.Split(b, []byte{0}) {
			if i := bytes.Index(a, []byte(dir)); i >= 0 {
				name := strings.SplitN(string(a[i+len(dir):]), "/", 2)[0]
				out[name] = append(out[name], pid)
				break // one VM per process
			}
		}
	}
	return out
}

// taps lists the tun/tap links in the host namespace.
func taps() ([]string, error) {
	out, err := runIn(hostNS, "ip", "-d", "-j", "link", "show")
	if err != nil {
		return nil, err
	}
	var links []struct {
		Name string `json:"ifname"`
		Info *struct {
			Kind string `json:"info_kind"`
		} `json:"linkinfo"`
	}
	if err := json.Unmarshal([]byte(out), &links); err != nil {
		return nil, err
	}
	var t []string
	for _, l := range links {
		if l.Info != nil && l.Info.Kind == "tun" {
			t = append(t, l.Name)
		}
	}
	return t, nil
}

// nftState reads `nft -j list table inet brokkr`: per exposure name, how many
// elements it has in the dispatch maps (exp-addr, exp-any: its mark by host
// side) and in exp-target (its guest by mark).
func nftState() (elems, targets map[string]int, err error) {
	out, err := runIn(hostNS, "nft", "-j", "list", "table", "inet", "brokkr")
	if err != nil {
		return nil, nil, err
	}
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		return nil, nil, err
	}
	elems, targets = map[string]int{}, map[string]int{}
	for _, o := range doc.Nftables {
		raw, ok := o["map"]
		if !ok {
			continue
		}
		var m struct {
			Name string            `json:"name"`
			Elem []json.RawMessage `json:"elem"`
		}
		_ = json.Unmarshal(raw, &m)
		count := map[string]map[string]int{"exp-addr": elems, "exp-any": elems, "exp-target": targets}[m.Name]
		if count == nil {
			continue
		}
		for _, el := range m.Elem {
			// Each element is [key, value]; the key carries the comment
			// naming the exposure.
			count[findComment(el)]++
		}
	}
	return elems, targets, nil
}

func findComment(raw json.RawMessage) string {
	var v any
	_ = json.Unmarshal(raw, &v)
	var walk func(any) string
	walk = func(v any) string {
		switch t := v.(type) {
		case map[string]any:
			if c, ok := t["comment"].(string); ok {
				return c
			}
			for _, x := range t {
				if c := walk(x); c != "" {
					return c
				}
			}
		case []any:
			for _, x := range t {
				if c := walk(x); c != "" {
					return c
				}
			}
		}
		return ""
	}
	return walk(v)
}
