package compile

// For the kernel tests (package compile_test, which may import the runtime).

type GoldenCase = goldenCase

func GoldenCases() []GoldenCase { return goldenCases() }

func (c GoldenCase) Name() string { return c.name }
func (c GoldenCase) Rules() Rules { return c.rules }

func GoldenPath(name string) string { return goldenPath(name) }
