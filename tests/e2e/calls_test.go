package e2e

import (
	"encoding/json"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/brokkr/brokkr/internal/procfs"
	"github.com/stretchr/testify/require"
)

func vm(st api.Status, name string) api.VM {
	for _, v := range st.VMs {
		if v.Name == name {
			return v
		}
	}
	return api.VM{}
}

func exposure(st api.Status, name string) (api.Exposure, bool) {
	for _, x := range st.Exposures {
		if x.Name == name {
			return x, true
		}
	}
	return api.Exposure{}, false
}

// dial opens a TCP connection from inside ns.
func dial(ns *nstest.NS, addr string, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr, timeout)
		return err
	})
	return c, err
}

// httpGet fetches / through addr from ns with a plain HTTP/1.0 request.
func httpGet(ns *nstest.NS, addr string) (string, error) {
	c, err := dial(ns, addr, 3*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET / HTTP/1.0\r\nHost: guest\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// echo sends msg on an open connection and reads it back.
func echo(c net.Conn, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// hold opens a connection that is carried end to end (the echo came back).
func hold(t testing.TB, ns *nstest.NS, addr string) net.Conn {
	t.Helper()
	c, err := dial(ns, addr, 5*time.Second)
	require.NoError(t, err, "dial %s", addr)
	got, err := echo(c, "hold")
	require.NoError(t, err)
	require.Equal(t, "hold", got)
	return c
}

// refused reports whether a caller to addr is turned away: the dial fails,
// or the connection ends without carrying a byte.
func refused(ns *nstest.NS, addr string) bool {
	c, err := dial(ns, addr, 3*time.Second)
	if err != nil {
		return true
	}
	defer c.Close()
	got, err := echo(c, "over")
	return err != nil || got != "over"
}

// gone reports whether pid has exited (a zombie counts: its parent has not
// reaped it yet) within timeout.
func gone(pid int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		if st, err := procfs.ReadProcStat(pid); err != nil || st.Exited() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type bpftoolEntry struct {
	Name     string `json:"name"`
	HostPort uint32 `json:"host_port"`
	Accepted uint64 `json:"accepted"`
	Refused  uint64 `json:"refused"`
	Active   uint64 `json:"active"`
	BytesIn  uint64 `json:"bytes_in"`
	BytesOut uint64 `json:"bytes_out"`
}

// bpftoolDump reads the pinned map with bpftool itself, as an operator would
// for one exposure: `bpftool map lookup` of each occupied slot (found with
// bpf.Dump: a dump of all 131,072 entries takes bpftool seconds).
func (e *env) bpftoolDump(t testing.TB) map[string]bpftoolEntry {
	t.Helper()
	got := map[string]bpftoolEntry{}
	for slot, v := range bpftoolLookups(t, filepath.Join(e.bpfDir, bpf.MapName), e.bpfDir) {
		var ent bpftoolEntry
		require.NoError(t, json.Unmarshal(v, &ent), "slot %d", slot)
		if ent.Name != "" {
			got[ent.Name] = ent
		}
	}
	return got
}

// bpftoolLookups is bpftool's formatted value of pin's entry at every
// slot the counter map under bpfDir has occupied.
func bpftoolLookups(t testing.TB, pin, bpfDir string) map[int]json.RawMessage {
	t.Helper()
	entries, err := bpf.Dump(filepath.Join(bpfDir, bpf.MapName))
	require.NoError(t, err)
	out := map[int]json.RawMessage{}
	for _, en := range entries {
		k := en.Slot
		raw, err := exec.Command("bpftool", "-j", "map", "lookup", "pinned", pin, "key",
			strconv.Itoa(k&0xff), strconv.Itoa(k>>8&0xff), strconv.Itoa(k>>16&0xff), "0").Output()
		require.NoError(t, err, "bpftool map lookup %s %d", pin, k)
		var w struct {
			Value     json.RawMessage `json:"value"`
			Formatted *struct {
				Value json.RawMessage `json:"value"`
			} `json:"formatted"`
		}
		require.NoError(t, json.Unmarshal(raw, &w), "%s", raw)
		v := w.Value
		if w.Formatted != nil {
			v = w.Formatted.Value
		}
		out[k] = v
	}
	return out
}

func conntrackEntries(t testing.TB, ns *nstest.NS, port int) int {
	t.Helper()
	out, _ := ns.Run("conntrack", "-L", "-p", "tcp", "--orig-port-dst", strconv.Itoa(port))
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "tcp ") {
			n++
		}
	}
	return n
}
