package main

import (
	"encoding/json"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// expose add sends one exposure in the config's shape with only the keys
// given (ports as numbers), to PUT /v1/exposures/NAME, and prints the plan.
func TestExposeAddSendsTheGivenKeys(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	out, errs, code := run(t, "expose", "add", "web-alt", "--vm", "web", "--guest-port", "80", "--host-port", "8088", "--socket", f.sock)
	require.Equal(t, 0, code, errs)
	assert.Equal(t, "applied:\n  + exposure web-alt\n", out)

	_, errs, code = run(t, "expose", "add", "ext", "--target", "10.213.0.200", "--guest-port", "22", "--host-port", "2222",
		"--mode", "proxy", "--protocol", "tcp", "--host-address", "127.0.0.1", "--max-conns", "0", "--socket", f.sock, "-o", "json")
	require.Equal(t, 0, code, errs)
	got := f.exposureRequests()
	require.Len(t, got, 2)
	assert.Equal(t, `PUT web-alt {"guestPort":80,"hostPort":8088,"name":"web-alt","vm":"web"}`, got[0])
	assert.Equal(t, `PUT ext {"guestPort":22,"hostAddress":"127.0.0.1","hostPort":2222,"maxConns":0,"mode":"proxy","name":"ext","protocol":"tcp","target":"10.213.0.200"}`, got[1],
		"--max-conns 0 is sent: unlimited, not the default")
}

// The flags' own mistakes are user errors (exit 1), said before anything is
// sent; so is a value of the wrong kind, named as the daemon names it.
func TestExposeAddRefusesBadFlags(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--guest-port", "80", "--host-port", "8080"}, "one of --vm or --target (or --target6) is required"},
		{[]string{"--vm", "web", "--target", "10.213.0.200", "--guest-port", "80", "--host-port", "8080"}, "are both given; give one"},
		{[]string{"--vm", "web", "--host-port", "8080"}, "--guest-port is required"},
		{[]string{"--vm", "web", "--guest-port", "80"}, "--host-port is required"},
		{[]string{"--vm", "web", "--guest-port", "eighty", "--host-port", "8080"}, `guestPort: "eighty" is not a port or a range of ports`},
		{[]string{"--vm", "web", "--guest-port", "80", "--host-port", "8080", "--max-conns", "many"}, "invalid argument"},
	} {
		args := append([]string{"expose", "add", "x", "--socket", f.sock}, tc.args...)
		_, errs, code := run(t, args...)
		assert.Equal(t, 1, code, "%v", tc.args)
		assert.Contains(t, errs, tc.want, "%v", tc.args)
	}
	_, _, code := run(t, "expose", "add", "--vm", "web", "--guest-port", "80", "--host-port", "8080", "--socket", f.sock)
	assert.Equal(t, 1, code, "NAME is required")
	assert.Empty(t, f.exposureRequests(), "nothing sent")
}

// --allow-from goes through only where this build's config has an allowFrom
// key; without one it is refused, not sent to be dropped.
func TestExposeAddAllowFrom(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	args := []string{"expose", "add", "x", "--vm", "web", "--guest-port", "80", "--host-port", "8080",
		"--allow-from", "10.0.0.0/8,192.168.1.0/24", "--allow-from", "fd00::/8", "--socket", f.sock}
	_, errs, code := run(t, args...)
	if !exposureKey("allowFrom") {
		assert.Equal(t, 1, code)
		assert.Contains(t, errs, "--allow-from: this brokkr's config has no allowFrom key")
		assert.Empty(t, f.exposureRequests())
		return
	}
	require.Equal(t, 0, code, errs)
	var sent struct {
		AllowFrom []string `json:"allowFrom"`
	}
	got := f.exposureRequests()
	require.Len(t, got, 1)
	require.NoError(t, json.Unmarshal([]byte(got[0][len("PUT x "):]), &sent))
	assert.Equal(t, []string{"10.0.0.0/8", "192.168.1.0/24", "fd00::/8"}, sent.AllowFrom)
}

func TestExposureKey(t *testing.T) {
	assert.True(t, exposureKey("hostPort"))
	assert.True(t, exposureKey("maxConns"))
	assert.False(t, exposureKey("maxconns"))
}

// The daemon's answers map to the contract's exit codes: a refusal (the
// fields named, or fleet mode) is 1, a daemon failure 2, and so is no daemon.
func TestExposeAddAndRmExitCodes(t *testing.T) {
	f := newFakeDaemon(t, twoVMs())
	add := []string{"expose", "add", "x", "--vm", "web", "--guest-port", "80", "--host-port", "8081", "--socket", f.sock}
	f.answerExposures(func(string, string) (int, any) {
		return http.StatusUnprocessableEntity, api.Error{Error: "exposure rejected; nothing was changed",
			Errors: []string{"hostPort: 8081/tcp on 0.0.0.0 overlaps exposures[1] (8081/tcp on 0.0.0.0)"}}
	})
	_, errs, code := run(t, add...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, "exposure rejected; nothing was changed:\n  hostPort: 8081/tcp on 0.0.0.0 overlaps exposures[1]")

	f.answerExposures(func(string, string) (int, any) {
		return http.StatusConflict, api.Error{Error: "this node takes its desired state from etcd (fleet mode, node h1): change it with `brokkr fleet apply --node h1 -f FILE`"}
	})
	_, errs, code = run(t, add...)
	assert.Equal(t, 1, code, "fleet mode")
	assert.Contains(t, errs, "brokkr fleet apply --node h1")
	_, _, code = run(t, "expose", "rm", "web-http", "--socket", f.sock)
	assert.Equal(t, 1, code, "fleet mode")

	f.answerExposures(func(string, string) (int, any) {
		return http.StatusInternalServerError, api.Error{Error: "persisting desired state: no space left on device"}
	})
	_, errs, code = run(t, add...)
	assert.Equal(t, 2, code)
	assert.Contains(t, errs, "no space left on device")

	f.answerExposures(func(method, name string) (int, any) {
		return http.StatusNotFound, api.Error{Error: `no such exposure: "` + name + `"`}
	})
	_, errs, code = run(t, "expose", "rm", "ghost", "--socket", f.sock)
	assert.Equal(t, 1, code)
	assert.Contains(t, errs, `no such exposure: "ghost"`)

	f.answerExposures(nil)
	out, _, code := run(t, "expose", "rm", "web-http", "--socket", f.sock)
	assert.Equal(t, 0, code)
	assert.Equal(t, "applied:\n  - exposure web-http\n", out)
	assert.Equal(t, "DELETE web-http", f.exposureRequests()[len(f.exposureRequests())-1])

	_, _, code = run(t, "expose", "rm", "x", "--socket", filepath.Join(t.TempDir(), "none"))
	assert.Equal(t, 2, code, "no daemon")
	_, _, code = run(t, "expose", "rm", "--socket", f.sock)
	assert.Equal(t, 1, code, "NAME is required")
}
