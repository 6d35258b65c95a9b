package bpf

// The generated stats_bpfel.{go,o} are committed so that building needs no
// clang; `make generate` rebuilds them and CI checks they are not stale.
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel -type exposure_stat stats exposure_stats.c -- -O2 -g -Wall -I..
