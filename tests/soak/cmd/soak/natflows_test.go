package main

import (
	"encoding/json"
	"testing"
)

// An element as bpftool 7 prints it for an open TCP flow of slot 0.
const dumpedFlow = `{"key":["0x00","0x3e","0x7a","0x04","0x81","0x88","0xff","0xff"],"value":["0x00"],` +
	`"formatted":{"key":18446612686440119808,"value":{"slot":0,"gen":1,"flags":97,"next_seq":[4107491482,3374744058],` +
	`"saddr":33579786,"daddr":16802570,"sport":21222,"dport":36895,"proto":6,"pad":[0,0,0],"pend":[0,0]}}}`

func TestParseNatFlowReadsTheTupleInNetworkOrder(t *testing.T) {
	f, err := parseNatFlow(json.RawMessage(dumpedFlow))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.addr(f.Saddr, f.Sport).String(); got != "10.99.0.2:58962" {
		t.Errorf("source %s", got)
	}
	if got := f.addr(f.Daddr, f.Dport).String(); got != "10.99.0.1:8080" {
		t.Errorf("destination %s", got)
	}
	if f.Slot != 0 || f.Gen != 1 || f.Proto != 6 {
		t.Errorf("flow %+v", f)
	}
	if got := f.kind(); got != "open" {
		t.Errorf("kind %q", got)
	}
	if _, err := parseNatFlow(json.RawMessage(`{"key":[],"value":[]}`)); err == nil {
		t.Error("an element without BTF formatting parsed")
	}
}

func TestNatFlowKindSaysWhetherItHoldsAPlace(t *testing.T) {
	for flags, want := range map[uint32]string{
		flowRefused: "refused",
		flowOpen:    "open,unanswered",
		flowOpen | flowReleased | flowReplied | flowFinOrig: "released,fin-caller",
		flowOpen | flowReplied | flowFinRepl:                "open,fin-guest",
	} {
		if got := (natFlow{Flags: flags}).kind(); got != want {
			t.Errorf("flags %#x: %q, want %q", flags, got, want)
		}
	}
}
