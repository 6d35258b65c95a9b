package main

import (
	"crypto/sha256"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/brokkr/brokkr/bpf"
	"github.com/brokkr/brokkr/internal/spec"
	"github.com/brokkr/brokkr/proxy"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// handoverRoleEnv makes this test binary play a new process that fails a
// hand-over in one of the ways the old process must survive.
const handoverRoleEnv = "BRK_HANDOVER_ROLE"

// handoverRole is the failing new process: "exit" exits at once, "die"
// takes the descriptors and exits without a word, "late" takes them and
// says ready only after the old process gave up, "mute" never reads.
func handoverRole(role string) int {
	switch role {
	case "exit":
		return 3
	case "die", "late":
		h, err := receiveHandover()
		if err != nil {
			return 4
		}
		if role == "late" {
			time.Sleep(30 * time.Second) // killed long before
			_ = h.confirm()
		}
		return 3
	case "mute":
		time.Sleep(30 * time.Second)
		return 3
	}
	return 5
}

// loopbackSpec is a TCP proxy exposure "web" on 127.0.0.1 (a port the OS
// picks) to guestPort of vm1.
func loopbackSpec(guestPort int) proxy.Spec {
	return proxy.Spec{Exposure: spec.Exposure{Name: "web", Target: spec.Target{VM: "vm1"}, Proto: "tcp",
		GuestPort: uint16(guestPort)}, Listen: netip.MustParseAddr("127.0.0.1")}
}

// echoGuest is a guest service on loopback that sends back what it reads.
func echoGuest(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// A new process that fails the hand-over in any way leaves the old one
// serving: the listener is bound again from the same socket (a caller that
// arrived meanwhile queued in its backlog), the connection frozen mid
// transfer carries on with its in-flight bytes, and the counters are exact.
func TestAFailedHandOverLeavesTheOldProcessServing(t *testing.T) {
	old := readyTimeout
	readyTimeout = 2 * time.Second
	t.Cleanup(func() { readyTimeout = old })
	for _, role := range []string{"exit", "die", "late", "mute"} {
		t.Run(role, func(t *testing.T) { failedHandOver(t, role) })
	}
}

func failedHandOver(t *testing.T, role string) {
	dir := t.TempDir()
	store := bpf.NewInMemory("test")
	guest := echoGuest(t)
	resolve := func(string) string { return "127.0.0.1" }
	px := proxy.NewManager(resolve, store)
	defer px.StopAll()
	spec := loopbackSpec(guest)
	st := px.Converge([]proxy.Spec{spec})
	require.Len(t, st, 1)
	require.Equal(t, proxy.StateActive, st[0].State, st[0].Reason)
	addr := st[0].BoundAddr

	lock, err := os.Create(filepath.Join(dir, "brokkrd.lock"))
	require.NoError(t, err)
	defer lock.Close()
	apiLn, err := net.Listen("unix", filepath.Join(dir, "api.sock"))
	require.NoError(t, err)
	defer apiLn.Close()
	upLn, err := net.Listen("unix", filepath.Join(dir, "up.sock"))
	require.NoError(t, err)
	defer upLn.Close()
	s := &system{px: px, lock: lock, store: store}
	upgrades := make(chan upgradeReq)
	upDone := make(chan struct{})
	go func() { serveUpgrades(upLn, upgrades); close(upDone) }()

	// A long transfer, frozen with its echo backed up in the proxy: the
	// caller reads nothing until after the hand-over failed.
	const size = 8 << 20
	c1, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c1.Close()
	sent := sha256.New()
	wrote := make(chan error, 1)
	go func() {
		r := rand.New(rand.NewPCG(3, 4))
		buf := make([]byte, 64<<10)
		for left := size; left > 0; left -= len(buf) {
			for i := range buf {
				buf[i] = byte(r.Uint32())
			}
			sent.Write(buf)
			if _, err := c1.Write(buf); err != nil {
				wrote <- err
				return
			}
		}
		wrote <- nil
	}()
	sl, err := store.Attach("web", bpf.ProtoNumber("tcp"), 0)
	require.NoError(t, err)
	defer sl.Release(false)
	// Frozen once the transfer stalls: both directions then wait in the
	// middle of a pipeful, so in-flight bytes travel in the state, more
	// than a socketpair's buffer holds.
	last := uint64(0)
	require.Eventually(t, func() bool {
		c := sl.Read()
		stalled := c.BytesOut > 1<<20 && c.BytesIn+c.BytesOut == last
		last = c.BytesIn + c.BytesOut
		return stalled
	}, 10*time.Second, 100*time.Millisecond)

	t.Setenv(handoverRoleEnv, role)
	start := time.Now()
	_, err = s.handOver(upgradeReq{Exe: os.Args[0], Args: []string{"-test.run=^$"}}, apiLn, upLn, nil,
		slog.New(slog.NewTextHandler(io.Discard, nil)))
	took := time.Since(start)
	require.Error(t, err, "the failure is reported")
	t.Logf("%s: %v (after %s)", role, err, took.Round(time.Millisecond))
	assert.Less(t, took, readyTimeout+time.Second, "the old process waits no longer than readyTimeout")

	// The sockets sent stay in non-blocking mode: the upgrade socket's
	// accept loop still ends at Close, as a shutdown needs, after a client
	// that hung up put it back into accept(2).
	uc, err := net.Dial("unix", filepath.Join(dir, "up.sock"))
	require.NoError(t, err)
	uc.Close()
	time.Sleep(100 * time.Millisecond)
	go upLn.Close()
	select {
	case <-upDone:
	case <-time.After(2 * time.Second):
		t.Fatal("closing the upgrade socket does not end its accept loop: the hand-over left it in blocking mode")
	}

	// Between the failure and the next pass the socket is not bound by the
	// proxy, yet still open: a caller queues.
	c2, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(t, err, "the listening socket stayed open")
	defer c2.Close()
	st = px.Converge([]proxy.Spec{spec}) // the restarted control loop's pass
	require.Equal(t, proxy.StateActive, st[0].State, st[0].Reason)
	require.Equal(t, addr, st[0].BoundAddr, "the same socket, not a new bind")
	require.NoError(t, c2.SetDeadline(time.Now().Add(5*time.Second)))
	_, err = c2.Write([]byte("late"))
	require.NoError(t, err)
	b := make([]byte, 4)
	_, err = io.ReadFull(c2, b)
	require.NoError(t, err, "the caller that queued is carried")
	assert.Equal(t, "late", string(b))
	c2.Close()

	require.NoError(t, c1.SetDeadline(time.Now().Add(20*time.Second)))
	got := sha256.New()
	n, err := io.CopyN(got, c1, size)
	require.NoError(t, err, "the frozen transfer carries on (%d of %d bytes back)", n, size)
	require.NoError(t, <-wrote)
	assert.Equal(t, sent.Sum(nil), got.Sum(nil), "every byte back, in order, once")
	c1.Close()

	require.Eventually(t, func() bool { _, p := sl.Shares(); return p == 0 }, 5*time.Second, 5*time.Millisecond)
	c := sl.Read()
	assert.EqualValues(t, 2, c.Accepted, "each caller counted once")
	assert.EqualValues(t, size+4, c.BytesIn)
	assert.EqualValues(t, size+4, c.BytesOut)
	assert.Zero(t, c.Active+c.Dropped+c.Refused)
}

// Keeping a listener in systemd's fd store leaves the proxy's own listener
// as it was: a later Close (a freeze, a changed exposure, a stop) returns at
// once instead of waiting in accept(2) for the next caller.
func TestTheFDStoreLeavesTheListenerClosable(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "notify.sock")
	sd, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	require.NoError(t, err)
	defer sd.Close()
	t.Setenv("NOTIFY_SOCKET", path)

	px := proxy.NewManager(func(string) string { return "127.0.0.1" }, bpf.NewInMemory("test"))
	spec := loopbackSpec(echoGuest(t))
	st := px.Converge([]proxy.Spec{spec})
	require.Equal(t, proxy.StateActive, st[0].State, st[0].Reason)
	store := newFDStore(slog.New(slog.NewTextHandler(io.Discard, nil)))
	store.sync(px)

	buf, oob := make([]byte, 512), make([]byte, 128)
	n, oobn, _, _, err := sd.ReadMsgUnix(buf, oob)
	require.NoError(t, err)
	assert.Contains(t, string(buf[:n]), "FDSTORE=1")
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	require.NoError(t, err)
	require.Len(t, msgs, 1)
	fds, err := unix.ParseUnixRights(&msgs[0])
	require.NoError(t, err)
	require.Len(t, fds, 1, "the listener travels with the message")
	defer unix.Close(fds[0])
	// A caller puts the accept goroutine back into accept(2): on a socket
	// switched to blocking mode it would now sleep in the kernel, where
	// Close cannot wake it. Without a caller it stays parked in the poller
	// either way, and the test could not tell.
	c, err := net.Dial("tcp", st[0].BoundAddr)
	require.NoError(t, err)
	c.Close()
	time.Sleep(100 * time.Millisecond)

	stopped := make(chan struct{})
	go func() { px.StopAll(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(2 * time.Second):
		c, err := net.Dial("tcp", st[0].BoundAddr) // wakes the accept, so the test can end
		if err == nil {
			defer c.Close()
		}
		<-stopped
		t.Fatal("StopAll waited for a caller: storing the listener switched it to blocking mode")
	}
}

// A process that handed over exits as soon as its upgrade socket's loop
// ends: the loop must not end before the reply of a request it passed on
// is written, or `brokkrd --upgrade` reads EOF while the new process
// serves. The reply here comes only after the socket is closed, the
// latest it can.
func TestTheUpgradeSocketAnswersBeforeItsLoopEnds(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "up.sock"))
	require.NoError(t, err)
	reqs := make(chan upgradeReq)
	done := make(chan struct{})
	go func() { serveUpgrades(ln, reqs); close(done) }()

	c, err := net.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, json.NewEncoder(c).Encode(upgradeReq{Exe: "/new/brokkrd"}))
	r := <-reqs
	assert.Equal(t, "/new/brokkrd", r.Exe)
	ln.Close()
	select {
	case <-done:
		t.Fatal("the loop ended with a reply it took the request for still to write")
	case <-time.After(100 * time.Millisecond):
	}
	r.reply <- upgradeReply{PID: 4242}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the upgrade socket's loop did not end")
	}
	// Written before the loop ended: there at once, not on its way.
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Millisecond)))
	var got upgradeReply
	require.NoError(t, json.NewDecoder(c).Decode(&got), "the reply was written before serveUpgrades returned")
	assert.Equal(t, 4242, got.PID)
}

// A client that connects and sends nothing, or whose request nobody takes,
// does not keep the loop from ending.
func TestTheUpgradeSocketEndsWithAnIdleClient(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "up.sock"))
	require.NoError(t, err)
	reqs := make(chan upgradeReq) // nobody takes
	done := make(chan struct{})
	go func() { serveUpgrades(ln, reqs); close(done) }()
	idle, err := net.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer idle.Close()
	asking, err := net.Dial("unix", ln.Addr().String())
	require.NoError(t, err)
	defer asking.Close()
	require.NoError(t, json.NewEncoder(asking).Encode(upgradeReq{Exe: "/new/brokkrd"}))
	time.Sleep(50 * time.Millisecond)
	ln.Close()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("the upgrade socket's loop waits for clients that will never be answered")
	}
}
