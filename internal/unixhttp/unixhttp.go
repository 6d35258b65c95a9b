// Package unixhttp makes HTTP clients that reach a server on a unix socket
// (brokkrd's API, a cloud-hypervisor VMM's API).
package unixhttp

import (
	"context"
	"net"
	"net/http"
)

// Client returns an HTTP client whose every request goes to socket, whatever
// the URL's host. Keep-alives are off: each caller makes one request at a
// time to a server that may be restarted or killed at any moment, so a kept
// connection buys nothing and can be stale.
func Client(socket string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		DisableKeepAlives: true,
	}}
}
