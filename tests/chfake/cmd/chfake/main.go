// Command chfake stands in for the cloud-hypervisor binary in tests:
// `chfake --api-socket path=<socket>` serves the fake API there. The schema
// comes from CHFAKE_SCHEMA (or is looked up beside the working directory),
// misbehaviour from CHFAKE_* (see chfake.BehaviourFromEnv), and
// CHFAKE_REQUEST_LOG names a file that gets one line per request.
package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/brokkr/brokkr/tests/chfake"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "chfake:", err)
		os.Exit(2)
	}
}

func run(args []string) error {
	var sock string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--api-socket" && i+1 < len(args):
			i++
			a = args[i]
		case strings.HasPrefix(a, "--api-socket="):
			a = strings.TrimPrefix(a, "--api-socket=")
		default:
			return fmt.Errorf("unknown argument %q", a)
		}
		sock = strings.TrimPrefix(a, "path=")
	}
	if sock == "" {
		return fmt.Errorf("--api-socket path=<socket> is required")
	}
	b, err := chfake.BehaviourFromEnv()
	if err != nil {
		return err
	}
	wd, _ := os.Getwd()
	specPath, err := chfake.FindSpec(wd)
	if err != nil {
		return err
	}
	doc, err := chfake.LoadSpec(specPath)
	if err != nil {
		return err
	}
	var log io.Writer = io.Discard
	if p := os.Getenv("CHFAKE_REQUEST_LOG"); p != "" {
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return err
		}
		log = f
	}
	srv, err := chfake.New(doc, b, func(code int) {
		os.Remove(sock)
		os.Exit(code)
	}, log)
	if err != nil {
		return err
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for range sigs {
			if !b.IgnoreSIGTERM {
				// Like cloud-hypervisor: SIGTERM ends the VMM cleanly.
				os.Remove(sock)
				os.Exit(0)
			}
		}
	}()
	l, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	// Like older cloud-hypervisor releases, a crash leaves the socket file
	// behind (the next start must deal with it).
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	fmt.Fprintf(os.Stderr, "chfake: pid %d serving %s (schema %s)\n", os.Getpid(), sock, specPath)
	return http.Serve(l, srv)
}
