#!/usr/bin/env bash
# Builds .venv-sglang: SGLang 0.5.23's real code on a CPU machine, beside the
# CPU build of torch 2.13.0, for the tests marked sglang (tests/sglang).
# sglang, triton, flashinfer-python and apache-tvm-ffi go in with --no-deps
# (sglang pins a CUDA torch); .ci/sglang-requirements.txt lists what their
# imports need. torchvision (which transformers' image utilities look up) is
# a stand-in module with a dist-info, so transformers' version check parses.
# Usage: .ci/sglang-env.sh [VENV]   (default .venv-sglang in the checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}

python3 -m venv "$venv"
py=$venv/bin/python
"$py" -m pip install -q --upgrade pip
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch") != "2.13.0+cpu")' 2>/dev/null; then
    "$py" -m pip install -q torch==2.13.0  # the CPU build, as .ci/run installs it
fi
if ! "$py" -c 'import importlib.metadata as m, sys; sys.exit(m.version("sglang") != "0.5.23")' 2>/dev/null; then
    "$py" -m pip install -q --no-deps sglang==0.5.23 triton==3.9.0 flashinfer-python==0.7.2 \
        apache-tvm-ffi==0.1.11
fi
"$py" -m pip install -q -r .ci/sglang-requirements.txt

# The torchvision stand-in (.ci/torchvision-standin: names SGLang's config
# modules and transformers' image utilities import, none of which the tests
# call) and a dist-info naming a version, so transformers' version check parses.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/torchvision"
cp -r .ci/torchvision-standin/torchvision "$site/torchvision"
mkdir -p "$site/torchvision-0.28.0.dist-info"
printf 'Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n' \
    >"$site/torchvision-0.28.0.dist-info/METADATA"
echo 'moe-sidecar-ci' >"$site/torchvision-0.28.0.dist-info/INSTALLER"
: >"$site/torchvision-0.28.0.dist-info/RECORD"

# The project itself, and its test tools.
"$py" -m pip install -q --no-deps -e .
"$py" -m pip install -q 'grpcio>=1.85.1' 'grpcio-health-checking>=1.85.1' \
    'grpcio-reflection>=1.85.1' 'protobuf>=7.35.1' 'prometheus-client>=0.20' \
    'pytest>=8' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' 'psutil>=5.9'
