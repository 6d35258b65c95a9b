package main

import "syscall"

type syscallRlimit struct{ cur, max uint64 }

func (r *syscallRlimit) get() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil {
		r.cur, r.max = l.Cur, l.Max
	}
}
