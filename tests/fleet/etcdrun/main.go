// Command etcdrun runs a real etcd cluster of N members in one process
// (go.etcd.io/etcd/server/v3/embed) for `make demo-fleet`: peers on
// 127.0.0.1, clients on -client-host. It runs until SIGTERM or SIGINT.
// Demo and benchmark tooling only; brokkr itself never embeds a server.
package main

import (
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

func main() {
	n := flag.Int("members", 3, "cluster size")
	dir := flag.String("dir", "", "data directory (one subdirectory per member)")
	host := flag.String("client-host", "127.0.0.1", "address the client listeners bind")
	clientBase := flag.Int("client-port", 2379, "first member's client port (the others follow)")
	peerBase := flag.Int("peer-port", 12380, "first member's peer port on 127.0.0.1")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "etcdrun: -dir is required")
		os.Exit(1)
	}
	var initial []string
	for i := 0; i < *n; i++ {
		initial = append(initial, fmt.Sprintf("m%d=http://127.0.0.1:%d", i, *peerBase+i))
	}
	members := make([]*embed.Etcd, *n)
	errs := make(chan error, *n)
	for i := 0; i < *n; i++ {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("m%d", i)
		cfg.Dir = filepath.Join(*dir, cfg.Name)
		cfg.ListenClientUrls = []url.URL{{Scheme: "http", Host: fmt.Sprintf("%s:%d", *host, *clientBase+i)}}
		cfg.AdvertiseClientUrls = []url.URL{{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", *clientBase+i)}}
		p := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", *peerBase+i)}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{p}, []url.URL{p}
		cfg.InitialCluster = strings.Join(initial, ",")
		cfg.InitialClusterToken = "brokkr-demo"
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		go func() {
			e, err := embed.StartEtcd(cfg)
			if err != nil {
				errs <- fmt.Errorf("member %d: %w", i, err)
				return
			}
			members[i] = e
			select {
			case <-e.Server.ReadyNotify():
				errs <- nil
			case <-time.After(60 * time.Second):
				errs <- fmt.Errorf("member %d: not ready after 60 s", i)
			}
		}()
	}
	for i := 0; i < *n; i++ {
		if err := <-errs; err != nil {
			fmt.Fprintln(os.Stderr, "etcdrun:", err)
			os.Exit(2)
		}
	}
	fmt.Printf("etcdrun: %d members ready, clients on %s:%d-%d\n", *n, *host, *clientBase, *clientBase+*n-1)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	<-sigs
	for _, e := range members {
		if e != nil {
			e.Close()
		}
	}
}
