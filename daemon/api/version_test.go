package api

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestBuildFromLdflagsWins(t *testing.T) {
	info := &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Version: "v9.9.9"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}}}
	b := fill(fromBuildInfo(Build{Version: "v1.2.3-4-gabc", Commit: "abc"}, info))
	assert.Equal(t, Build{Version: "v1.2.3-4-gabc", Commit: "abc", GoVersion: "go1.99"}, b)
}

func TestBuildFallsBackToBuildInfo(t *testing.T) {
	info := &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Version: "v0.4.0"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"}}}
	b := fill(fromBuildInfo(Build{}, info))
	assert.Equal(t, Build{Version: "v0.4.0", Commit: "0123456789ab-dirty", GoVersion: "go1.99"}, b)

	// A build in a checkout without VCS stamping or a module version.
	b = fill(fromBuildInfo(Build{}, &debug.BuildInfo{GoVersion: "go1.99", Main: debug.Module{Version: "(devel)"}}))
	assert.Equal(t, Build{Version: "devel", Commit: "unknown", GoVersion: "go1.99"}, b)
	assert.Equal(t, "devel (commit unknown, go1.99)", b.String())
}
