package config

import "errors"

func errorsAs(err error, es *Errors) bool { return errors.As(err, es) }
