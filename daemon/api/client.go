package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/brokkr/brokkr/internal/unixhttp"
)

// Client talks to brokkrd over its unix socket.
type Client struct {
	Socket string
	hc     *http.Client
}

// NewClient returns a client for the daemon listening on socket.
func NewClient(socket string) *Client {
	return &Client{Socket: socket, hc: unixhttp.Client(socket)}
}

// CloseIdle drops idle connections.
func (c *Client) CloseIdle() { c.hc.CloseIdleConnections() }

// HTTPError is a non-2xx answer from the daemon.
type HTTPError struct {
	Code   int
	Msg    string
	Fields []string
}

func (e *HTTPError) Error() string {
	if len(e.Fields) > 0 {
		return e.Msg + ":\n  " + strings.Join(e.Fields, "\n  ")
	}
	return e.Msg
}

// UserError reports whether the daemon blamed the request (4xx).
func (e *HTTPError) UserError() bool { return e.Code >= 400 && e.Code < 500 }

// UnreachableError means the daemon could not be reached at all.
type UnreachableError struct {
	Socket string
	Err    error
}

func (e *UnreachableError) Error() string {
	// A non-root caller reaches a live daemon's 0600 socket and is refused:
	// asking whether the daemon runs would send them the wrong way.
	if errors.Is(e.Err, syscall.EACCES) || errors.Is(e.Err, syscall.EPERM) {
		return fmt.Sprintf("permission denied on brokkrd's socket %s: it is root-only (0600); run brokkr as root (sudo brokkr ...)", e.Socket)
	}
	return fmt.Sprintf("cannot reach brokkrd at %s: %v (is it running? --socket or BROKKR_SOCKET select another socket)", e.Socket, e.Err)
}

func (e *UnreachableError) Unwrap() error { return e.Err }

func (c *Client) do(ctx context.Context, method, path string, body []byte, timeout time.Duration) (*http.Response, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		_ = cancel // released when the body is closed: see cancelBody
		req, err := http.NewRequestWithContext(ctx, method, "http://brokkrd"+path, bytes.NewReader(body))
		if err != nil {
			cancel()
			return nil, err
		}
		resp, err := c.send(req)
		if err != nil {
			cancel()
			return nil, err
		}
		resp.Body = cancelBody{resp.Body, cancel}
		return resp, nil
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://brokkrd"+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	return c.send(req)
}

type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b cancelBody) Close() error { err := b.ReadCloser.Close(); b.cancel(); return err }

func (c *Client) send(req *http.Request) (*http.Response, error) {
	resp, err := c.hc.Do(req)
	if err != nil {
		var op *net.OpError
		if errors.As(err, &op) && op.Op == "dial" {
			return nil, &UnreachableError{Socket: c.Socket, Err: op.Err}
		}
		return nil, fmt.Errorf("brokkrd at %s: %w", c.Socket, err)
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		var e Error
		if json.Unmarshal(b, &e) != nil || e.Error == "" {
			e.Error = strings.TrimSpace(string(b))
		}
		return nil, &HTTPError{Code: resp.StatusCode, Msg: e.Error, Fields: e.Errors}
	}
	return resp, nil
}

func (c *Client) getJSON(ctx context.Context, method, path string, body []byte, out any) error {
	resp, err := c.do(ctx, method, path, body, 2*time.Minute)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("brokkrd answered %s %s with something that is not JSON: %w", method, path, err)
	}
	return nil
}

// Status fetches the merged status.
func (c *Client) Status(ctx context.Context) (*Status, error) {
	var s Status
	return &s, c.getJSON(ctx, http.MethodGet, "/v1/status", nil, &s)
}

// Apply sends a config (YAML or JSON). With dryRun nothing changes and the
// plan says what would.
func (c *Client) Apply(ctx context.Context, config []byte, dryRun bool) (*Plan, error) {
	path := "/v1/apply"
	if dryRun {
		path += "?dryRun=1"
	}
	var p Plan
	return &p, c.getJSON(ctx, http.MethodPost, path, config, &p)
}

// PutExposure creates or replaces the exposure name; body is one exposure in
// the config file's shape (an entry of exposures:, YAML or JSON). The plan
// says whether it was added or changed.
func (c *Client) PutExposure(ctx context.Context, name string, body []byte) (*Plan, error) {
	var p Plan
	return &p, c.getJSON(ctx, http.MethodPut, "/v1/exposures/"+url.PathEscape(name), body, &p)
}

// DeleteExposure removes the exposure name (an HTTPError 404 when there is
// none).
func (c *Client) DeleteExposure(ctx context.Context, name string) (*Plan, error) {
	var p Plan
	return &p, c.getJSON(ctx, http.MethodDelete, "/v1/exposures/"+url.PathEscape(name), nil, &p)
}

// VMAction is start, stop or restart.
func (c *Client) VMAction(ctx context.Context, name, action string) error {
	resp, err := c.do(ctx, http.MethodPost, "/v1/vms/"+url.PathEscape(name)+"/"+action, nil, time.Minute)
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// Console streams a VM's serial log; with follow it keeps streaming until
// ctx ends.
func (c *Client) Console(ctx context.Context, name string, follow bool) (io.ReadCloser, error) {
	path := "/v1/vms/" + url.PathEscape(name) + "/console"
	if follow {
		path += "?follow=1"
	}
	resp, err := c.do(ctx, http.MethodGet, path, nil, 0)
	if err != nil {
		return nil, err
	}
	return resp.Body, nil
}

// Metrics returns the Prometheus text exposition.
func (c *Client) Metrics(ctx context.Context) (string, error) {
	resp, err := c.do(ctx, http.MethodGet, "/metrics", nil, time.Minute)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}
