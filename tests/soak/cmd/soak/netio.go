package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// serve is the guest: an echo server on every address given, until killed.
func serve(addrs []string) {
	var wg sync.WaitGroup
	for _, a := range addrs {
		ln, err := net.Listen("tcp4", a)
		if err != nil {
			fmt.Fprintln(os.Stderr, "serve:", err)
			os.Exit(2)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			short := false
			for {
				c, err := ln.Accept()
				if err != nil {
					if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
						// Callers wait in the accept queue meanwhile, and
						// would read as brokkr losing their bytes: say so.
						if !short {
							fmt.Fprintln(os.Stderr, "serve: out of descriptors; callers wait in the accept queue:", err)
							short = true
						}
						time.Sleep(10 * time.Millisecond)
						continue
					}
					return
				}
				go echo(c)
			}
		}()
	}
	wg.Wait()
}

// echo sends back what c sends, through a buffer of its own: io.Copy
// between two TCP sockets splices through a pipe, two more descriptors for
// every connection it serves, so a server holding 10,000 callers would need
// 30,000 and run out (callers then wait unaccepted, their bytes unanswered).
func echo(c net.Conn) {
	defer c.Close()
	buf := make([]byte, 2048)
	_, _ = io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, buf)
}

// tally is what one caller process saw for one target address.
type tally struct {
	Addr     string `json:"addr"`
	OK       int64  `json:"ok"`
	Refused  int64  `json:"refused"`
	Errors   int64  `json:"errors"`
	BytesIn  int64  `json:"bytesIn"`  // payload the callers sent and got echoed
	BytesOut int64  `json:"bytesOut"` // payload the callers read back
	LastErr  string `json:"lastErr,omitempty"`
	// Refusals seen after the connect succeeded (the proxy's RST), with
	// the last such error: a kernel path refuses at connect.
	RefusedLate int64  `json:"refusedLate"`
	LastRefusal string `json:"lastRefusal,omitempty"`
}

// lateErr marks an error after the connect succeeded.
type lateErr struct{ error }

func (e lateErr) Unwrap() error { return e.error }

func isRefusal(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.EOF)
}

// call opens one connection, echoes msg once and returns the connection;
// a refusal is ECONNREFUSED at connect (nat, socket path) or a RST before
// any echo (the proxy accepts, then resets a caller past the cap).
func call(addr string, msg []byte) (net.Conn, bool, error) {
	c, err := net.DialTimeout("tcp4", addr, 10*time.Second)
	if err != nil {
		return nil, isRefusal(err), err
	}
	return echoOnce(c, msg)
}

func echoOnce(c net.Conn, msg []byte) (net.Conn, bool, error) {
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Write(msg); err != nil {
		c.Close()
		return nil, isRefusal(err), err
	}
	buf := make([]byte, len(msg))
	n, err := io.ReadFull(c, buf)
	if err != nil {
		c.Close()
		return nil, n == 0 && isRefusal(err), lateErr{err}
	}
	_ = c.SetDeadline(time.Time{})
	return c, false, nil
}

// finish closes a caller both ways and waits for the guest's close, so the
// connection has given its place back when the caller says it is done.
func finish(c net.Conn) {
	_ = c.(*net.TCPConn).CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, _ = io.Copy(io.Discard, c)
	c.Close()
}

// loadClient: `load hold ADDR=N,...` opens N connections to each address at
// once, echoes a message on each, prints "held N", holds until stdin closes
// (or -hold passes), closes them and prints the tallies as JSON.
// `load trickle ADDR,...` makes short calls round robin for -dur and prints
// the tallies.
func loadClient(args []string) {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	msgLen := fs.Int("msg", 100, "payload bytes each way per connection")
	hold := fs.Duration("hold", 60*time.Second, "longest hold")
	dur := fs.Duration("dur", 10*time.Second, "trickle length")
	par := fs.Int("par", 256, "dials in flight")
	_ = fs.Parse(args[1:])
	msg := []byte(strings.Repeat("x", *msgLen))
	var out []*tally
	switch args[0] {
	case "hold":
		var mu sync.Mutex
		var held []net.Conn
		var wg sync.WaitGroup
		sem := make(chan struct{}, *par)
		for _, spec := range strings.Split(fs.Arg(0), ",") {
			addr, ns, _ := strings.Cut(spec, "=")
			n, _ := strconv.Atoi(ns)
			t := &tally{Addr: addr}
			out = append(out, t)
			for i := 0; i < n; i++ {
				wg.Add(1)
				sem <- struct{}{}
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					c, ref, err := call(addr, msg)
					mu.Lock()
					defer mu.Unlock()
					switch {
					case err == nil:
						t.OK++
						t.BytesIn += int64(len(msg))
						t.BytesOut += int64(len(msg))
						held = append(held, c)
					case ref:
						t.Refused++
						if _, late := err.(lateErr); late {
							t.RefusedLate++
							t.LastRefusal = err.Error()
						}
					default:
						t.Errors++
						t.LastErr = err.Error()
					}
				}()
			}
		}
		wg.Wait()
		fmt.Printf("held %d\n", len(held))
		done := make(chan struct{})
		go func() { _, _ = io.Copy(io.Discard, os.Stdin); close(done) }()
		select {
		case <-done:
		case <-time.After(*hold):
		}
		for _, c := range held {
			wg.Add(1)
			sem <- struct{}{}
			go func() { defer wg.Done(); defer func() { <-sem }(); finish(c) }()
		}
		wg.Wait()
	case "trickle":
		addrs := strings.Split(fs.Arg(0), ",")
		for _, a := range addrs {
			out = append(out, &tally{Addr: a})
		}
		var stop atomic.Bool
		go func() { time.Sleep(*dur); stop.Store(true) }()
		go func() { _, _ = io.Copy(io.Discard, os.Stdin); stop.Store(true) }()
		// Bounded in time (-dur) and in count.
		for i := 0; i < 2_000_000 && !stop.Load(); i++ {
			t := out[i%len(out)]
			c, ref, err := call(t.Addr, msg)
			switch {
			case err == nil:
				finish(c)
				t.OK++
				t.BytesIn += int64(len(msg))
				t.BytesOut += int64(len(msg))
			case ref:
				t.Refused++
				time.Sleep(5 * time.Millisecond)
			default:
				t.Errors++
				t.LastErr = err.Error()
				time.Sleep(5 * time.Millisecond)
			}
			time.Sleep(2 * time.Millisecond) // a trickle, not a flood
		}
	}
	w := bufio.NewWriter(os.Stdout)
	_ = json.NewEncoder(w).Encode(out)
	_ = w.Flush()
}
