#!/usr/bin/env bash
# Copies the shared libraries a binary needs into DIR (by SONAME), except the C runtime (glibc,
# libstdc++, libgcc_s) and the CUDA libraries, which the runtime image provides; also UCX's dlopen'ed
# transport plugins (DIR/ucx/). The binary's RUNPATH ($ORIGIN/../lib after `cmake --install`) finds them.
#   deploy/docker/bundle-libs.sh BINARY DIR
set -euo pipefail
binary=$1
dir=$2
mkdir -p "$dir"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread\.|libdl\.|librt\.|libstdc\+\+\.|libgcc_s\.|libcuda|libcudart|libcublas|libnccl|libnvidia)'
ldd "$binary" | awk '/=> \// {print $1, $3}' | while read -r soname path; do
  if [[ $soname =~ $skip ]]; then continue; fi
  cp -L "$path" "$dir/$soname"
done
ucs=$(ldd "$binary" | awk '/libucs\.so/ {print $3}')
if [[ -n $ucs && -d $(dirname "$ucs")/ucx ]]; then
  mkdir -p "$dir/ucx"
  cp -L "$(dirname "$ucs")"/ucx/*.so* "$dir/ucx/"
fi
echo "bundle-libs: $(ls "$dir" | wc -l) files in $dir"
