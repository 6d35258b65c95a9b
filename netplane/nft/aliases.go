package nft

import "github.com/brokkr/brokkr/netplane/nft/compile"

// The desired state is the compiler's input; the aliases keep callers
// writing nft.Rules, nft.Exposure and nft.Guest.
type (
	Rules       = compile.Rules
	Exposure    = compile.Exposure
	Guest       = compile.Guest
	Cap         = compile.Cap
	MarksOnly   = compile.MarksOnly
	SetBasedCap = compile.SetBasedCap
)

// MaxConnsLimit bounds a cap (the cap set is sized to it).
const MaxConnsLimit = compile.MaxConnsLimit
