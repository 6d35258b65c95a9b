package fleet_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/fleet"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// The tests run a real etcd cluster (embed, in this process) and real
// brokkrd processes, each in a namespace of its own. Go cannot move a whole
// process between network namespaces, so TestMain re-executes the test
// binary inside a namespace made for the purpose (etcdNS): etcd listens
// there, on its loopback for peers and on one veth per node for clients,
// and nothing of this test is ever in the root namespace.

const innerEnv = "BROKKR_FLEET_TEST_NS"

var (
	bin    string     // brokkrd and brokkr, built once
	etcdNS *nstest.NS // where this process (and etcd) runs
)

func TestMain(m *testing.M) {
	flag.Parse()
	if !nstest.Privileged() || testing.Short() {
		os.Exit(m.Run()) // the tests skip themselves
	}
	if name := os.Getenv(innerEnv); name != "" {
		os.Exit(inner(m, name))
	}
	name := fmt.Sprintf("brk-fl%d-etcd", os.Getpid())
	_ = exec.Command("ip", "netns", "delete", name).Run()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "fleet tests: ip netns add %s: %v: %s\n", name, err, out)
		os.Exit(2)
	}
	code := 0
	cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + name, "--", os.Args[0]}, os.Args[1:]...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), innerEnv+"="+name)
	if err := cmd.Run(); err != nil {
		code = 1
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		}
	}
	_ = exec.Command("ip", "netns", "delete", name).Run()
	os.Exit(code)
}

func inner(m *testing.M, name string) int {
	etcdNS = &nstest.NS{Name: name, Path: "/run/netns/" + name}
	if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "fleet tests: lo up: %v: %s\n", err, out)
		return 2
	}
	dir, err := os.MkdirTemp("", "brk-fleet-bin-")
	if err != nil {
		return 2
	}
	defer os.RemoveAll(dir)
	build := exec.Command("go", "build", "-o", dir+"/", "github.com/brokkr/brokkr/cmd/brokkrd", "github.com/brokkr/brokkr/cmd/brokkr")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "fleet tests: building the binaries:", err)
		return 2
	}
	bin = dir
	return m.Run()
}

func needEnv(t testing.TB) {
	t.Helper()
	nstest.RequireRoot(t)
	if testing.Short() {
		t.Skip("-short: runs an etcd cluster and brokkrd processes")
	}
	for _, c := range []string{"socat", "nft", "nsenter"} {
		if _, err := exec.LookPath(c); err != nil {
			t.Skipf("%s is not installed (scripts/deps.sh)", c)
		}
	}
}

// cluster is a real etcd cluster of in-process members.
type cluster struct {
	t       testing.TB
	dir     string
	n       int
	tls     *certs // nil: plain http
	members []*embed.Etcd
	cfgs    []*embed.Config
}

func clientPort(i int) int { return 23790 + i }
func peerPort(i int) int   { return 23800 + i }

func newCluster(t testing.TB, n int, tls *certs) *cluster {
	t.Helper()
	c := &cluster{t: t, dir: t.TempDir(), n: n, tls: tls, members: make([]*embed.Etcd, n), cfgs: make([]*embed.Config, n)}
	var initial []string
	for i := 0; i < n; i++ {
		initial = append(initial, fmt.Sprintf("m%d=http://127.0.0.1:%d", i, peerPort(i)))
	}
	for i := 0; i < n; i++ {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("m%d", i)
		cfg.Dir = filepath.Join(c.dir, cfg.Name)
		scheme := "http"
		if tls != nil {
			scheme = "https"
			cfg.ClientTLSInfo = transport.TLSInfo{CertFile: tls.serverCert, KeyFile: tls.serverKey, TrustedCAFile: tls.ca, ClientCertAuth: true}
		}
		// Clients on every address of this namespace (loopback for the test,
		// one veth per node); peers on loopback only.
		cfg.ListenClientUrls = []url.URL{{Scheme: scheme, Host: fmt.Sprintf("0.0.0.0:%d", clientPort(i))}}
		cfg.AdvertiseClientUrls = []url.URL{{Scheme: scheme, Host: fmt.Sprintf("127.0.0.1:%d", clientPort(i))}}
		p := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort(i))}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{p}, []url.URL{p}
		cfg.InitialCluster = strings.Join(initial, ",")
		cfg.InitialClusterToken = "brokkr-fleet-test"
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		c.cfgs[i] = cfg
	}
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() { errs <- c.start(i) }()
	}
	for i := 0; i < n; i++ {
		require.NoError(t, <-errs)
	}
	t.Cleanup(c.close)
	return c
}

func (c *cluster) start(i int) error {
	e, err := embed.StartEtcd(c.cfgs[i])
	if err != nil {
		return fmt.Errorf("member %d: %w", i, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(60 * time.Second):
		e.Close()
		return fmt.Errorf("member %d not ready after 60 s", i)
	}
	c.members[i] = e
	return nil
}

// kill stops member i as a crash would look to clients (its listeners close).
func (c *cluster) kill(i int) {
	c.members[i].Close()
	c.members[i] = nil
}

func (c *cluster) restart(i int) {
	c.cfgs[i].ClusterState = embed.ClusterStateFlagExisting
	require.NoError(c.t, c.start(i))
}

func (c *cluster) close() {
	for i, e := range c.members {
		if e != nil {
			e.Close()
			c.members[i] = nil
		}
	}
}

func (c *cluster) scheme() string {
	if c.tls != nil {
		return "https"
	}
	return "http"
}

// endpoints as seen from this namespace (host "" = 127.0.0.1) or from a
// node's end of its veth.
func (c *cluster) endpoints(host string) []string {
	if host == "" {
		host = "127.0.0.1"
	}
	var eps []string
	for i := 0; i < c.n; i++ {
		eps = append(eps, fmt.Sprintf("%s://%s:%d", c.scheme(), host, clientPort(i)))
	}
	return eps
}

// client is the test's own (root, or anonymous without auth) etcd client.
func (c *cluster) client(t testing.TB, cc fleet.ClientConfig) *clientv3.Client {
	t.Helper()
	cc.Endpoints = c.endpoints("")
	cc.DialTimeout = 10 * time.Second
	cli, err := fleet.Dial(cc)
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	return cli
}

// node is one brokkrd in its own namespace, linked to etcdNS by a veth.
type node struct {
	t          testing.TB
	name       string
	k          int // 10.77.k.0/30 to etcd, 10.213.k.0/24 for guests
	ns         *nstest.NS
	dir, run   string
	bpf        string
	cfgPath    string
	logPath    string
	cmd        *exec.Cmd
	done       chan struct{}
	extra      string // more of the fleet section (TLS, auth)
	c          *cluster
	ext        *nstest.NS // the target "guest" on the node's bridge
	extServers []*exec.Cmd
}

func (n *node) etcdAddr() string { return fmt.Sprintf("10.77.%d.1", n.k) }
func (n *node) addr() string     { return fmt.Sprintf("10.77.%d.2", n.k) }
func (n *node) target() string   { return fmt.Sprintf("10.213.%d.200", n.k) }
func (n *node) sock() string     { return filepath.Join(n.run, "brokkr.sock") }

func newNode(t testing.TB, c *cluster, k int, extra string) *node {
	t.Helper()
	n := &node{t: t, name: fmt.Sprintf("h%d", k), k: k, c: c, extra: extra}
	n.ns = nstest.New(t, n.name)
	nstest.Link(t, n.ns, "fl-up", n.addr()+"/30", etcdNS, fmt.Sprintf("fl-h%d", k), n.etcdAddr()+"/30")
	n.dir = t.TempDir()
	run, err := os.MkdirTemp("", "brk-fl-")
	require.NoError(t, err)
	n.run = run
	t.Cleanup(func() { os.RemoveAll(run) })
	n.bpf = nstest.PrivateBPFFS(t)
	n.cfgPath = filepath.Join(n.dir, "brokkr.yaml")
	n.logPath = filepath.Join(n.dir, "brokkrd.log")
	eps := `["` + strings.Join(c.endpoints(n.etcdAddr()), `", "`) + `"]`
	cfg := fmt.Sprintf(`stateDir: %s/state
runDir: %s
bpfDir: %s
network: %s
hypervisor: {kind: qemu}
fleet:
  endpoints: %s
  node: %s
  leaseTTL: 3
%s`, n.dir, n.run, n.bpf, n.network(), eps, n.name, extra)
	require.NoError(t, os.WriteFile(n.cfgPath, []byte(cfg), 0o600))
	t.Cleanup(func() {
		n.stop()
		for _, s := range n.extServers {
			_ = s.Process.Kill()
			_ = s.Wait()
		}
		if t.Failed() {
			b, _ := os.ReadFile(n.logPath)
			t.Logf("brokkrd %s log:\n%s", n.name, lastLines(string(b), 60))
		}
	})
	n.start()
	return n
}

func (n *node) network() string {
	return fmt.Sprintf("{bridge: brk-fl0, cidr: 10.213.%d.1/24}", n.k)
}

// doc is a fleet document for this node publishing the target's ports.
func (n *node) doc(ports ...int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "network: %s\nexposures:\n", n.network())
	for _, p := range ports {
		fmt.Fprintf(&b, "  - {name: ext-%d, target: %s, guestPort: %d, hostPort: %d, mode: nat}\n", p, n.target(), p, p)
	}
	return b.String()
}

func (n *node) start() {
	n.t.Helper()
	log, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	require.NoError(n.t, err)
	defer log.Close()
	n.cmd = n.ns.Command(filepath.Join(bin, "brokkrd"), "--config", n.cfgPath)
	// The socket path's cgroup programs would attach at the host's root
	// cgroup: fleet tests need no socket path.
	n.cmd.Env = append(os.Environ(), "BROKKR_CGROUP=off")
	n.cmd.Stdout, n.cmd.Stderr = log, log
	require.NoError(n.t, n.cmd.Start())
	n.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(n.cmd, n.done)
	waitFor(n.t, 30*time.Second, "brokkrd "+n.name+" serving", func() (bool, string) {
		_, err := os.Stat(n.sock())
		return err == nil, fmt.Sprint(err)
	})
}

func (n *node) stop() {
	if n.cmd == nil {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.done:
	case <-time.After(20 * time.Second):
		_ = n.cmd.Process.Kill()
		<-n.done
	}
	n.cmd = nil
}

// status is the node's local status, through its socket.
func (n *node) status() *api.Status {
	n.t.Helper()
	st, err := api.NewClient(n.sock()).Status(context.Background())
	require.NoError(n.t, err)
	return st
}

// serveTarget puts a namespace on the node's bridge at target() with an
// echo server on each port: the guest "managed elsewhere" of a target
// exposure.
func (n *node) serveTarget(ports ...int) {
	n.t.Helper()
	waitFor(n.t, 20*time.Second, "bridge brk-fl0 in "+n.name, func() (bool, string) {
		out, err := n.ns.Run("ip", "link", "show", "brk-fl0")
		return err == nil, out
	})
	n.ext = nstest.New(n.t, n.name+"x")
	nstest.Link(n.t, n.ns, "fl-ext", "", n.ext, "eth0", n.target()+"/24")
	n.ns.MustRun(n.t, "ip", "link", "set", "fl-ext", "master", "brk-fl0")
	n.ext.MustRun(n.t, "ip", "route", "add", "default", "via", fmt.Sprintf("10.213.%d.1", n.k))
	for _, p := range ports {
		s := n.ext.Command("socat", fmt.Sprintf("TCP-LISTEN:%d,fork,reuseaddr", p), "EXEC:cat")
		require.NoError(n.t, s.Start())
		n.extServers = append(n.extServers, s)
	}
}

// echo calls the node's published port from the etcd namespace (an outside
// caller on the node's veth) and checks the answer.
func (n *node) echo(port int) error {
	c, err := net.DialTimeout("tcp", net.JoinHostPort(n.addr(), fmt.Sprint(port)), 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	buf := make([]byte, 5)
	if _, err := c.Read(buf); err != nil {
		return err
	}
	if string(buf) != "ping\n" {
		return fmt.Errorf("echo answered %q", buf)
	}
	return nil
}

// brokkr runs the CLI against the cluster (from this namespace).
func brokkr(t testing.TB, c *cluster, extraEnv []string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(bin, "brokkr"), args...)
	cmd.Env = append(os.Environ(), "BROKKR_ETCD="+strings.Join(c.endpoints(""), ","))
	cmd.Env = append(cmd.Env, extraEnv...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("brokkr %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

func fleetStatus(t testing.TB, c *cluster, env []string) map[string]fleet.NodeState {
	t.Helper()
	out, errs, code := brokkr(t, c, env, "fleet", "status", "-o", "json")
	require.Equal(t, 0, code, errs)
	var rows []fleet.NodeState
	require.NoError(t, json.Unmarshal([]byte(out), &rows), out)
	m := map[string]fleet.NodeState{}
	for _, r := range rows {
		m[r.Node] = r
	}
	return m
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(d)
	last := ""
	for time.Now().Before(deadline) {
		ok, s := cond()
		if ok {
			return
		}
		last = s
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("timed out after %s waiting for %s; last: %s", d, what, last)
}

// converged says whether rows show node n alive, running the desired
// revision, with every exposure active.
func converged(rows []fleet.NodeState, node string, exposures int) (bool, string) {
	for _, r := range rows {
		if r.Node == node {
			b, _ := json.Marshal(r)
			return r.Alive && r.Converged && r.Exposures == exposures && r.ExposuresActive == exposures && len(r.Errors) == 0, string(b)
		}
	}
	return false, node + " has no row"
}

func list(t testing.TB, cli *clientv3.Client) []fleet.NodeState {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := fleet.List(ctx, cli, "/brokkr")
	if err != nil {
		return nil
	}
	return rows
}

func waitConverged(t testing.TB, cli *clientv3.Client, node string, exposures int) {
	t.Helper()
	waitFor(t, 30*time.Second, node+" converged", func() (bool, string) { return converged(list(t, cli), node, exposures) })
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
