#!/usr/bin/env bash
# Run a command with this x86 CPU held to AVX2, for the engine and for its llama.cpp peer, so that the
# AVX2 code paths (most laptops, many servers) can be timed on a machine with AVX-512:
#   bash scripts/cpu_as_avx2.sh python -m engine_lib bench --peer llama.cpp ...
# PyTorch (ATEN_CPU_CAPABILITY, and inductor with it), oneDNN, MKL and our kernels (ENGINE_LIB_CPU_ISA) run
# their AVX2 code; bf16 layers take the fp32 path of a CPU without bf16 instructions; llama.cpp runs from a
# copy of node-llama-cpp that holds only its AVX2 ("haswell") CPU build. Records say so: the device reads
# "AVX2 of an AVX512 CPU". Not an AVX2 machine: the caches, memory and clock stay this machine's.
set -euo pipefail
if [[ $# -eq 0 || $1 == -h || $1 == --help ]]; then sed -n '2,8p' "$0"; exit 2; fi

src=${ENGINE_LIB_NODE_LLAMA_CPP:-${XDG_CACHE_HOME:-$HOME/.cache}/engine_lib/node-llama-cpp}
bins=node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
if [[ -d $src/$bins ]]; then
  dst=${TMPDIR:-/tmp}/engine_lib-node-llama-cpp-avx2
  if [[ ! -f $dst/$bins/libggml-cpu-haswell.so ]]; then
    rm -rf "$dst" && mkdir -p "$dst"
    # the GPU builds are not needed (gpu: false); of the CPU builds, only the AVX2 one, so ggml picks it
    (cd "$src" && tar --exclude='node_modules/@node-llama-cpp/linux-x64-*' -cf - node_modules) | tar -xf - -C "$dst"
    find "$dst/$bins" -name 'libggml-cpu-*.so' ! -name 'libggml-cpu-haswell.so' -delete
  fi
  export ENGINE_LIB_NODE_LLAMA_CPP=$dst
fi

export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ENGINE_LIB_CPU_ISA=avx2 \
  ENGINE_LIB_CPU_HALF_MATMUL=fp32
# Compiled steps kept apart from the machine's own: inductor's graph cache (torch 2.13) leaves the vector width
# ATEN_CPU_CAPABILITY sets out of its key, so a step cached by a full-width run (AVX-512: 32 bf16 lanes) was
# reused here, its C++ built for AVX2's 16, and the logits came out NaN (seen 2026-12-05, fused rung).
export TORCHINDUCTOR_CACHE_DIR=${TMPDIR:-/tmp}/engine_lib-inductor-avx2
exec "$@"
