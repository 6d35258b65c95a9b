package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

var fuzzFunc = regexp.MustCompile(`(?m)^func (Fuzz\w+)\(`)

// goFuzz runs every `func Fuzz` target of the module for SOAK_FUZZTIME.
func (x *h) goFuzz() {
	ft := os.Getenv("SOAK_FUZZTIME")
	if ft == "" {
		ft = "10s"
	}
	out, err := exec.Command("git", "grep", "-l", "^func Fuzz", "--", "*_test.go").Output()
	if err != nil {
		x.fail("fuzz: git grep: %v", err)
		return
	}
	targets := 0
	for _, f := range strings.Fields(string(out)) {
		src, _ := os.ReadFile(f)
		pkg := "./" + f[:strings.LastIndex(f, "/")]
		for _, m := range fuzzFunc.FindAllStringSubmatch(string(src), -1) {
			if time.Until(x.deadline) < time.Minute {
				x.figure("fuzz."+m[1], "skipped", "time budget spent")
				x.fail("fuzz target %s skipped: the time budget was spent before it", m[1])
				continue
			}
			// -parallel 1: the machine's two cores are shared.
			cmd := exec.Command("go", "test", "-run=^$", "-fuzz=^"+m[1]+"$", "-fuzztime="+ft, "-parallel=1", pkg)
			cmd.Env = append(os.Environ(), "GOTOOLCHAIN="+fuzzToolchain())
			b, err := cmd.CombinedOutput()
			execs := "?"
			if mm := regexp.MustCompile(`execs: (\d+)`).FindAllStringSubmatch(string(b), -1); len(mm) > 0 {
				execs = mm[len(mm)-1][1]
			}
			name := "fuzz." + strings.TrimPrefix(pkg, "./") + "." + m[1]
			if err != nil {
				x.fail("%s: %v\n%s", name, err, tailLines(string(b), 15))
				continue
			}
			targets++
			x.figure(name, "ok", fmt.Sprintf("%s execs in %s", execs, ft))
		}
	}
	x.figure("fuzz.targets_passed", strconv.Itoa(targets), "go test -fuzz, SOAK_FUZZTIME="+ft+" each")
}

// fuzzToolchain is the Go that runs the fuzzers: Go 1.26's fuzz coordinator
// can report its own -fuzztime deadline as a failure, "context deadline
// exceeded" with no failing input, when a worker is slow to stop on a
// loaded machine (golang/go#75804, fixed in Go 1.27). The module is still
// built by 1.26 everywhere else; SOAK_FUZZ_GO overrides ("local" = the
// machine's own Go).
func fuzzToolchain() string {
	if v := os.Getenv("SOAK_FUZZ_GO"); v != "" {
		return v
	}
	return "go1.27.3"
}

func tailLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func (x *h) fuzz() {
	x.goFuzz()
	x.apiFuzz()
}

// apiFuzz sends hostile requests to the unix-socket API while a prober
// asks for status every 20 ms: oversize bodies, slowloris, invalid UTF-8,
// deep JSON, garbage. Nothing may crash, change state or slow status
// past 100 ms.
func (x *h) apiFuzz() {
	secs := envInt("SOAK_APIFUZZ_SECONDS", 20)
	st0, err := x.status()
	if err != nil {
		x.fail("apifuzz: %v", err)
		return
	}
	key0 := statusKey(st0)
	d0, _ := os.ReadFile(x.state + "/desired.json")
	pid0 := x.daemonPID()
	dial := func() (net.Conn, error) { return net.DialTimeout("unix", x.sock, 2*time.Second) }
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: func(context.Context, string, string) (net.Conn, error) { return dial() }}}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	sent := map[string]int{}
	codes := map[string]map[int]int{}
	note := func(kind string, code int) {
		mu.Lock()
		sent[kind]++
		if codes[kind] == nil {
			codes[kind] = map[int]int{}
		}
		codes[kind][code]++
		mu.Unlock()
	}
	post := func(kind, path string, body io.Reader) {
		resp, err := hc.Post("http://brokkrd"+path, "application/yaml", body)
		if err != nil {
			note(kind, -1)
			return
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		note(kind, resp.StatusCode)
	}
	loop := func(kind string, f func(r *rand.Rand)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewSource(time.Now().UnixNano()))
			for i := 0; i < 100000; i++ { // bounded in count and by stop
				select {
				case <-stop:
					return
				default:
				}
				f(r)
			}
		}()
	}
	loop("oversize", func(*rand.Rand) {
		// 64 MiB of an endless-looking YAML value, streamed.
		post("oversize", "/v1/apply", io.LimitReader(repeatReader("a"), 64<<20))
	})
	loop("invalid-utf8", func(r *rand.Rand) {
		b := []byte("exposures:\n  - {name: \"")
		for i := 0; i < 64; i++ {
			b = append(b, byte(0x80+r.Intn(0x40)))
		}
		b = append(b, []byte("\", target: 10.213.50.200, guestPort: 1, hostPort: 1}\n")...)
		post("invalid-utf8", "/v1/apply", bytes.NewReader(b))
	})
	loop("deep-json", func(*rand.Rand) {
		post("deep-json", "/v1/apply", strings.NewReader(`{"exposures":`+strings.Repeat("[", 200000)+strings.Repeat("]", 200000)+"}"))
	})
	loop("garbage", func(r *rand.Rand) {
		c, err := dial()
		if err != nil {
			note("garbage", -1)
			return
		}
		b := make([]byte, 1+r.Intn(4096))
		r.Read(b)
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		_, _ = c.Write(b)
		_, _ = io.Copy(io.Discard, c)
		c.Close()
		note("garbage", 0)
	})
	// Slowloris: 200 connections each dribbling a header byte a second.
	for i := 0; i < 200; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := dial()
			if err != nil {
				note("slowloris", -1)
				return
			}
			defer c.Close()
			_, _ = c.Write([]byte("POST /v1/apply HTTP/1.1\r\nHost: brokkrd\r\nX-Slow: "))
			note("slowloris", 0)
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
					if _, err := c.Write([]byte("a")); err != nil {
						note("slowloris-cut", 0) // the server closed it: fine
						return
					}
				}
			}
		}()
	}
	// The prober: its own connection each time, as a CLI call would.
	var lat []time.Duration
	var failed int
	end := time.Now().Add(time.Duration(secs) * time.Second)
	for time.Now().Before(end) {
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c := newClient(x.sock)
		_, err := c.Status(ctx)
		cancel()
		c.CloseIdle()
		if err != nil {
			failed++
		}
		lat = append(lat, time.Since(t0))
		time.Sleep(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	over := 0
	for _, l := range lat {
		if l > 100*time.Millisecond {
			over++
		}
	}
	var kinds []string
	for k, v := range sent {
		kinds = append(kinds, fmt.Sprintf("%s=%d %v", k, v, codes[k]))
	}
	sort.Strings(kinds)
	x.figure("apifuzz.requests", strings.Join(kinds, "; "), "kind=count map[HTTP code]count; -1 = no answer")
	x.figure("apifuzz.status.probes", strconv.Itoa(len(lat)), fmt.Sprintf("over %ds", secs))
	if len(lat) > 0 {
		x.figure("apifuzz.status.p50_ms", fmt.Sprintf("%.1f", ms(lat[len(lat)/2])), "")
		x.figure("apifuzz.status.p99_ms", fmt.Sprintf("%.1f", ms(lat[len(lat)*99/100])), "")
		x.figure("apifuzz.status.max_ms", fmt.Sprintf("%.1f", ms(lat[len(lat)-1])), "")
	}
	x.check("apifuzz.status.over_100ms", int64(over), 0, "")
	x.check("apifuzz.status.failed", int64(failed), 0, "")
	alive := 0
	if err := syscallKill0(pid0); err == nil && x.daemonPID() == pid0 {
		alive = 1
	}
	x.check("apifuzz.daemon_same_pid_alive", int64(alive), 1, "")
	st1, err := x.status()
	d1, _ := os.ReadFile(x.state + "/desired.json")
	x.check("apifuzz.state_unchanged", b2i(err == nil && statusKey(st1) == key0 && bytes.Equal(d0, d1)), 1, "status and desired.json as before")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

type repeatReader string

func (r repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = r[i%len(r)]
	}
	return len(p), nil
}
