// Command brokkrd is brokkr's daemon: it owns the guest network and the
// hypervisor processes of this host and publishes guest ports, converging
// towards the desired state on every change and every second.
//
//	brokkrd [--config FILE] [--check] [--log-format text|json] [--version]
//
// Without --config it reads /etc/brokkr/brokkr.yaml, and without that file
// it runs on the embedded defaults. SIGTERM/SIGINT stop the daemon and leave
// VMs and nft rules in place; SIGHUP reloads the config file.
//
// Exit status: 0 ok, 1 a bad config or bad flags, 2 a system error.
package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"

	"github.com/brokkr/brokkr/daemon/api"
	"github.com/brokkr/brokkr/daemon/config"
	"github.com/spf13/cobra"
)

// DefaultConfig is read when --config is not given and it exists.
const DefaultConfig = "/etc/brokkr/brokkr.yaml"

func main() {
	os.Exit(execute(os.Args[1:], os.Stdout, os.Stderr))
}

// options are brokkrd's flags.
type options struct {
	config    string
	check     bool
	logFormat string
	debug     bool
	upgrade   bool
}

// exitError carries brokkrd's exit status out of cobra.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

// execute runs brokkrd with args and returns its exit status.
func execute(args []string, stdout, stderr io.Writer) int {
	var o options
	var logJSON bool
	cmd := &cobra.Command{
		Use:   "brokkrd [--config FILE] [--check] [--log-format text|json]",
		Short: "brokkr's daemon: the guest network, the VMs and the ports they publish",
		Long: `brokkrd owns this host's guest network (a bridge, one tap per VM, DHCP, the nft table
inet brokkr) and its hypervisor processes, and publishes guest ports. It converges
towards the desired state on every change and every second.

The config is --config FILE, else ` + DefaultConfig + ` if it exists, else the
embedded defaults. A restart with a config file changed since it was last applied
applies the file; otherwise the persisted desired state (stateDir/desired.json,
which also holds brokkr apply and vm start/stop) is resumed.

Signals: SIGTERM or SIGINT stop the daemon and leave VMs and nft rules in place;
SIGHUP reloads the config file (applied as a whole, or not at all).

Exit status: 0 ok, 1 a bad config or bad flags, 2 a system error.`,
		Example: `  # Run on the default config (as systemd does)
  brokkrd --config /etc/brokkr/brokkr.yaml

  # Check a file before installing it; exit 1 with field-named errors
  brokkrd --config ./brokkr.yaml --check

  # JSON log lines for a log shipper
  brokkrd --log-format json`,
		Version:       api.CurrentBuild().String(),
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if logJSON {
				o.logFormat = "json"
			}
			if o.logFormat != "text" && o.logFormat != "json" {
				return fmt.Errorf("--log-format %q: want text or json", o.logFormat)
			}
			if o.upgrade {
				return exitError{upgrade(o, withoutFlag(args, "upgrade"), cmd.OutOrStdout(), cmd.ErrOrStderr())}
			}
			if o.check {
				return exitError{check(o.config, cmd.OutOrStdout(), cmd.ErrOrStderr())}
			}
			return exitError{serve(o, cmd.ErrOrStderr())}
		},
	}
	cmd.SetVersionTemplate("{{.Name}} {{.Version}}\n")
	f := cmd.Flags()
	f.StringVar(&o.config, "config", "", "config file (default "+DefaultConfig+" if it exists, else embedded defaults)")
	f.BoolVar(&o.check, "check", false, "validate the config and exit: 0 valid, 1 invalid (field-named errors on stderr)")
	f.StringVar(&o.logFormat, "log-format", "text", "log lines as text or json (to stderr; the journal under systemd)")
	f.BoolVar(&o.debug, "debug", false, "log debug messages")
	f.BoolVar(&o.upgrade, "upgrade", false, "hand the running brokkrd (same runDir) over to this binary, started with the other flags given; exit 0 once it serves, 2 if it failed (the running one goes on serving)")
	f.BoolVar(&logJSON, "log-json", false, "log JSON lines")
	_ = f.MarkDeprecated("log-json", "use --log-format json")
	cmd.SetArgs(legacyArgs(args))
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	err := cmd.Execute()
	var ee exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	default:
		fmt.Fprintf(stderr, "brokkrd: %v\n", err)
		return 1
	}
}

// legacyArgs rewrites the Go-flag spellings older unit files use
// (-config FILE, -log-json, -debug) to pflag's --config: pflag would read
// -config as the shorthands -c -o -n ... and fail. Only the long names
// brokkrd has are rewritten, and nothing after "--".
func legacyArgs(args []string) []string {
	known := map[string]bool{"upgrade": true, "config": true, "check": true, "log-format": true, "log-json": true, "debug": true, "version": true, "help": true}
	out := make([]string, 0, len(args))
	for i, a := range args {
		if a == "--" {
			return append(out, args[i:]...)
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "-"), "=")
		if strings.HasPrefix(a, "-") && !strings.HasPrefix(a, "--") && known[name] {
			a = "-" + a
		}
		out = append(out, a)
	}
	return out
}

// withoutFlag drops a boolean flag (any spelling) from args.
func withoutFlag(args []string, name string) []string {
	out := make([]string, 0, len(args))
	for _, a := range args {
		if a == "-"+name || a == "--"+name || strings.HasPrefix(a, "--"+name+"=") || strings.HasPrefix(a, "-"+name+"=") {
			continue
		}
		out = append(out, a)
	}
	return out
}

// check is --check: load and validate the config brokkrd would run on.
func check(flagPath string, stdout, stderr io.Writer) int {
	path, cfg, err := loadConfig(flagPath)
	if err != nil {
		var ce config.Errors
		if errors.As(err, &ce) {
			fmt.Fprintf(stderr, "%s: invalid config:\n", path)
			for _, e := range ce {
				fmt.Fprintf(stderr, "  %s\n", e.Error())
			}
			return 1
		}
		fmt.Fprintf(stderr, "brokkrd: %v\n", err)
		return 1
	}
	if path == "" {
		fmt.Fprintf(stdout, "no config file (%s does not exist): the embedded defaults are valid\n", DefaultConfig)
		return 0
	}
	fmt.Fprintf(stdout, "%s: valid (%d VMs, %d exposures)\n", path, len(cfg.VMs), len(cfg.Exposures))
	return 0
}

// loadConfig picks the config: --config (must exist), else the default
// path if it exists, else the embedded defaults. path is "" for defaults.
// A config that does not validate comes back as config.Errors, with path.
func loadConfig(flagPath string) (string, *config.Config, error) {
	path, _, cfg, err := loadConfigData(flagPath)
	return path, cfg, err
}

// loadConfigData is loadConfig with the file's bytes (nil for defaults).
func loadConfigData(flagPath string) (string, []byte, *config.Config, error) {
	path, b, err := readConfig(flagPath)
	if err != nil {
		return path, nil, nil, err
	}
	if path == "" {
		return "", nil, config.Defaults(), nil
	}
	cfg, err := config.Parse(b)
	if err != nil {
		return path, nil, nil, err
	}
	return path, b, cfg, nil
}

// readConfig reads the file loadConfig would use; path "" is none.
func readConfig(flagPath string) (string, []byte, error) {
	path := flagPath
	if path == "" {
		if _, err := os.Stat(DefaultConfig); err == nil {
			path = DefaultConfig
		} else if !errors.Is(err, fs.ErrNotExist) {
			return "", nil, fmt.Errorf("%s: %w", DefaultConfig, err)
		}
	}
	if path == "" {
		return "", nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return path, nil, err
	}
	return path, b, nil
}
