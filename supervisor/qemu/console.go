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
// while Start probes KVM, appending what it reads to the console log so the
// engine's copy, which connects once Start returns, continues after it.
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
	w := &consoleWatch{conn: conn}
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
	return w, nil
}

func (w *consoleWatch) printed() bool { return w.got.Load() }

// close disconnects, so qemu accepts the engine's connection next.
func (w *consoleWatch) close() {
	w.conn.Close()
	w.wg.Wait()
}
