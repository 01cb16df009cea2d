#!/usr/bin/env bash
# Print a directory holding `kube-apiserver` and `etcd` for the Kubernetes test control plane.
#
# Order: $KUBEBUILDER_ASSETS (the envtest convention, for users with their own binaries);
# then the cache ~/.cache/fastshare/envtest/<k8s version>/ (override the root with
# FASTSHARE_ENVTEST_CACHE); otherwise both are built from the Go module proxy with the
# pinned module graph in tools/envtest/ and cached there, so later runs and CI reuse them.
# Only the directory goes to stdout; progress and the build log summary go to stderr.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
tools="$here/tools/envtest"

has_assets() { [[ -x "$1/kube-apiserver" && -x "$1/etcd" ]]; }

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
    if has_assets "$KUBEBUILDER_ASSETS"; then
        echo "$KUBEBUILDER_ASSETS"
        exit 0
    fi
    echo "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS has no executable kube-apiserver and etcd" >&2
    exit 1
fi

version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$tools/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2; exit}' "$tools/go.mod")"
root="${FASTSHARE_ENVTEST_CACHE:-$HOME/.cache/fastshare/envtest}"
dest="$root/$version"

if has_assets "$dest"; then
    echo "$dest"
    exit 0
fi

go_bin="$(command -v go || true)"
[[ -n "$go_bin" ]] || go_bin=/usr/local/go/bin/go
if [[ ! -x "$go_bin" ]]; then
    echo "no Go toolchain (go on PATH or /usr/local/go/bin/go) to build kube-apiserver $version" >&2
    exit 1
fi

mkdir -p "$root"
# One build at a time: a second caller waits for the first and then reuses its result.
exec 9>"$root/.lock"
flock 9
if has_assets "$dest"; then
    echo "$dest"
    exit 0
fi

work="$(mktemp -d "$root/.build-$version.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log="$root/build-$version.log"
echo "building kube-apiserver $version and etcd $etcd_version (log: $log); takes a while on 2 cores" >&2
start=$(date +%s)
(
    cd "$tools"
    export GOFLAGS=-mod=mod CGO_ENABLED=0
    minor="${version#v1.}"
    minor="${minor%%.*}"
    # Stamp the version kube-apiserver reports (/version), as release builds do.
    stamp="-X k8s.io/component-base/version.gitVersion=$version"
    stamp+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
    for name in kube-apiserver etcd; do
        pkg=k8s.io/kubernetes/cmd/kube-apiserver ldflags="-s -w $stamp"
        [[ $name == etcd ]] && pkg=go.etcd.io/etcd/server/v3 ldflags="-s -w"
        echo "== $name ($pkg)"
        timed=()
        [[ -x /usr/bin/time ]] && timed=(/usr/bin/time -f "$name: %e s wall, %U s user, %M KiB max RSS")
        "${timed[@]}" "$go_bin" build -trimpath -ldflags="$ldflags" -o "$work/$name" "$pkg"
    done
) >"$log" 2>&1 || {
    echo "build failed; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
}
grep -E 'max RSS' "$log" >&2 || true
echo "built in $(($(date +%s) - start)) s" >&2
mkdir -p "$dest"
mv "$work/kube-apiserver" "$work/etcd" "$dest/"
echo "$dest"
