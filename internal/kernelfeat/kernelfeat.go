// Package kernelfeat is the one table of the kernel features brokkr's data
// paths use: for each, the upstream kernel that brought it and how to see
// it in the running kernel (its BTF names the program and attach types, the
// helpers and the kfuncs it has). Loaders check their features here before
// they load, so a fallback says which feature is missing; tests do the
// same, and a feature missing from a kernel that should have it fails the
// test instead of skipping it. The README's kernel table is this table
// (checked by this package's tests); make test-kernels shows each cell.
package kernelfeat

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"golang.org/x/sys/unix"
)

// Version is an upstream kernel version, major and minor.
type Version struct{ Major, Minor int }

func (v Version) String() string { return fmt.Sprintf("%d.%d", v.Major, v.Minor) }

// AtLeast reports whether v is o or later.
func (v Version) AtLeast(o Version) bool {
	return v.Major > o.Major || v.Major == o.Major && v.Minor >= o.Minor
}

// ParseVersion reads the major and minor of a kernel release string
// ("6.1.0-57-cloud-amd64", "5.10.223", "6.18.44-fc-v1045").
func ParseVersion(release string) (Version, error) {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return Version{}, fmt.Errorf("kernel release %q: not major.minor", release)
	}
	maj, err1 := strconv.Atoi(parts[0])
	minor := parts[1]
	if i := strings.IndexFunc(minor, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		minor = minor[:i]
	}
	min, err2 := strconv.Atoi(minor)
	if err1 != nil || err2 != nil {
		return Version{}, fmt.Errorf("kernel release %q: not major.minor", release)
	}
	return Version{maj, min}, nil
}

// probe is how a feature shows in the kernel's BTF.
type probe struct {
	kind string // "enum": Type has the enumerator Name; "func": a function (kfunc) Name
	Type string
	Name string
	// Module is the module a "func" may be built in instead of the kernel
	// image (its BTF is read when vmlinux's has no Name).
	Module string
}

// Feature is one row of the table.
type Feature struct {
	Name  string  // what a fallback reason and a skip say: "BPF netfilter programs"
	Since Version // the upstream kernel that brought it
	Used  string  // what brokkr uses it for (the README's column)
	probe probe
}

func enum(typ, name string) probe { return probe{kind: "enum", Type: typ, Name: name} }
func kfunc(name string) probe     { return probe{kind: "func", Name: name} }

// modKfunc is a kfunc of module, or of the kernel image where the module
// is built in.
func modKfunc(module, name string) probe { return probe{kind: "func", Name: name, Module: module} }

// The table. Since is upstream's release; a distribution kernel may have a
// feature earlier (a backport) but must not lack one it is newer than.
var (
	CgroupConnect     = Feature{"cgroup connect4/6 programs", Version{4, 17}, "socket path: connect-time translation", enum("bpf_attach_type", "BPF_CGROUP_INET4_CONNECT")}
	CgroupUDPMsg      = Feature{"cgroup sendmsg/recvmsg programs", Version{5, 2}, "socket path: UDP translation", enum("bpf_attach_type", "BPF_CGROUP_UDP4_RECVMSG")}
	CgroupGetpeername = Feature{"cgroup getpeername programs", Version{5, 8}, "socket path: the dialled address shown", enum("bpf_attach_type", "BPF_CGROUP_INET4_GETPEERNAME")}
	CgroupSockRelease = Feature{"cgroup sock_release programs", Version{5, 9}, "socket path: places given back at close", enum("bpf_attach_type", "BPF_CGROUP_INET_SOCK_RELEASE")}
	SkcToTCPSock      = Feature{"bpf_skc_to_tcp_sock", Version{5, 9}, "socket path: TCP bytes at close", enum("bpf_func_id", "BPF_FUNC_skc_to_tcp_sock")}
	SetRetval         = Feature{"bpf_set_retval", Version{5, 18}, "socket path: ECONNREFUSED past the cap", enum("bpf_func_id", "BPF_FUNC_set_retval")}
	ForEachMapElem    = Feature{"bpf_for_each_map_elem", Version{5, 13}, "nat path: the sweep", enum("bpf_func_id", "BPF_FUNC_for_each_map_elem")}
	Timers            = Feature{"BPF timers", Version{5, 15}, "nat path: the sweep's clock", enum("bpf_func_id", "BPF_FUNC_timer_init")}
	CastToKernCtx     = Feature{"bpf_cast_to_kern_ctx, bpf_rdonly_cast", Version{6, 2}, "nat path: reading the conntrack entry", kfunc("bpf_rdonly_cast")}
	SkbDynptr         = Feature{"skb dynptrs", Version{6, 3}, "nat path: reading the packet", kfunc("bpf_dynptr_from_skb")}
	ConntrackKfuncs   = Feature{"conntrack kfuncs for tc", Version{5, 18}, "nat path before 6.4: a packet's conntrack entry, on the bridge", modKfunc("nf_conntrack", "bpf_skb_ct_lookup")}
	NetfilterPrograms = Feature{"BPF netfilter programs", Version{6, 4}, "nat path: admission, release and counting per packet", enum("bpf_prog_type", "BPF_PROG_TYPE_NETFILTER")}
	TCX               = Feature{"tcx links", Version{6, 6}, "nat path: the refused caller's RST", enum("bpf_attach_type", "BPF_TCX_EGRESS")}
	RunTimeStats      = Feature{"BPF run-time statistics", Version{5, 8}, "tests: the programs' cost per packet", enum("bpf_stats_type", "BPF_STATS_RUN_TIME")}
)

// All is the table in the README's order.
var All = []Feature{
	CgroupConnect, CgroupUDPMsg, CgroupGetpeername, CgroupSockRelease, SkcToTCPSock, SetRetval,
	ForEachMapElem, Timers, ConntrackKfuncs, CastToKernCtx, SkbDynptr, NetfilterPrograms, TCX, RunTimeStats,
}

// What each path needs.
var (
	// NatPath is what the nat path needs at least: its tc programs on the
	// bridge (bpf/nattc.c). NatPathNetfilter is what its programs at the
	// netfilter hooks need (bpf/natpath.c), which it runs where it can.
	NatPath          = []Feature{ConntrackKfuncs, Timers, ForEachMapElem}
	NatPathNetfilter = []Feature{NetfilterPrograms, TCX, SkbDynptr, CastToKernCtx, Timers, ForEachMapElem}
	SocketPath       = []Feature{CgroupConnect, CgroupUDPMsg, CgroupGetpeername, CgroupSockRelease, SkcToTCPSock, SetRetval}
)

// Kernel is what the running kernel has, read once.
type Kernel struct {
	Release string
	Version Version
	spec    *btf.Spec
	err     error // BTF could not be read: every feature is then unknown
}

var (
	runningOnce sync.Once
	running     *Kernel
)

// Running is the kernel this process runs on.
func Running() *Kernel {
	runningOnce.Do(func() {
		var u unix.Utsname
		k := &Kernel{}
		if err := unix.Uname(&u); err != nil {
			k.err = err
		} else {
			k.Release = unix.ByteSliceToString(u.Release[:])
			k.Version, k.err = ParseVersion(k.Release)
		}
		if k.err == nil {
			k.spec, k.err = btf.LoadKernelSpec()
		}
		running = k
	})
	return running
}

// Has reports whether the kernel has f; err when its BTF cannot say.
func (k *Kernel) Has(f Feature) (bool, error) {
	if k.err != nil {
		return false, fmt.Errorf("kernel features: %w", k.err)
	}
	switch f.probe.kind {
	case "enum":
		var e *btf.Enum
		if err := k.spec.TypeByName(f.probe.Type, &e); err != nil {
			if errors.Is(err, btf.ErrNotFound) {
				return false, nil
			}
			return false, err
		}
		for _, v := range e.Values {
			if v.Name == f.probe.Name {
				return true, nil
			}
		}
		return false, nil
	case "func":
		var fn *btf.Func
		err := k.spec.TypeByName(f.probe.Name, &fn)
		if errors.Is(err, btf.ErrNotFound) && f.probe.Module != "" {
			return hasModuleFunc(f.probe.Module, f.probe.Name)
		}
		if errors.Is(err, btf.ErrNotFound) {
			return false, nil
		}
		return err == nil, err
	}
	return false, fmt.Errorf("feature %s: no probe", f.Name)
}

// hasModuleFunc reports whether module has the function name in its BTF,
// loading the module first (modprobe) when it is not: a module that
// cannot load lacks it. Not cached: the module may come later.
func hasModuleFunc(module, name string) (bool, error) {
	if _, err := os.Stat(filepath.Join("/sys/module", module)); err != nil {
		_ = exec.Command("modprobe", "-q", module).Run()
	}
	spec, err := btf.LoadKernelModuleSpec(module)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var fn *btf.Func
	err = spec.TypeByName(name, &fn)
	if errors.Is(err, btf.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// MissingError names the features a kernel lacks; it is an
// ebpf.ErrNotSupported (errors.Is), so callers treat it as any kernel that
// cannot load a program.
type MissingError struct {
	Kernel Version
	Lack   []Feature
}

func (e *MissingError) Error() string {
	names := make([]string, len(e.Lack))
	for i, f := range e.Lack {
		names[i] = fmt.Sprintf("%s (%s)", f.Name, f.Since)
	}
	return fmt.Sprintf("kernel %s has no %s", e.Kernel, strings.Join(names, ", "))
}

// Is makes a MissingError an ebpf.ErrNotSupported.
func (e *MissingError) Is(target error) bool { return target == ebpf.ErrNotSupported }

// Missing is a *MissingError naming the features of fs the kernel lacks
// ("kernel 5.10 has no BPF netfilter programs (6.4)"), nil when it has them
// all, or the error that kept its BTF from being read.
func (k *Kernel) Missing(fs ...Feature) error {
	var lack []Feature
	for _, f := range fs {
		ok, err := k.Has(f)
		if err != nil {
			return err
		}
		if !ok {
			lack = append(lack, f)
		}
	}
	if len(lack) == 0 {
		return nil
	}
	return &MissingError{Kernel: k.Version, Lack: lack}
}

// Overdue lists the features of fs that the kernel lacks although it is as
// new as their Since: a broken build or a wrong table, never a reason to
// skip a test.
func (k *Kernel) Overdue(fs ...Feature) []Feature {
	var out []Feature
	for _, f := range fs {
		if ok, err := k.Has(f); err == nil && !ok && k.Version.AtLeast(f.Since) {
			out = append(out, f)
		}
	}
	return out
}

// TB is what Require needs of a *testing.T.
type TB interface {
	Helper()
	Skipf(format string, args ...any)
	Fatalf(format string, args ...any)
}

// Require skips the test when the running kernel lacks one of fs and is
// older than that feature's Since, naming the feature; it fails the test
// when a kernel that should have the feature lacks it, or when the kernel's
// BTF cannot be read.
func Require(t TB, fs ...Feature) {
	t.Helper()
	k := Running()
	if over := k.Overdue(fs...); len(over) > 0 {
		t.Fatalf("kernel %s (%s) lacks %s, which %s and later have", k.Version, k.Release, over[0].Name, over[0].Since)
		return
	}
	if err := k.Missing(fs...); err != nil {
		if errors.Is(err, ebpf.ErrNotSupported) {
			t.Skipf("%v", err)
			return
		}
		t.Fatalf("%v", err)
	}
}
