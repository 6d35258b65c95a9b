package chv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/brokkr/brokkr/internal/unixhttp"
)

// client speaks cloud-hypervisor's REST API (vmm/src/api/openapi/
// cloud-hypervisor.yaml) over its unix socket. Every request that takes a
// body sends the whole body (one peer's client silently dropped them).
type client struct {
	socket string
	http   *http.Client
}

func newClient(socket string) *client {
	return &client{socket: socket, http: unixhttp.Client(socket)}
}

func (c *client) close() { c.http.CloseIdleConnections() }

// APIError is a non-success answer from the VMM.
type APIError struct {
	Endpoint string
	Status   int
	Body     string
}

func (e *APIError) Error() string {
	msg := fmt.Sprintf("%s: HTTP %d", e.Endpoint, e.Status)
	if e.Body != "" {
		msg += ": " + e.Body
	}
	return msg
}

// do sends method endpoint with body (JSON, when non-nil) and decodes a 200
// answer into out. Any status not in ok is an *APIError.
func (c *client) do(ctx context.Context, method, endpoint string, body, out any, ok ...int) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("%s: %w", endpoint, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost/api/v1/"+endpoint, rd)
	if err != nil {
		return fmt.Errorf("%s: %w", endpoint, err)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", endpoint, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("%s: %w", endpoint, err)
	}
	if !slices.Contains(ok, resp.StatusCode) {
		return &APIError{Endpoint: endpoint, Status: resp.StatusCode, Body: strings.TrimSpace(string(data))}
	}
	if out != nil && resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("%s: decode answer: %w", endpoint, err)
		}
	}
	return nil
}

// PingResponse is VmmPingResponse.
type PingResponse struct {
	Version      string   `json:"version"`
	BuildVersion string   `json:"build_version,omitempty"`
	PID          int      `json:"pid,omitempty"`
	Features     []string `json:"features,omitempty"`
}

// VMInfo is the part of VmInfo brokkr reads.
type VMInfo struct {
	State            string          `json:"state"`
	Config           json.RawMessage `json:"config"`
	MemoryActualSize int64           `json:"memory_actual_size,omitempty"`
}

func (c *client) ping(ctx context.Context) (PingResponse, error) {
	var p PingResponse
	err := c.do(ctx, http.MethodGet, "vmm.ping", nil, &p, http.StatusOK)
	return p, err
}

func (c *client) create(ctx context.Context, cfg *VMConfig) error {
	return c.do(ctx, http.MethodPut, "vm.create", cfg, nil, http.StatusNoContent, http.StatusOK)
}

func (c *client) info(ctx context.Context) (VMInfo, error) {
	var i VMInfo
	err := c.do(ctx, http.MethodGet, "vm.info", nil, &i, http.StatusOK)
	return i, err
}

func (c *client) put(ctx context.Context, endpoint string) error {
	return c.do(ctx, http.MethodPut, endpoint, nil, nil, http.StatusNoContent, http.StatusOK)
}

func (c *client) counters(ctx context.Context) (map[string]map[string]int64, error) {
	var m map[string]map[string]int64
	err := c.do(ctx, http.MethodGet, "vm.counters", nil, &m, http.StatusOK)
	return m, err
}

// VMConfig is the vm.create body (schema VmConfig), with the fields brokkr
// sets. Everything it needs is explicit rather than left to defaults that
// differ between releases.
type VMConfig struct {
	CPUs    CPUsConfig    `json:"cpus"`
	Memory  MemoryConfig  `json:"memory"`
	Payload PayloadConfig `json:"payload"`
	Disks   []DiskConfig  `json:"disks,omitempty"`
	Net     []NetConfig   `json:"net,omitempty"`
	RNG     RNGConfig     `json:"rng"`
	Serial  ConsoleConfig `json:"serial"`
	Console ConsoleConfig `json:"console"`
}

// CPUsConfig is CpusConfig.
type CPUsConfig struct {
	BootVCPUs int `json:"boot_vcpus"`
	MaxVCPUs  int `json:"max_vcpus"`
}

// MemoryConfig is MemoryConfig (size in bytes).
type MemoryConfig struct {
	Size int64 `json:"size"`
}

// PayloadConfig is PayloadConfig.
type PayloadConfig struct {
	Kernel    string `json:"kernel,omitempty"`
	Initramfs string `json:"initramfs,omitempty"`
	Cmdline   string `json:"cmdline,omitempty"`
}

// DiskConfig is DiskConfig.
type DiskConfig struct {
	Path     string `json:"path"`
	ID       string `json:"id,omitempty"`
	Readonly bool   `json:"readonly"`
}

// NetConfig is NetConfig. ip/mask are left out: the tap is made and
// addressed by netplane, and the guest gets its address by DHCP or ip=.
type NetConfig struct {
	Tap       string `json:"tap"`
	MAC       string `json:"mac,omitempty"`
	ID        string `json:"id,omitempty"`
	NumQueues int    `json:"num_queues"`
	QueueSize int    `json:"queue_size"`
}

// RNGConfig is RngConfig.
type RNGConfig struct {
	Src string `json:"src"`
}

// ConsoleConfig is SerialConfig / ConsoleConfig.
type ConsoleConfig struct {
	Mode   string `json:"mode"`
	File   string `json:"file,omitempty"`
	Socket string `json:"socket,omitempty"`
}

// SnapshotConfig is VmSnapshotConfig.
type SnapshotConfig struct {
	DestinationURL string `json:"destination_url"`
}

// RestoreConfig is RestoreConfig. The guest's memory is copied in at
// restore (no prefault, no on-demand paging): the snapshot may be deleted
// once the guest runs.
type RestoreConfig struct {
	SourceURL string `json:"source_url"`
}
