package api

import (
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
)

// A non-root caller on the root-only socket is told it lacks permission,
// not asked whether the daemon is running.
func TestUnreachableSaysPermissionDeniedForANonRootCaller(t *testing.T) {
	err := &UnreachableError{Socket: "/run/brokkr/brokkr.sock", Err: &net.OpError{Op: "dial", Net: "unix", Err: os.NewSyscallError("connect", syscall.EACCES)}}
	msg := err.Error()
	assert.Contains(t, msg, "permission denied")
	assert.Contains(t, msg, "root-only")
	assert.NotContains(t, msg, "is it running")
	other := &UnreachableError{Socket: "/x.sock", Err: fmt.Errorf("dial: %w", syscall.ECONNREFUSED)}
	assert.Contains(t, other.Error(), "is it running", "a daemon that is down still gets the hint")
}
