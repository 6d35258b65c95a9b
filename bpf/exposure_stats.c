//go:build ignore

// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
//
// The shared maps alone (see exposure.h): what the daemon loads to create or
// open them, with or without the programs.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "exposure.h"
#include "denied.h"

char __license[] SEC("license") = "Dual BSD/GPL";
