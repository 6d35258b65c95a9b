package qemu

import (
	"context"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// consoleWatch reads the guest's serial console from qemu's console socket
// while Start runs (the KVM probe asks it whether the guest printed),
// appending what it reads to the console log; handOver then gives the
// connection itself to the engine's copy, which continues after it.
type consoleWatch struct {
	conn net.Conn
	got  atomic.Bool
	wg   sync.WaitGroup
}

func watchConsole(ctx context.Context, sock, logPath string) (*consoleWatch, error) {
	var d net.Dialer
	var conn net.Conn
	var err error
	for end := time.Now().Add(3 * time.Second); ; {
		conn, err = d.DialContext(ctx, "unix", sock)
		if err == nil || ctx.Err() != nil || time.Now().After(end) {
			break
		}
		time.Sleep(20 * time.Millisecond) // qemu may still be creating it
	}
	if err != nil {
		return nil, err
	}
	return newConsoleWatch(conn, logPath), nil
}

// newConsoleWatch reads conn into the console log at logPath until
// handOver or close.
func newConsoleWatch(conn net.Conn, logPath string) *consoleWatch {
	w := &consoleWatch{conn: conn}
	var err error
	var out io.Writer = io.Discard
	var f *os.File
	if logPath != "" {
		if f, err = os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640); err == nil {
			out = f
		}
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		if f != nil {
			defer f.Close()
		}
		buf := make([]byte, 4096)
		for {
			n, err := conn.Read(buf)
			if n > 0 {
				w.got.Store(true)
				_, _ = out.Write(buf[:n])
			}
			if err != nil {
				return // EOF (qemu gone) or closed by close()
			}
		}
	}()
	return w
}

func (w *consoleWatch) printed() bool { return w.got.Load() }

// handOver stops the reader and returns the connection, still connected:
// what the reader read is in the log, what it did not is still in the
// socket for the next reader. Nothing is lost between the two.
func (w *consoleWatch) handOver() net.Conn {
	_ = w.conn.SetReadDeadline(time.Now()) // wakes the reader
	w.wg.Wait()
	_ = w.conn.SetReadDeadline(time.Time{})
	return w.conn
}

// close disconnects, so qemu accepts the engine's connection next.
func (w *consoleWatch) close() {
	w.conn.Close()
	w.wg.Wait()
}
