package proxy

import (
	"sync"

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

var pipePool struct {
	mu   sync.Mutex
	free []*pipe
}

// getPipe returns an empty pipe, or nil if none can be made.
func getPipe() *pipe {
	pipePool.mu.Lock()
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
		if len(pipePool.free) < idlePipes {
			pipePool.free = append(pipePool.free, p)
			pipePool.mu.Unlock()
			return
		}
		pipePool.mu.Unlock()
	}
	unix.Close(p.r)
	unix.Close(p.w)
}
