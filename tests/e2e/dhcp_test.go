package e2e

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cmdlineOf is a process's command line with its NULs as spaces.
func cmdlineOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	require.NoError(t, err)
	return string(bytes.ReplaceAll(b, []byte{0}, []byte{' '}))
}

// dhcpServing reports whether anything in the host namespace listens on the
// DHCP server port.
func (e *env) dhcpServing() bool {
	e.t.Helper()
	out := e.host.MustRun(e.t, "ss", "-Huln", "sport", "= :67")
	return strings.TrimSpace(out) != ""
}

// A newcomer's path: a guest leased by DHCP, then `network.dhcp: false`
// applied, then `vm restart`. After the apply the DHCP server is gone, the
// VM is booted again with its address in the kernel's ip= parameter, and it
// answers through its exposure; `vm restart` really boots it again, and it
// still answers with no DHCP server anywhere.
func TestWithDHCPOffTheGuestTakesItsAddressFromTheCommandLine(t *testing.T) {
	e := newEnv(t)
	exposures := "  - {name: web-nat, vm: e2e, guestPort: 8080, hostPort: 8080, mode: nat}\n"
	e.writeConfig(e.cfgPath, exposures)
	e.startDaemon()
	e.waitGuestServing(hostIP + ":8080")
	require.True(t, e.dhcpServing(), "precondition: dhcp: true serves DHCP on the bridge")
	st := e.status()
	first := vm(st, vmName)
	require.NotZero(t, first.PID)
	assert.NotContains(t, cmdlineOf(t, first.PID), " ip=", "with DHCP the guest leases its address")

	off := filepath.Join(e.state, "nodhcp.yaml")
	cfg := strings.Replace(e.config(exposures), "  cidr: 10.213.7.1/24\n", "  cidr: 10.213.7.1/24\n  dhcp: false\n", 1)
	require.Contains(t, cfg, "dhcp: false")
	require.NoError(t, os.WriteFile(off, []byte(cfg), 0o600))
	out, errs, code := e.brokkr("apply", "-f", off)
	require.Equal(t, 0, code, "apply: %s %s", out, errs)

	wantIP := fmt.Sprintf(" ip=%s::10.213.7.1:255.255.255.0:%s:eth0:off", first.Address, vmName)
	st = e.waitStatus("VM booted again with ip=", 3*time.Minute, func(st api.Status) bool {
		v := vm(st, vmName)
		return v.Phase == "running" && v.PID != 0 && v.PID != first.PID
	})
	second := vm(st, vmName)
	assert.Equal(t, first.Address, second.Address, "the assigned address is kept")
	assert.Contains(t, cmdlineOf(t, second.PID), wantIP, "the address reaches the hypervisor's command line")
	assert.False(t, e.dhcpServing(), "dhcp: false stops the DHCP server")
	e.waitGuestServing(hostIP + ":8080")

	_, errs, code = e.brokkr("vm", "restart", vmName)
	require.Equal(t, 0, code, errs)
	st = e.waitStatus("VM restarted", 3*time.Minute, func(st api.Status) bool {
		v := vm(st, vmName)
		return v.Phase == "running" && v.PID != 0 && v.PID != second.PID
	})
	third := vm(st, vmName)
	assert.Contains(t, cmdlineOf(t, third.PID), wantIP)
	assert.False(t, e.dhcpServing())
	e.waitGuestServing(hostIP + ":8080")
	e.waitStatus("exposure active", 30*time.Second, func(st api.Status) bool {
		x, _ := exposure(st, "web-nat")
		return x.State == "active"
	})
	console, err := os.ReadFile(filepath.Join(e.state, "vms", vmName, "console.log"))
	require.NoError(t, err)
	assert.Contains(t, string(console), "no DHCP lease; using brokkr.ip", "the guest asked for DHCP, got none, and used ip=")
}
