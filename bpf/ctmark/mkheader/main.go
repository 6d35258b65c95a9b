// Command mkheader writes bpf/ctmark.h from package ctmark (go generate in
// bpf/): the C side of the mark layout is generated, never written twice.
package main

import (
	"fmt"
	"os"

	"github.com/brokkr/brokkr/bpf/ctmark"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: mkheader OUT.h")
		os.Exit(2)
	}
	if err := os.WriteFile(os.Args[1], []byte(ctmark.Header()), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "mkheader:", err)
		os.Exit(1)
	}
}
