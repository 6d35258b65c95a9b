package hold

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/brokkr/brokkr/internal/nstest"
)

const squatEnv = "BRK_HOLD_SQUAT"

// TestMain makes the test binary a squatter when asked: a host program that
// binds a side (SO_REUSEADDR, as servers do), says "ok" and holds it until
// its stdin closes.
func TestMain(m *testing.M) {
	if s := os.Getenv(squatEnv); s != "" {
		var proto, addr string
		fmt.Sscan(s, &proto, &addr)
		lc := net.ListenConfig{}
		var c interface{ Close() error }
		var err error
		if proto[:3] == "tcp" {
			c, err = lc.Listen(context.Background(), proto, addr)
		} else {
			c, err = lc.ListenPacket(context.Background(), proto, addr)
		}
		if err != nil {
			fmt.Println("err", err)
			os.Exit(1)
		}
		fmt.Println("ok")
		bufio.NewReader(os.Stdin).ReadString('\n')
		c.Close()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// squat starts a squatter on proto/addr in ns and returns it; closing its
// stdin (stop) makes it exit.
func squat(t *testing.T, ns *nstest.NS, proto, addr string) (pid int, stop func()) {
	t.Helper()
	cmd := ns.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), squatEnv+"="+proto+" "+addr)
	in, err := cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, _ := bufio.NewReader(out).ReadString('\n')
	require.Equal(t, "ok\n", line, "squatter on %s %s", proto, addr)
	var once bool
	stop = func() {
		if !once {
			once = true
			in.Close()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(stop)
	return cmd.Process.Pid, stop
}

func side(s string, proto string) Side {
	ap := netip.MustParseAddrPort(s)
	return Side{Addr: ap.Addr(), Proto: proto, Port: ap.Port()}
}

// A side a host program holds is refused naming the program, and taken on
// the first Sync after the program went.
func TestASquattedSideNamesItsHolderAndIsTakenWhenItGoes(t *testing.T) {
	ns := nstest.New(t, "host")
	comm := filepath.Base(os.Args[0])
	if len(comm) > 15 {
		comm = comm[:15] // the kernel's TASK_COMM_LEN
	}
	for _, c := range []struct {
		proto, squat, want string
	}{
		{"tcp4", "0.0.0.0:9000", "0.0.0.0:9000"},
		{"tcp4", "127.0.0.1:9001", "0.0.0.0:9001"}, // a narrower bind still conflicts with the wildcard
		{"tcp6", "[::]:9002", "[::]:9002"},
		{"udp4", "0.0.0.0:9003", "0.0.0.0:9003"},
		{"udp6", "[::1]:9004", "[::]:9004"},
	} {
		t.Run(c.proto+"-"+c.squat, func(t *testing.T) {
			s := New(ns.Path, nil)
			defer s.Close()
			sd := side(c.want, c.proto[:3])
			pid, stop := squat(t, ns, c.proto, c.squat)
			failed := s.Sync(map[string][]Side{"web": {sd}})
			var iu *InUseError
			require.ErrorAs(t, failed["web"], &iu)
			assert.Equal(t, fmt.Sprintf("%s is in use by pid %d (%s)", sd, pid, comm), iu.Error())
			// Tried again (every pass): the same sockets, the same holder
			// (named from what was found, /proc/*/fd not read again).
			require.ErrorAs(t, s.Sync(map[string][]Side{"web": {sd}})["web"], &iu)
			assert.Equal(t, fmt.Sprintf("%s is in use by pid %d (%s)", sd, pid, comm), iu.Error())
			assert.False(t, iu.Self)
			assert.False(t, s.Holds(sd))
			assert.Error(t, s.Check(sd), "Check sees the squatter too")
			assert.Equal(t, fmt.Sprintf("pid %d (%s)", pid, comm), Holders(ns.Path, sd))

			stop()
			assert.Empty(t, s.Sync(map[string][]Side{"web": {sd}}))
			assert.True(t, s.Holds(sd))
			assert.NoError(t, s.Check(sd), "a side the set holds is free for it")
		})
	}
}

// bindIn binds proto/addr in ns the way a server does (SO_REUSEADDR, and
// listen for TCP) and returns the error.
func bindIn(ns *nstest.NS, proto, addr string) error {
	return ns.Do(func() error {
		lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
			return errors.Join(err, serr)
		}}
		var c interface{ Close() error }
		var err error
		if proto[:3] == "tcp" {
			c, err = lc.Listen(context.Background(), proto, addr)
		} else {
			c, err = lc.ListenPacket(context.Background(), proto, addr)
		}
		if err == nil {
			c.Close()
		}
		return err
	})
}

// While a side is held, a host program's bind of it fails with
// EADDRINUSE, both families, TCP and UDP, even with SO_REUSEADDR; released,
// it succeeds.
func TestAHeldSideRefusesAHostProgramsBind(t *testing.T) {
	ns := nstest.New(t, "host")
	s := New(ns.Path, nil)
	defer s.Close()
	sides := map[string][]Side{
		"t4": {side("0.0.0.0:9100", "tcp")}, "t6": {side("[::]:9100", "tcp")},
		"u4": {side("0.0.0.0:9100", "udp")}, "u6": {side("[::]:9100", "udp")},
	}
	require.Empty(t, s.Sync(sides))
	for _, c := range []struct{ proto, addr string }{
		{"tcp4", "0.0.0.0:9100"}, {"tcp4", "127.0.0.1:9100"}, {"tcp6", "[::]:9100"}, {"tcp6", "[::1]:9100"},
		{"udp4", "0.0.0.0:9100"}, {"udp4", "127.0.0.1:9100"}, {"udp6", "[::]:9100"}, {"udp6", "[::1]:9100"},
	} {
		assert.ErrorIs(t, bindIn(ns, c.proto, c.addr), unix.EADDRINUSE, "%s %s", c.proto, c.addr)
	}
	require.Empty(t, s.Sync(map[string][]Side{}))
	for _, c := range []struct{ proto, addr string }{{"tcp4", "0.0.0.0:9100"}, {"tcp6", "[::]:9100"}, {"udp4", "0.0.0.0:9100"}, {"udp6", "[::]:9100"}} {
		assert.NoError(t, bindIn(ns, c.proto, c.addr), "released: %s %s", c.proto, c.addr)
	}
}

// An exposure holds all of its sides or none: one squatted side releases
// the others it took in the same Sync.
func TestAnExposureHoldsAllItsSidesOrNone(t *testing.T) {
	ns := nstest.New(t, "host")
	s := New(ns.Path, nil)
	defer s.Close()
	_, stop := squat(t, ns, "tcp6", "[::]:9200")
	defer stop()
	a, b := side("0.0.0.0:9200", "tcp"), side("[::]:9200", "tcp")
	failed := s.Sync(map[string][]Side{"web": {a, b}})
	require.Error(t, failed["web"])
	assert.False(t, s.Holds(a), "the IPv4 side it took was given back")
	assert.NoError(t, bindIn(ns, "tcp4", "0.0.0.0:9200"))
}

// A port whose only sockets are TIME_WAIT connections (a listener that
// just went) is held at once, not failed for a minute.
func TestAPortInTimeWaitOnlyIsTaken(t *testing.T) {
	ns := nstest.New(t, "host")
	s := New(ns.Path, nil)
	defer s.Close()
	require.NoError(t, ns.Do(func() error {
		ln, err := (&net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) { _ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) })
		}}).Listen(context.Background(), "tcp4", "127.0.0.1:9300")
		if err != nil {
			return err
		}
		c, err := net.Dial("tcp4", "127.0.0.1:9300")
		if err != nil {
			return err
		}
		sc, err := ln.Accept()
		if err != nil {
			return err
		}
		sc.Close() // the server closes first: its side goes to TIME_WAIT
		buf := make([]byte, 1)
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, _ = c.Read(buf)
		c.Close()
		return ln.Close()
	}))
	var tw bool
	require.NoError(t, ns.Do(func() error {
		_, tw = findHolders(side("127.0.0.1:9300", "tcp"))
		return nil
	}))
	require.True(t, tw, "the server's side is in TIME_WAIT")
	assert.Empty(t, s.Sync(map[string][]Side{"web": {side("127.0.0.1:9300", "tcp")}}))
	// Held so, a server (SO_REUSEADDR, then listen) still cannot serve it.
	assert.ErrorIs(t, bindIn(ns, "tcp4", "127.0.0.1:9300"), unix.EADDRINUSE)
}

// The held sockets pass to the next process (Files → New) and are claimed
// there without a bind, which would fail while the old process still holds
// them; one no Sync claims is closed by DropUnclaimed.
func TestHeldSocketsPassToTheNextProcess(t *testing.T) {
	ns := nstest.New(t, "host")
	old := New(ns.Path, nil)
	defer old.Close()
	a, b := side("0.0.0.0:9400", "tcp"), side("0.0.0.0:9401", "udp")
	require.Empty(t, old.Sync(map[string][]Side{"a": {a}, "b": {b}}))
	files, err := old.Files()
	require.NoError(t, err)
	require.Len(t, files, 2)

	next := New(ns.Path, files)
	defer next.Close()
	assert.Empty(t, next.Sync(map[string][]Side{"a": {a}}), "claimed, not bound again")
	assert.Equal(t, []string{b.String()}, next.DropUnclaimed())
	old.Close()
	assert.ErrorIs(t, bindIn(ns, "tcp4", "0.0.0.0:9400"), unix.EADDRINUSE, "the next process holds it")
	assert.NoError(t, bindIn(ns, "udp4", "0.0.0.0:9401"), "the unclaimed one was closed")

}

// A side one of this process's own listeners holds (a proxy listener of an
// exposure that moved to nat, not closed yet) is reported as Self.
func TestASideThisProcessListensOnIsSelf(t *testing.T) {
	ns := nstest.New(t, "host")
	var ln net.Listener
	require.NoError(t, ns.Do(func() (err error) {
		ln, err = net.Listen("tcp4", "127.0.0.1:9402")
		return err
	}))
	defer ln.Close()
	s := New(ns.Path, nil)
	defer s.Close()
	var iu *InUseError
	require.ErrorAs(t, s.Sync(map[string][]Side{"a": {side("0.0.0.0:9402", "tcp")}})["a"], &iu)
	assert.True(t, iu.Self, "held by this very process: %v", iu)
}

func TestParseHexAddrPort(t *testing.T) {
	for in, want := range map[string]string{
		"0100007F:2328":                         "127.0.0.1:9000",
		"00000000:0050":                         "0.0.0.0:80",
		"00000000000000000000000001000000:1F90": "[::1]:8080",
		"0000000000000000FFFF00000100007F:0016": "[::ffff:127.0.0.1]:22",
	} {
		ap, ok := parseHexAddrPort(in)
		require.True(t, ok, in)
		assert.Equal(t, want, ap.String(), in)
	}
	for _, bad := range []string{"", "0100007F", "zz:0050", "0100007F:zzzz", "01007F:0050"} {
		_, ok := parseHexAddrPort(bad)
		assert.False(t, ok, bad)
	}
	e, ok := parseLine("   0: 0100007F:2328 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0")
	require.True(t, ok)
	assert.Equal(t, entry{addr: netip.MustParseAddr("127.0.0.1"), port: 9000, state: 0x0A, inode: 12345}, e)
}

func TestOverlaps(t *testing.T) {
	a := netip.MustParseAddr
	assert.True(t, overlaps(a("0.0.0.0"), a("127.0.0.1")))
	assert.True(t, overlaps(a("127.0.0.1"), a("0.0.0.0")))
	assert.False(t, overlaps(a("127.0.0.1"), a("10.0.0.1")))
	assert.True(t, overlaps(a("10.0.0.1"), a("::")), "a dual-stack wildcard")
	assert.True(t, overlaps(a("10.0.0.1"), a("::ffff:10.0.0.1")))
	assert.False(t, overlaps(a("::"), a("10.0.0.1")), "our IPv6 sockets are IPv6 only")
	assert.True(t, overlaps(a("::"), a("::1")))
}
