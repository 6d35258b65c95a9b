// Command connrate is the proxy benchmark's short-connection load and its
// guest-side responder.
//
//	connrate -serve ADDR              echo whatever arrives until the caller closes
//	connrate -serve-pp ADDR           the same after reading a PROXY protocol header (v1 or v2)
//	connrate -rate ADDR -c 8 -d 4s    connect, send 1 byte, read 1 byte, close; print conns/s
//	connrate -hold ADDR -n 1000       open n connections, one exchange each, print "held n",
//	                                  keep them until stdin closes
package main

import (
	"bufio"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	serve := flag.String("serve", "", "address to serve an echo on")
	servePP := flag.String("serve-pp", "", "address to serve an echo on, each connection led by a PROXY header")
	rate := flag.String("rate", "", "address to measure the connection rate against")
	hold := flag.String("hold", "", "address to hold idle connections to")
	workers := flag.Int("c", 8, "concurrent connectors")
	dur := flag.Duration("d", 4*time.Second, "measurement length")
	n := flag.Int("n", 1000, "connections to hold")
	flag.Parse()
	switch {
	case *serve != "":
		runServe(*serve, false)
	case *servePP != "":
		runServe(*servePP, true)
	case *rate != "":
		runRate(*rate, *workers, *dur)
	case *hold != "":
		runHold(*hold, *n)
	default:
		flag.Usage()
		os.Exit(2)
	}
}

func runServe(addr string, pp bool) {
	ln, err := net.Listen("tcp", addr)
	check(err)
	for {
		c, err := ln.Accept()
		if err != nil {
			time.Sleep(time.Millisecond)
			continue
		}
		go func() {
			defer c.Close()
			if !pp {
				io.Copy(c, c)
				return
			}
			r := bufio.NewReader(c)
			if skipPPHeader(r) != nil {
				return
			}
			io.Copy(c, r)
		}()
	}
}

// skipPPHeader reads a PROXY protocol header: a v1 line, or v2's 16 bytes
// and the addresses they announce.
func skipPPHeader(r *bufio.Reader) error {
	sig, err := r.Peek(12)
	if err != nil {
		return err
	}
	if string(sig) == "\r\n\r\n\x00\r\nQUIT\n" {
		var h [16]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			return err
		}
		_, err := r.Discard(int(binary.BigEndian.Uint16(h[14:])))
		return err
	}
	line, err := r.ReadString('\n')
	if err == nil && !strings.HasPrefix(line, "PROXY ") {
		err = fmt.Errorf("not a PROXY header: %q", line)
	}
	return err
}

func exchange(c net.Conn) error {
	if _, err := c.Write([]byte{'x'}); err != nil {
		return err
	}
	_, err := io.ReadFull(c, make([]byte, 1))
	return err
}

func runRate(addr string, workers int, dur time.Duration) {
	var done, failed atomic.Int64
	stop := time.Now().Add(dur)
	var wg sync.WaitGroup
	lat := make([][]time.Duration, workers)
	for i := 0; i < workers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				t0 := time.Now()
				c, err := net.DialTimeout("tcp", addr, 2*time.Second)
				if err != nil {
					failed.Add(1)
					continue
				}
				c.SetDeadline(time.Now().Add(2 * time.Second))
				if exchange(c) == nil {
					done.Add(1)
				} else {
					failed.Add(1)
				}
				c.Close()
				lat[i] = append(lat[i], time.Since(t0))
			}
		}()
	}
	wg.Wait()
	var all []time.Duration
	for _, l := range lat {
		all = append(all, l...)
	}
	slices.Sort(all)
	pct := func(q float64) int64 {
		if len(all) == 0 {
			return 0
		}
		return all[int(q*float64(len(all)-1))].Microseconds()
	}
	// connect, one byte each way, close: the whole short connection.
	fmt.Printf("%.0f conns/s (%d ok, %d failed) p50=%dus p99=%dus\n", float64(done.Load())/dur.Seconds(), done.Load(), failed.Load(), pct(0.50), pct(0.99))
}

func runHold(addr string, n int) {
	conns := make([]net.Conn, 0, n)
	for len(conns) < n {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		check(err)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		check(exchange(c))
		c.SetDeadline(time.Time{})
		conns = append(conns, c)
	}
	fmt.Println("held", len(conns))
	io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		c.Close()
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "connrate:", err)
		os.Exit(1)
	}
}
