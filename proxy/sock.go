package proxy

import (
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The proxy accepts its callers and dials its guests on raw descriptors
// rather than through net's Accept and Dial, and makes its own socket calls
// without the runtime's syscall bookkeeping. At high connection rates the
// proxy's cost is its system calls and the Go scheduler's work around them:
//
//   - net's Accept asks getsockname and sets TCP_NODELAY on every accepted
//     socket, and its Dial asks getpeername and getsockname, parses the
//     address string and runs context timers. Here the caller's address
//     comes with accept4, the local one is the listener's own
//     unless it is a wildcard and someone needs it (allowFrom, the PROXY
//     header), and the dial is socket, three setsockopt calls, connect and
//     one more connect once the poller says the socket is writable.
//   - Every call here is non-blocking, so it is made with RawSyscall: a
//     syscall.Syscall marks the thread as in a system call, and the runtime's
//     monitor hands the processor to another thread when one lasts a few
//     tens of microseconds — which a connect or a splice into a veth does,
//     since it runs the receiver's TCP input in the caller's context. Those
//     hand-offs wake and park threads (futex) for nothing.
//
// The descriptors are wrapped in an *os.File, which registers them with the
// runtime's poller (one fcntl and one epoll_ctl), so waiting, deadlines (the
// dial timeout, a freeze for a hand-over) and Close work as for a net.Conn.

// sock is one end of a carried connection: an *os.File holding a socket the
// proxy accepted or dialled, or a *net.TCPConn (a connection handed to
// Carry, or adopted from a hand-over).
type sock interface {
	io.ReadWriteCloser
	syscall.Conn
	SetDeadline(time.Time) error
}

// rawFile wraps a non-blocking socket descriptor for the poller.
func rawFile(fd int) *os.File { return os.NewFile(uintptr(fd), "tcp") }

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func sysSplice(in, out, n, flags int) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(in), 0, uintptr(out), 0, uintptr(n), uintptr(flags))
	return int(r), errnoErr(e)
}

func sysRecv(fd int, b []byte) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), 0, 0, 0)
	return int(r), errnoErr(e)
}

// sysSend sends without SIGPIPE: a peer gone is an error, not a signal.
func sysSend(fd int, b []byte) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_SENDTO, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), unix.MSG_NOSIGNAL, 0, 0)
	return int(r), errnoErr(e)
}

func sysSetsockoptInt(fd, level, opt, v int) error {
	iv := int32(v)
	_, _, e := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt), uintptr(unsafe.Pointer(&iv)), 4, 0)
	return errnoErr(e)
}

// sockaddr is a socket address in the kernel's layout.
type sockaddr struct {
	raw unix.RawSockaddrAny
	len uint32
}

func (sa *sockaddr) set(ap netip.AddrPort) {
	a := ap.Addr().Unmap()
	port := ap.Port()
	if a.Is4() {
		p := (*unix.RawSockaddrInet4)(unsafe.Pointer(&sa.raw))
		*p = unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: a.As4()}
		pb := (*[2]byte)(unsafe.Pointer(&p.Port))
		pb[0], pb[1] = byte(port>>8), byte(port)
		sa.len = unix.SizeofSockaddrInet4
		return
	}
	p := (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa.raw))
	*p = unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: a.As16()}
	if z := a.Zone(); z != "" { // a link-local guest address names its link
		if ifi, err := net.InterfaceByName(z); err == nil {
			p.Scope_id = uint32(ifi.Index)
		} else if n, err := strconv.ParseUint(z, 10, 32); err == nil {
			p.Scope_id = uint32(n)
		}
	}
	pb := (*[2]byte)(unsafe.Pointer(&p.Port))
	pb[0], pb[1] = byte(port>>8), byte(port)
	sa.len = unix.SizeofSockaddrInet6
}

// noZone is ap without a link-local address's zone: the form accept4 and
// getsockname give here, which allowFrom's prefixes match (a prefix
// contains no address with a zone).
func noZone(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().WithZone(""), ap.Port())
}

// addrPort reads an IPv4 or IPv6 address (zone left out); the zero
// AddrPort for any other family.
func (sa *sockaddr) addrPort() netip.AddrPort {
	switch sa.raw.Addr.Family {
	case unix.AF_INET:
		p := (*unix.RawSockaddrInet4)(unsafe.Pointer(&sa.raw))
		pb := (*[2]byte)(unsafe.Pointer(&p.Port))
		return netip.AddrPortFrom(netip.AddrFrom4(p.Addr), uint16(pb[0])<<8|uint16(pb[1]))
	case unix.AF_INET6:
		p := (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa.raw))
		pb := (*[2]byte)(unsafe.Pointer(&p.Port))
		return netip.AddrPortFrom(netip.AddrFrom16(p.Addr), uint16(pb[0])<<8|uint16(pb[1]))
	}
	return netip.AddrPort{}
}

// rawListener is a TCP listener the proxy accepts from on raw descriptors.
// It takes a *net.TCPListener's socket over: the descriptor is duplicated
// into an *os.File, whose RawConn can wait for callers (a TCPListener's
// cannot: its Read is EINVAL), and the TCPListener is closed, so the socket
// costs one descriptor, as the descriptor budget counts it
// (TestAListenerHoldsOneDescriptor). It is the exposure's net.Listener:
// Close ends the accept loop, File duplicates the socket for a hand-over or
// systemd's fd store.
type rawListener struct {
	f    *os.File
	rc   syscall.RawConn
	addr *net.TCPAddr
	// What try left for accept, which has one caller at a time (the
	// accept loop): the caller's socket and address, or the error.
	sa  sockaddr
	fd  int
	err error
	try func(uintptr) bool
}

// newRawListener takes ln's socket over and closes ln; on an error ln is
// left as it was.
func newRawListener(ln *net.TCPListener) (*rawListener, error) {
	addr, ok := ln.Addr().(*net.TCPAddr)
	if !ok {
		return nil, net.UnknownNetworkError(ln.Addr().Network())
	}
	f, err := dupFile(ln)
	if err != nil {
		return nil, err
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	// TCP_NODELAY on the listener, once: accepted sockets inherit it (as
	// they do the keepalive settings listenConfig gives it), so accept
	// makes no setsockopt per caller. Set here, not in listenConfig, so a
	// listener taken over from an earlier process gets it too.
	if err := rc.Control(func(fd uintptr) {
		_ = sysSetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	}); err != nil {
		f.Close()
		return nil, err
	}
	l := &rawListener{f: f, rc: rc, addr: addr}
	l.try = func(lfd uintptr) bool {
		for {
			l.sa.len = unix.SizeofSockaddrAny
			r, _, e := unix.RawSyscall6(unix.SYS_ACCEPT4, lfd, uintptr(unsafe.Pointer(&l.sa.raw)),
				uintptr(unsafe.Pointer(&l.sa.len)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
			switch e {
			case 0:
				l.fd, l.err = int(r), nil
				return true
			case unix.EINTR, unix.ECONNABORTED: // a caller that left from the queue
				continue
			case unix.EAGAIN:
				return false
			}
			l.fd, l.err = -1, os.NewSyscallError("accept4", e)
			return true
		}
	}
	ln.Close()
	return l, nil
}

func (l *rawListener) Addr() net.Addr { return l.addr }

// Close closes the socket; a wait in accept returns an error.
func (l *rawListener) Close() error { return l.f.Close() }

// File returns a duplicate of the socket.
func (l *rawListener) File() (*os.File, error) { return dupFile(l.f) }

// Accept makes rawListener a net.Listener; the accept loop calls accept.
func (l *rawListener) Accept() (net.Conn, error) {
	f, _, err := l.accept()
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return net.FileConn(f)
}

// accept waits for the next caller: its socket, registered with the
// poller, and its address.
func (l *rawListener) accept() (*os.File, netip.AddrPort, error) {
	if err := l.rc.Read(l.try); err != nil {
		return nil, netip.AddrPort{}, err
	}
	if l.err != nil {
		return nil, netip.AddrPort{}, l.err
	}
	// TCP_NODELAY comes from the listener (newRawListener).
	return rawFile(l.fd), l.sa.addrPort(), nil
}

// sockLocalAddr asks a socket for its local address (getsockname).
func sockLocalAddr(s sock) netip.AddrPort {
	if tc, ok := s.(*net.TCPConn); ok {
		if a, ok := tc.LocalAddr().(*net.TCPAddr); ok {
			return noZone(a.AddrPort())
		}
		return netip.AddrPort{}
	}
	var sa sockaddr
	sa.len = unix.SizeofSockaddrAny
	_ = control(s, func(fd int) error {
		_, _, e := unix.RawSyscall(unix.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&sa.raw)), uintptr(unsafe.Pointer(&sa.len)))
		return errnoErr(e)
	})
	return sa.addrPort()
}

// control runs f on s's descriptor, which stays open meanwhile.
func control(s sock, f func(fd int) error) error {
	rc, err := s.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = f(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// closeWrite half-closes s: the peer reads EOF, the other direction flows on.
func closeWrite(s sock) error {
	if tc, ok := s.(*net.TCPConn); ok {
		return tc.CloseWrite()
	}
	return control(s, func(fd int) error {
		_, _, e := unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), unix.SHUT_WR, 0)
		return errnoErr(e)
	})
}

// setLinger0 makes the close of s send a RST.
func setLinger0(s sock) {
	_ = control(s, func(fd int) error {
		return unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	})
}

// dupFile duplicates c's descriptor into an *os.File of its own
// (close-on-exec; registered with the poller when the socket is
// non-blocking): for a hand-over, systemd's fd store, or a rawListener.
// Not net's File, whose Fd would switch the shared socket to blocking mode
// (see rawFds in cmd/brokkrd), where a raw accept4 or recvfrom would block
// holding its processor.
func dupFile(c syscall.Conn) (*os.File, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, os.NewSyscallError("fcntl", derr)
	}
	return os.NewFile(uintptr(nfd), "tcp"), nil
}

// dialTCP connects to a guest: TCP_NODELAY (the caller's bytes go on as
// they come, as net.Dial's sockets do) and keepalive with an idle time set
// before connect, so a guest that vanished is noticed within minutes and
// gives its place under the cap back. A dial that is not through within
// timeout fails.
func dialTCP(to netip.AddrPort, timeout time.Duration) (*os.File, error) {
	var sa sockaddr
	sa.set(to)
	family := unix.AF_INET6
	if sa.raw.Addr.Family == unix.AF_INET {
		family = unix.AF_INET
	}
	r, _, e := unix.RawSyscall(unix.SYS_SOCKET, uintptr(family), unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if e != 0 {
		return nil, dialErr(to, os.NewSyscallError("socket", e))
	}
	fd := int(r)
	for _, o := range [...]struct{ level, opt, v int }{
		{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(keepIdle / time.Second)},
	} {
		if err := sysSetsockoptInt(fd, o.level, o.opt, o.v); err != nil {
			unix.Close(fd)
			return nil, dialErr(to, os.NewSyscallError("setsockopt", err))
		}
	}
	conn := func(fd int) syscall.Errno {
		_, _, e := unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa.raw)), uintptr(sa.len))
		return e
	}
	switch e := conn(fd); e {
	case 0:
		return rawFile(fd), nil
	case unix.EINPROGRESS, unix.EINTR:
	default:
		unix.Close(fd)
		return nil, dialErr(to, os.NewSyscallError("connect", e))
	}
	// Registered with the poller only now, after connect: a socket still
	// connecting reports no readiness, so no wake-up is missed — and the
	// first check below (a second connect: 0 once established, EALREADY
	// while not, the error once failed) sees any state change an event
	// about it could have reported before the wait began.
	f := rawFile(fd)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, dialErr(to, err)
	}
	_ = f.SetWriteDeadline(time.Now().Add(timeout))
	var cerr error
	err = rc.Write(func(fd uintptr) bool {
		switch e := conn(int(fd)); e {
		case 0, unix.EISCONN:
			return true
		case unix.EALREADY, unix.EINPROGRESS, unix.EINTR:
			return false
		default:
			cerr = os.NewSyscallError("connect", e)
			return true
		}
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		f.Close()
		return nil, dialErr(to, err)
	}
	_ = f.SetWriteDeadline(time.Time{})
	return f, nil
}

func dialErr(to netip.AddrPort, err error) error {
	return &net.OpError{Op: "dial", Net: "tcp", Addr: net.TCPAddrFromAddrPort(to), Err: err}
}
