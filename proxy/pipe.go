package proxy

import (
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// maxPipe is the size asked for each splice pipe: one splice moves up to this
// much, so a bulk stream costs two syscalls per MiB.
const maxPipe = 1 << 20

// idlePipes bounds the pipes kept for reuse. A pipe is held only while bytes
// pass through it, so a few serve many connections; beyond this, a pipe given
// back after a burst is closed rather than kept.
const idlePipes = 16

// pipe is a splice pipe; queued is how many bytes sit in it.
type pipe struct {
	r, w   int
	queued int
}

// pipeIdle is how long the pool keeps its pipes once none was taken or
// given back: a whole period without use closes them, so a daemon at rest
// after a burst holds no extra descriptors.
var pipeIdle = 30 * time.Second

var pipePool struct {
	mu   sync.Mutex
	free []*pipe
	used bool        // a get or put since the trim last looked
	trim *time.Timer // armed while free is not empty
}

// trimPipes closes the pooled pipes after a whole pipeIdle without use. A
// flag, not a clock read, marks use: gets and puts are on the data path.
func trimPipes() {
	pipePool.mu.Lock()
	defer pipePool.mu.Unlock()
	if pipePool.used && len(pipePool.free) > 0 {
		pipePool.used = false
		pipePool.trim.Reset(pipeIdle)
		return
	}
	for _, p := range pipePool.free {
		unix.Close(p.r)
		unix.Close(p.w)
	}
	pipePool.free = nil
	pipePool.trim = nil
}

// getPipe returns an empty pipe, or nil if none can be made.
func getPipe() *pipe {
	pipePool.mu.Lock()
	pipePool.used = true
	if n := len(pipePool.free); n > 0 {
		p := pipePool.free[n-1]
		pipePool.free = pipePool.free[:n-1]
		pipePool.mu.Unlock()
		return p
	}
	pipePool.mu.Unlock()
	return newPipe()
}

// newPipe makes a pipe; a variable so a test can stand in for a process out
// of descriptors.
var newPipe = makePipe

func makePipe() *pipe {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil
	}
	// Best effort: without it the pipe keeps the default 64 KiB.
	_, _ = unix.FcntlInt(uintptr(fds[0]), unix.F_SETPIPE_SZ, maxPipe)
	return &pipe{r: fds[0], w: fds[1]}
}

// putPipe keeps an empty pipe for reuse; a pipe still holding bytes (its
// connection failed mid-copy) or one beyond idlePipes is closed.
func putPipe(p *pipe) {
	if p == nil {
		return
	}
	if p.queued == 0 {
		pipePool.mu.Lock()
		pipePool.used = true
		if len(pipePool.free) < idlePipes {
			pipePool.free = append(pipePool.free, p)
			if pipePool.trim == nil {
				pipePool.trim = time.AfterFunc(pipeIdle, trimPipes)
			}
			pipePool.mu.Unlock()
			return
		}
		pipePool.mu.Unlock()
	}
	unix.Close(p.r)
	unix.Close(p.w)
}

// chunkSize is the small buffer a direction copies through before it
// switches to splice (copyHalf).
const chunkSize = 16 << 10

// chunk is a direction's small buffer: bytes read and how many of them
// were written on.
type chunk struct {
	buf     [chunkSize]byte
	n, sent int
}

func (c *chunk) unsent() []byte { return c.buf[c.sent:c.n] }

var chunks = sync.Pool{New: func() any { return new(chunk) }}

func getChunk() *chunk { return chunks.Get().(*chunk) }

func putChunk(c *chunk) {
	if c != nil {
		c.n, c.sent = 0, 0
		chunks.Put(c)
	}
}
