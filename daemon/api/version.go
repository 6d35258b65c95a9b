package api

import (
	"runtime"
	"runtime/debug"
)

// Set by the Makefile (-ldflags "-X github.com/brokkr/brokkr/daemon/api.version=..."),
// from git describe and git rev-parse. A plain `go build` or `go install`
// leaves them empty and Build falls back to what the Go toolchain stamped.
var (
	version string
	commit  string
)

// Build says which build a binary is. It is part of GET /v1/status
// (Status.Daemon), so the CLI can tell an operator that it and the daemon
// differ (a package upgraded, the daemon not restarted).
type Build struct {
	Version   string `json:"version"`
	Commit    string `json:"commit"`
	GoVersion string `json:"goversion"`
}

// CurrentBuild is this binary's build.
func CurrentBuild() Build {
	b := Build{Version: version, Commit: commit, GoVersion: runtime.Version()}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return fill(b)
	}
	return fill(fromBuildInfo(b, info))
}

// fromBuildInfo fills what -ldflags left empty: the module version (set by
// `go install module@version`) and the VCS stamp of a build in a checkout.
func fromBuildInfo(b Build, info *debug.BuildInfo) Build {
	if b.Version == "" && info.Main.Version != "" && info.Main.Version != "(devel)" {
		b.Version = info.Main.Version
	}
	dirty := false
	rev := ""
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if b.Commit == "" && rev != "" {
		b.Commit = rev
		if len(b.Commit) > 12 {
			b.Commit = b.Commit[:12]
		}
		if dirty {
			b.Commit += "-dirty"
		}
	}
	if info.GoVersion != "" {
		b.GoVersion = info.GoVersion
	}
	return b
}

func fill(b Build) Build {
	if b.Version == "" {
		b.Version = "devel"
	}
	if b.Commit == "" {
		b.Commit = "unknown"
	}
	return b
}

// String is the --version line: "brokkr v0.3.0-4-gabc123 (commit abc123, go1.26.8)".
func (b Build) String() string {
	return b.Version + " (commit " + b.Commit + ", " + b.GoVersion + ")"
}
