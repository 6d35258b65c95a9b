package nlsafe

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every netlink dump in brokkr's link-side packages goes through this
// package (the forbidigo rule moby and CNI use, as a test): a direct
// h.LinkList and friends would miss the ErrDumpInterrupted retry.
func TestNoDirectNetlinkDumps(t *testing.T) {
	direct := regexp.MustCompile(`\.(LinkList|LinkByName|AddrList|NeighList|RouteList|LinkGetProtinfo)\(`)
	root := filepath.Join("..", "..", "netplane")
	for _, dir := range []string{".", "link", "ipam", "dhcp", "nft", "conntrack"} {
		files, err := filepath.Glob(filepath.Join(root, dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		if len(files) == 0 {
			t.Fatalf("no Go files in %s: the guard would check nothing", filepath.Join(root, dir))
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for i, line := range strings.Split(string(b), "\n") {
				if direct.MatchString(line) && !strings.Contains(line, "nlsafe.") {
					t.Errorf("%s:%d: netlink dump without nlsafe: %s", f, i+1, strings.TrimSpace(line))
				}
			}
		}
	}
}
