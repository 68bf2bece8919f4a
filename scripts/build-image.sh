#!/usr/bin/env bash
# Builds the sidecar image from docker/Dockerfile on a machine with no Docker
# engine and no container registry: Debian packages and PyPI only.
#
#   apt-get install mmdebstrap podman buildah runc
#   scripts/build-image.sh [--clean] [TAG]        (TAG: moe-sidecar:0.1.0)
#
# 1. The base: a minimal Debian of this machine's release, with its python3,
#    from this machine's own apt sources (mmdebstrap), imported into podman's
#    storage. It replaces the Dockerfile's python:3.11-slim (a registry image)
#    through the PYTHON_IMAGE build argument, the only change to the build.
# 2. docker/Dockerfile, built by buildah (chroot isolation: no daemon, no
#    network namespace); pip inside the build trusts this machine's CA bundle,
#    mounted for the build only (it ends up in no layer).
#
# The base is kept between runs: its rootfs tarball under
# $SIDECAR_IMAGE_CACHE (default /var/cache/moe-sidecar/image) and the
# imported image in podman's storage, both named by a hash of the release, the
# architecture, the package list and the apt sources, so a change to any of
# them builds a new base. buildah's layer cache is kept too. --clean ignores
# all three (what docs/image.md's figures were measured with).
#
# Every step runs under a time limit; a failed step is tried once more, and a
# second failure (or a timeout) names the step. The last line printed is
# "image TAG: N MB, built in S s".
set -euo pipefail
cd "$(dirname "$0")/.."

clean=0
tag=moe-sidecar:0.1.0
for arg in "$@"; do
    case "$arg" in
        --clean) clean=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        -*)
            echo "build-image: unknown option $arg (use --clean or --help)" >&2
            exit 2
            ;;
        *) tag=$arg ;;
    esac
done

cache_dir=${SIDECAR_IMAGE_CACHE:-/var/cache/moe-sidecar/image}
# What the Dockerfile needs from the base: python3 with venv (the build stage's
# `python -m venv`), `python` itself, and CA certificates for pip.
packages=python3,python3-venv,python-is-python3,ca-certificates
ca_bundle=/etc/ssl/certs/ca-certificates.crt
# Seconds per step: generous for a loaded machine, short of CI's budget.
base_limit=${IMAGE_BASE_TIMEOUT:-900}
import_limit=300
build_limit=${IMAGE_BUILD_TIMEOUT:-900}

fail() {
    echo "build-image: $*" >&2
    exit 1
}

# step NAME LIMIT COMMAND...: runs COMMAND under LIMIT seconds; a failure or a
# timeout names the step and stops the build. A step that fetches from the
# network (the apt mirror, PyPI) gets a second attempt after a failure, not
# after a timeout: one dropped connection should not fail a CI run.
step() {
    local name=$1 limit=$2 started=$SECONDS status=0 attempt
    shift 2
    for attempt in 1 2; do
        echo "build-image: $name (attempt $attempt, at most ${limit} s)"
        status=0
        timeout --kill-after=10 "$limit" "$@" || status=$?
        if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
            fail "$name: still running after ${limit} s, stopped"
        elif [ "$status" -eq 0 ]; then
            echo "build-image: $name done in $((SECONDS - started)) s"
            return 0
        fi
        echo "build-image: $name failed (exit status $status)" >&2
    done
    fail "$name: failed twice (exit status $status), see its output above"
}

missing=()
for tool in mmdebstrap podman buildah runc timeout sha256sum; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    fail "missing ${missing[*]}: apt-get install mmdebstrap podman buildah runc"
fi
[ "$(id -u)" -eq 0 ] || fail "run as root (mmdebstrap and buildah write a root filesystem)"
[ -r /etc/os-release ] || fail "/etc/os-release is missing: cannot tell this machine's release"
# shellcheck disable=SC1091
suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$suite" ] || fail "/etc/os-release names no VERSION_CODENAME (Debian or a derivative needed)"
arch=$(dpkg --print-architecture)
[ -r "$ca_bundle" ] || fail "$ca_bundle is missing: apt-get install ca-certificates"

# This machine's apt sources, as mmdebstrap takes them: one file per argument.
sources=()
for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] && grep -qE '^[[:space:]]*(deb|Types:)' "$file" && sources+=("$file")
done
[ "${#sources[@]}" -gt 0 ] || fail "no apt sources in /etc/apt/sources.list{,.d/}"

# merged-/usr by symlinks, as Debian's own container images do, rather than
# the usrmerge package, which would pull a full perl (60 MB) into the image;
# no documentation beyond the copyright files.
base_options=(
    --variant=minbase --include="$packages"
    --hook-dir=/usr/share/mmdebstrap/hooks/maybe-merged-usr
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
)
key=$(
    {
        echo "$suite $arch ${base_options[*]}"
        cat "${sources[@]}"
    } | sha256sum | cut -c1-12
)
base_image=localhost/moe-sidecar-base:$suite-$key
base_tar=$cache_dir/base-$suite-$arch-$key.tar
started=$SECONDS

if [ "$clean" -eq 1 ]; then
    podman image exists "$base_image" && podman rmi --force "$base_image" >/dev/null
    rm -f "$base_tar"
fi

if podman image exists "$base_image"; then
    echo "build-image: base $base_image is in podman's storage"
else
    if [ -s "$base_tar" ]; then
        echo "build-image: base rootfs cached at $base_tar"
    else
        mkdir -p "$cache_dir" || fail "cannot create $cache_dir (set SIDECAR_IMAGE_CACHE)"
        # Written beside its final name and renamed once complete, so an
        # interrupted run never leaves a truncated tarball to reuse.
        partial=$base_tar.partial.$$
        trap 'rm -f "$partial"' EXIT
        step "base rootfs: mmdebstrap $suite ($packages)" "$base_limit" \
            bash -c 'rm -f "$0" && exec mmdebstrap "$@"' "$partial" \
            --quiet "${base_options[@]}" --format=tar "$suite" "$partial" "${sources[@]}"
        mv "$partial" "$base_tar"
        trap - EXIT
        # Tarballs of other sources or options are superseded by this one.
        find "$cache_dir" -maxdepth 1 -name 'base-*.tar' ! -path "$base_tar" -delete
    fi
    # The python images' environment: their PATH (the Dockerfile's ENV PATH
    # extends it) and a UTF-8 locale.
    step "base image: podman import" "$import_limit" \
        podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        "$base_tar" "$base_image"
fi

layers=(--layers)
[ "$clean" -eq 1 ] && layers+=(--no-cache)
step "image: buildah bud -f docker/Dockerfile -t $tag" "$build_limit" \
    buildah bud --quiet --isolation chroot "${layers[@]}" --pull=never \
    -v "$ca_bundle:$ca_bundle:ro" \
    --build-arg "PYTHON_IMAGE=$base_image" \
    -f docker/Dockerfile -t "$tag" .

# Superseded builds (the previous tag's layers, old build stages) stay as
# untagged images that later builds may reuse; a week old, they go, so a CI
# machine's disk does not fill up build by build.
podman image prune --force --filter until=168h >/dev/null ||
    echo "build-image: warning: could not prune untagged images older than a week" >&2

size=$(podman image inspect --format '{{.Size}}' "$tag") || fail "$tag: not in podman's storage after the build"
echo "image $tag: $((size / 1000000)) MB, built in $((SECONDS - started)) s"
