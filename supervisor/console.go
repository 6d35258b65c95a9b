package supervisor

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"time"
)

// cappedLog appends to path and, when the next write would take it past max
// bytes, renames it to path.1 (replacing an older one) and starts afresh. So
// the console never takes more than about 2*max on disk, and the newest
// output is always kept.
type cappedLog struct {
	path string
	max  int64
	f    *os.File
	size int64
}

func openCappedLog(path string, max int64) (*cappedLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &cappedLog{path: path, max: max, f: f, size: fi.Size()}, nil
}

func (c *cappedLog) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		room := c.max - c.size
		if room <= 0 {
			if err := c.rotate(); err != nil {
				return written, err
			}
			room = c.max
		}
		chunk := p
		if int64(len(chunk)) > room {
			chunk = chunk[:room]
		}
		n, err := c.f.Write(chunk)
		written += n
		c.size += int64(n)
		if err != nil {
			return written, err
		}
		p = p[n:]
	}
	return written, nil
}

func (c *cappedLog) rotate() error {
	if err := c.f.Close(); err != nil {
		return err
	}
	if err := os.Rename(c.path, c.path+".1"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	f, err := os.OpenFile(c.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	c.f, c.size = f, 0
	return nil
}

func (c *cappedLog) Close() error { return c.f.Close() }

// copyConsole copies the guest's output from the VMM's serial socket into
// the capped log until the VMM closes it or ctx ends: from conn, the
// connection the backend handed over (Instance.Console), else from a new
// connection to socket. The VMM may create the socket a moment after it
// reports the VM running, so the connect is retried briefly. Output the
// guest writes while nobody is connected (the daemon is down) is lost: that
// is the price of never letting a full disk or a dead reader stall the
// guest. While the daemon runs a reader is connected all along.
func copyConsole(ctx context.Context, conn net.Conn, socket, logPath string, max int64) error {
	var err error
	var d net.Dialer
	for i := 0; conn == nil && i < 100; i++ {
		conn, err = d.DialContext(ctx, "unix", socket)
		if err == nil || ctx.Err() != nil {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	if conn == nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	out, err := openCappedLog(logPath, max)
	if err != nil {
		return err
	}
	defer out.Close()
	_, err = io.Copy(out, conn)
	if ctx.Err() != nil {
		return nil
	}
	return err
}
