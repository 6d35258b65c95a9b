package chfake

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newFake(t *testing.T, b Behaviour) (*httptest.Server, chan int) {
	t.Helper()
	wd, _ := os.Getwd()
	p, err := FindSpec(wd)
	if err != nil {
		t.Skip("no OpenAPI file:", err)
	}
	doc, err := LoadSpec(p)
	require.NoError(t, err)
	exits := make(chan int, 4)
	s, err := New(doc, b, func(c int) { exits <- c }, nil)
	require.NoError(t, err)
	ts := httptest.NewServer(s)
	t.Cleanup(func() { ts.Close(); s.Close() })
	return ts, exits
}

func call(t *testing.T, ts *httptest.Server, method, endpoint, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, ts.URL+"/api/v1/"+endpoint, strings.NewReader(body))
	require.NoError(t, err)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := ts.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

const goodCreate = `{"cpus":{"boot_vcpus":1,"max_vcpus":1},"memory":{"size":67108864},
 "payload":{"kernel":"/k","cmdline":"console=ttyS0"},"serial":{"mode":"Null"},"console":{"mode":"Off"}}`

// The fake refuses bodies the real API would: every request is checked
// against the published schema.
func TestRequestsAreCheckedAgainstTheSchema(t *testing.T) {
	ts, _ := newFake(t, Behaviour{})
	for name, c := range map[string]struct {
		method, endpoint, body string
		want                   int
	}{
		"no body":             {"PUT", "vm.create", "", 400},
		"no payload":          {"PUT", "vm.create", `{"cpus":{"boot_vcpus":1,"max_vcpus":1}}`, 400},
		"zero vcpus":          {"PUT", "vm.create", `{"payload":{},"cpus":{"boot_vcpus":0,"max_vcpus":1}}`, 400},
		"memory as string":    {"PUT", "vm.create", `{"payload":{},"memory":{"size":"1G"}}`, 400},
		"serial without mode": {"PUT", "vm.create", `{"payload":{},"serial":{"file":"/x"}}`, 400},
		"bad console mode":    {"PUT", "vm.create", `{"payload":{},"console":{"mode":"Nope"}}`, 400},
		"unknown endpoint":    {"PUT", "vm.frobnicate", "", 404},
		"wrong method":        {"GET", "vm.create", "", 405},
		"boot before create":  {"PUT", "vm.boot", "", 404},
		"info before create":  {"GET", "vm.info", "", 404},
	} {
		t.Run(name, func(t *testing.T) {
			got, msg := call(t, ts, c.method, c.endpoint, c.body)
			assert.Equal(t, c.want, got, msg)
		})
	}
}

// A valid lifecycle: ping, create, info Created, boot, info Running,
// power button -> the process exits 0 (guest poweroff).
func TestLifecycleAndAnswersMatchTheSchema(t *testing.T) {
	ts, exits := newFake(t, Behaviour{})
	code, body := call(t, ts, "GET", "vmm.ping", "")
	require.Equal(t, 200, code, body)
	var ping struct{ Pid int }
	require.NoError(t, json.Unmarshal([]byte(body), &ping))
	assert.Equal(t, os.Getpid(), ping.Pid)

	code, body = call(t, ts, "PUT", "vm.create", goodCreate)
	require.Equal(t, 204, code, body)
	code, body = call(t, ts, "GET", "vm.info", "")
	require.Equal(t, 200, code, body)
	assert.Contains(t, body, `"state":"Created"`)
	code, _ = call(t, ts, "PUT", "vm.power-button", "")
	assert.Equal(t, 405, code, "power button before boot")
	code, body = call(t, ts, "PUT", "vm.boot", "")
	require.Equal(t, 204, code, body)
	_, body = call(t, ts, "GET", "vm.info", "")
	assert.Contains(t, body, `"state":"Running"`)
	code, body = call(t, ts, "GET", "vm.counters", "")
	assert.Equal(t, 200, code, body)
	code, _ = call(t, ts, "PUT", "vm.power-button", "")
	assert.Equal(t, 204, code)
	select {
	case c := <-exits:
		assert.Equal(t, 0, c)
	case <-time.After(30 * time.Second):
		t.Fatal("power button did not end the fake VMM")
	}
}

func TestRefuseAndCrash(t *testing.T) {
	ts, _ := newFake(t, Behaviour{Refuse: map[string]bool{"vm.create": true}})
	code, _ := call(t, ts, "PUT", "vm.create", goodCreate)
	assert.Equal(t, 500, code)

	ts, exits := newFake(t, Behaviour{CrashAfter: 50 * time.Millisecond})
	call(t, ts, "PUT", "vm.create", goodCreate)
	call(t, ts, "PUT", "vm.boot", "")
	select {
	case c := <-exits:
		assert.Equal(t, 1, c)
	case <-time.After(30 * time.Second):
		t.Fatal("no crash")
	}
}

func TestSerialToFile(t *testing.T) {
	ts, _ := newFake(t, Behaviour{ConsoleBytes: 100})
	p := filepath.Join(t.TempDir(), "serial")
	code, body := call(t, ts, "PUT", "vm.create", strings.Replace(goodCreate, `{"mode":"Null"}`, `{"mode":"File","file":"`+p+`"}`, 1))
	require.Equal(t, 204, code, body)
	call(t, ts, "PUT", "vm.boot", "")
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.Contains(t, string(b), "chfake: booting /k")
}

func TestBehaviourFromEnv(t *testing.T) {
	t.Setenv("CHFAKE_CRASH_AFTER", "2s")
	t.Setenv("CHFAKE_REFUSE", "vm.boot, vm.create")
	t.Setenv("CHFAKE_HANG_BOOT", "1")
	b, err := BehaviourFromEnv()
	require.NoError(t, err)
	assert.Equal(t, 2*time.Second, b.CrashAfter)
	assert.True(t, b.Refuse["vm.create"] && b.Refuse["vm.boot"] && b.HangBoot)
	t.Setenv("CHFAKE_CRASH_AFTER", "soon")
	_, err = BehaviourFromEnv()
	assert.ErrorContains(t, err, "CHFAKE_CRASH_AFTER")
}

// Pause, snapshot, restore in a new VMM, resume: the endpoints' bodies are
// checked against the schema, the states follow cloud-hypervisor's, and the
// restored guest is the same boot (its serial console says so).
func TestSnapshotAndRestore(t *testing.T) {
	dir := t.TempDir()
	serial := filepath.Join(dir, "serial")
	snap := filepath.Join(dir, "snap")
	require.NoError(t, os.Mkdir(snap, 0o700))
	create := strings.Replace(goodCreate, `{"mode":"Null"}`, `{"mode":"File","file":"`+serial+`"}`, 1)
	ts, _ := newFake(t, Behaviour{})
	code, body := call(t, ts, "PUT", "vm.pause", "")
	assert.Equal(t, 404, code, "pause before create: %s", body)
	call(t, ts, "PUT", "vm.create", create)
	call(t, ts, "PUT", "vm.boot", "")
	booted, err := os.ReadFile(serial)
	require.NoError(t, err)
	bootID := strings.TrimSuffix(strings.SplitAfter(string(booted), "(boot ")[1], ")\n")
	require.Len(t, bootID, 16, "%q", booted)

	snapBody := `{"destination_url":"file://` + snap + `"}`
	code, _ = call(t, ts, "PUT", "vm.snapshot", "")
	assert.Equal(t, 400, code, "the schema requires a body")
	code, _ = call(t, ts, "PUT", "vm.snapshot", snapBody)
	assert.Equal(t, 405, code, "a running VM is not snapshotted")
	code, _ = call(t, ts, "PUT", "vm.resume", "")
	assert.Equal(t, 405, code, "resume of a running VM")
	code, body = call(t, ts, "PUT", "vm.pause", "")
	require.Equal(t, 204, code, body)
	_, body = call(t, ts, "GET", "vm.info", "")
	assert.Contains(t, body, `"state":"Paused"`)
	code, body = call(t, ts, "PUT", "vm.snapshot", `{"destination_url":"file://`+filepath.Join(dir, "absent")+`"}`)
	assert.Equal(t, 500, code, body)
	code, body = call(t, ts, "PUT", "vm.snapshot", snapBody)
	require.Equal(t, 204, code, body)
	fi, err := os.Stat(filepath.Join(snap, "memory-ranges"))
	require.NoError(t, err)
	assert.Equal(t, int64(67108864), fi.Size(), "the guest's memory, all of it")

	ts2, _ := newFake(t, Behaviour{})
	code, _ = call(t, ts2, "PUT", "vm.restore", `{"prefault":false}`)
	assert.Equal(t, 400, code, "source_url is required")
	code, body = call(t, ts2, "PUT", "vm.restore", `{"source_url":"file://`+snap+`"}`)
	require.Equal(t, 204, code, body)
	_, body = call(t, ts2, "GET", "vm.info", "")
	assert.Contains(t, body, `"state":"Paused"`)
	code, _ = call(t, ts2, "PUT", "vm.restore", `{"source_url":"file://`+snap+`"}`)
	assert.Equal(t, 404, code, "restore into a VMM that has a VM")
	code, body = call(t, ts2, "PUT", "vm.resume", "")
	require.Equal(t, 204, code, body)
	_, body = call(t, ts2, "GET", "vm.info", "")
	assert.Contains(t, body, `"state":"Running"`)
	restored, err := os.ReadFile(serial)
	require.NoError(t, err)
	assert.Equal(t, "chfake: restored boot "+bootID+" (snapshot 1)\n", string(restored))

	// A snapshot with its memory cut short is refused, not half-loaded.
	require.NoError(t, os.Truncate(filepath.Join(snap, "memory-ranges"), 4096))
	ts3, _ := newFake(t, Behaviour{})
	code, body = call(t, ts3, "PUT", "vm.restore", `{"source_url":"file://`+snap+`"}`)
	assert.Equal(t, 400, code)
	assert.Contains(t, body, "memory-ranges: 4096 bytes")
	code, _ = call(t, ts3, "GET", "vm.info", "")
	assert.Equal(t, 404, code, "a refused restore leaves no VM")
}
