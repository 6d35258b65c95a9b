// Command brokkr is the CLI for brokkrd. It talks to the daemon over its
// unix socket, except `validate` (offline) and `stats` (reads the pinned BPF
// map directly, so it works with the daemon down).
//
// Exit status: 0 ok, 1 user error (bad config, unknown VM, bad flags),
// 2 daemon or system error (daemon unreachable, kernel error), 3 from
// `brokkr status` while any VM or exposure is failed.
package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/brokkr/brokkr/daemon/api"
)

func main() {
	root := newRoot()
	root.SetArgs(socketFirst(os.Args[1:]))
	err := root.Execute()
	os.Exit(report(err))
}

// userError marks an error as the caller's (exit 1).
type userError struct{ err error }

func (e userError) Error() string { return e.err.Error() }
func (e userError) Unwrap() error { return e.err }

func userf(format string, a ...any) error { return userError{fmt.Errorf(format, a...)} }

// silentError carries an exit code for something already printed.
type silentError struct{ code int }

func (e silentError) Error() string { return fmt.Sprintf("exit %d", e.code) }

func exitCode(err error) int {
	var se silentError
	var ue userError
	var he *api.HTTPError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &se):
		return se.code
	case errors.As(err, &ue):
		return 1
	case strings.HasPrefix(err.Error(), "unknown command"):
		return 1
	case errors.As(err, &he):
		if he.UserError() {
			return 1
		}
		return 2
	}
	return 2
}

func report(err error) int {
	code := exitCode(err)
	var se silentError
	if err != nil && !errors.As(err, &se) {
		fmt.Fprintln(os.Stderr, "brokkr:", err)
	}
	return code
}
