package bpf

// The generated *_bpfel.{go,o} are committed so that building needs no
// clang; `make generate` rebuilds them and CI checks they are not stale.
// ctmark.h comes first: natpath.c includes it.
//go:generate go run ./ctmark/mkheader ctmark.h
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel -type exposure_stat -type exposure_limit -type exposure_deny stats exposure_stats.c -- -O2 -g -Wall -mcpu=v3 -I..
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel -type nat_flow -type nat_cfg -type nat_cfg6 -type allow_key natpath natpath.c -- -O2 -g -Wall -mcpu=v3 -I..
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel nattc nattc.c -- -O2 -g -Wall -mcpu=v3 -I..
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel wake wake.c -- -O2 -g -Wall -mcpu=v3 -I..
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel -type sock_key -type sock_target -type sock_target6 -type sock_cfg -type sock_xlate -type sock_xlate6 socklb socklb.c -- -O2 -g -Wall -mcpu=v3 -I..
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -target bpfel sockreap sockreap.c -- -O2 -g -Wall -mcpu=v3 -I..
