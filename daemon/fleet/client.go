// Package fleet is brokkr's fleet mode on etcd (docs/ARCHITECTURE.md,
// "External contract"; README "Fleet mode"):
// the node agent, a daemon.Source that watches <prefix>/nodes/<node>/desired,
// applies each revision whole or not at all, reports the node's status and
// keeps <prefix>/nodes/<node>/alive under a lease; and the operator side
// behind `brokkr fleet apply|status|rm`.
//
// It uses etcd's own client (go.etcd.io/etcd/client/v3): watch resumption,
// endpoint balancing and failover, auth token refresh and TLS are what that
// client is for, and re-implementing any of them here would be where the
// bugs are.
package fleet

import (
	"crypto/tls"
	"fmt"
	"path"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// ClientConfig is how to reach etcd: the daemon's `fleet:` section or the
// CLI's --etcd and TLS flags.
type ClientConfig struct {
	Endpoints      []string
	CA, Cert, Key  string
	User, Password string
	// DialTimeout bounds the first connection; 0 dials in the background,
	// which a node needs: it must start and serve while etcd is down.
	DialTimeout time.Duration
}

// Dial builds an etcd client. With DialTimeout 0 it returns at once and
// connects in the background.
func Dial(c ClientConfig) (*clientv3.Client, error) {
	var tc *tls.Config
	if c.CA != "" || c.Cert != "" {
		info := transport.TLSInfo{TrustedCAFile: c.CA, CertFile: c.Cert, KeyFile: c.Key}
		var err error
		if tc, err = info.ClientConfig(); err != nil {
			return nil, fmt.Errorf("etcd TLS: %w", err)
		}
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.Endpoints,
		DialTimeout: c.DialTimeout,
		// gRPC pings find a connection a partition killed (TCP alone
		// would wait minutes); 10 s is gRPC's floor for client pings.
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 3 * time.Second,
		// Watches are long-lived streams; pings must run without unary calls.
		PermitWithoutStream: true,
		TLS:                 tc,
		Username:            c.User,
		Password:            c.Password,
		// The client's own zap logs repeat every reconnect attempt; the
		// agent logs state changes itself.
		Logger: zap.NewNop(),
		// gRPC's default reconnect backoff grows to 2 minutes; a healed
		// partition should be noticed within seconds.
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: time.Second, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 5 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		})},
	})
	if err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	return cli, nil
}

// Keys are one node's keys under the prefix.
type Keys struct{ Dir, Desired, Status, Alive string }

// NodeKeys returns the keys of node under prefix.
func NodeKeys(prefix, node string) Keys {
	dir := path.Join(prefix, "nodes", node) + "/"
	return Keys{Dir: dir, Desired: dir + "desired", Status: dir + "status", Alive: dir + "alive"}
}

// NodesDir is the key prefix every node's keys share.
func NodesDir(prefix string) string { return path.Join(prefix, "nodes") + "/" }
