package restart

import (
	"net"
	"testing"
	"time"

	"github.com/brokkr/brokkr/internal/nstest"
	"github.com/stretchr/testify/require"
)

// caller is a process in the host namespace inside the rig's child cgroup,
// where the socket path translates its connects.
type caller struct{ *nstest.Caller }

func (r *rig) startCaller(cgroup string) *caller {
	return &caller{nstest.StartCaller(r.t, r.host, cgroup)}
}

func (c *caller) hold(addr string) conn { return conn{c.Hold(addr)} }

func (c *caller) probe(addr string) bool {
	refused, _ := c.Probe(addr)
	return refused
}

// conn is a held connection: in this process or in a caller's.
type conn struct{ nstest.Held }

func (h conn) echo(t *testing.T, msg string) { h.Echo(t, msg) }
func (h conn) close(t *testing.T)            { h.Close(t) }

// holdIn and probeIn are hold and probe from the client namespace.
func (r *rig) holdIn(addr string) conn {
	r.t.Helper()
	var c net.Conn
	require.NoError(r.t, r.client.Do(func() (err error) { c, err = nstest.DialEcho(addr, "hold"); return err }), "hold %s", addr)
	r.t.Cleanup(func() { c.Close() })
	return conn{nstest.Held{Conn: c}}
}

func (r *rig) probeIn(addr string) bool {
	var c net.Conn
	err := r.client.Do(func() (err error) { c, err = nstest.DialEcho(addr, "probe"); return err })
	if err != nil {
		return true
	}
	c.Close()
	return false
}

// udpAsk sends msg on u once and waits for the guest's answer
// ("port:msg"): each datagram sent is one the counters must show.
func udpAsk(u *net.UDPConn, msg string) (string, error) {
	if _, err := u.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, 512)
	_ = u.SetReadDeadline(time.Now().Add(3 * time.Second))
	n, err := u.Read(buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
