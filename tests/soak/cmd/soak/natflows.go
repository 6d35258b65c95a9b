package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// natFlow is one nat_flows entry as bpftool prints it (struct nat_flow in
// bpf/natpath.c): addresses and ports as the kernel stores them, in network
// byte order, read as little-endian numbers.
type natFlow struct {
	Slot  uint32 `json:"slot"`
	Gen   uint32 `json:"gen"`
	Flags uint32 `json:"flags"`
	Saddr uint32 `json:"saddr"`
	Daddr uint32 `json:"daddr"`
	Sport uint16 `json:"sport"`
	Dport uint16 `json:"dport"`
	Proto uint8  `json:"proto"`
}

// nat_flow.flags, as in bpf/natpath.c.
const (
	flowOpen     = 0x01
	flowReleased = 0x02
	flowRefused  = 0x04
	flowFinOrig  = 0x08
	flowFinRepl  = 0x10
	flowReplied  = 0x20
)

// kind names what the entry says about its flow: whether it holds a place
// (open), gave it back (released) or was refused, and how far it got.
func (f natFlow) kind() string {
	k := "open"
	switch {
	case f.Flags&flowRefused != 0:
		return "refused"
	case f.Flags&flowReleased != 0:
		k = "released"
	}
	if f.Flags&flowReplied == 0 {
		k += ",unanswered"
	}
	if f.Flags&flowFinOrig != 0 {
		k += ",fin-caller"
	}
	if f.Flags&flowFinRepl != 0 {
		k += ",fin-guest"
	}
	return k
}

func (f natFlow) addr(a uint32, p uint16) netip.AddrPort {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], a)
	return netip.AddrPortFrom(netip.AddrFrom4(b), p>>8|p<<8)
}

// natFlowsLeft describes the entries of nat_flows: how many of each kind
// per exposure, and for a few, the conntrack entry their tuple has now (the
// sweep keeps an entry only while that entry lives).
func (x *h) natFlowsLeft() (string, string) {
	raw, err := bpftoolDump(filepath.Join(x.bpf, "nat_flows"))
	if err != nil {
		return "?", err.Error()
	}
	names := x.slotNames()
	kinds := map[string]int{}
	var detail []string
	for _, r := range raw {
		f, err := parseNatFlow(r)
		if err != nil {
			continue
		}
		name := names[f.Slot]
		if name == "" {
			name = "slot" + strconv.Itoa(int(f.Slot))
		}
		kinds[name+" "+f.kind()]++
		if len(detail) < 8 {
			src, dst := f.addr(f.Saddr, f.Sport), f.addr(f.Daddr, f.Dport)
			detail = append(detail, fmt.Sprintf("%s %s %s->%s gen %d ct: %s", name, f.kind(), src, dst, f.Gen, ctState(f.Proto, src, dst)))
		}
	}
	var sum []string
	for k, n := range kinds {
		sum = append(sum, fmt.Sprintf("%s=%d", k, n))
	}
	sort.Strings(sum)
	return strings.Join(sum, " "), strings.Join(detail, "; ")
}

// parseNatFlow reads one element of `bpftool -j map dump` of nat_flows.
func parseNatFlow(r json.RawMessage) (natFlow, error) {
	var w struct {
		Formatted *struct {
			Value natFlow `json:"value"`
		} `json:"formatted"`
	}
	if err := json.Unmarshal(r, &w); err != nil {
		return natFlow{}, err
	}
	if w.Formatted == nil {
		return natFlow{}, fmt.Errorf("nat_flows element without BTF formatting")
	}
	return w.Formatted.Value, nil
}

// slotNames maps exposure_stats_v2 slots to the names of their exposures.
func (x *h) slotNames() map[uint32]string {
	out := map[uint32]string{}
	vals, err := bpftoolSlots(x.bpf)
	if err != nil {
		return out
	}
	for k, v := range vals {
		var e struct {
			Name string `json:"name"`
		}
		if json.Unmarshal(v, &e) == nil && e.Name != "" {
			out[k] = e.Name
		}
	}
	return out
}

// ctState is the state of the conntrack entry with this original tuple in
// brokkrd's namespace, or "none".
func ctState(proto uint8, src, dst netip.AddrPort) string {
	p := map[uint8]string{6: "tcp", 17: "udp"}[proto]
	if p == "" {
		return "proto " + strconv.Itoa(int(proto))
	}
	out, err := runIn(hostNS, "conntrack", "-L", "-p", p, "--orig-src", src.Addr().String(), "--orig-port-src", strconv.Itoa(int(src.Port())),
		"--orig-dst", dst.Addr().String(), "--orig-port-dst", strconv.Itoa(int(dst.Port())))
	if err != nil && !strings.Contains(out, " 0 flow entries") {
		return "? " + strings.TrimSpace(out)
	}
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 3 && f[0] == p {
			if p == "tcp" {
				return f[3] + " " + f[2] + "s"
			}
			return f[2] + "s"
		}
	}
	return "none"
}
