#!/usr/bin/env bash
# The GPU measurements of issue 22 item 6, prepared for a session that is lent a GPU (H100/H200): the kernel tests on
# CUDA, the attention kernel benchmark, the training benchmark at the paper's shapes (8 x 2048 tokens, bf16 autocast
# over fp32 master weights; HELM with attn_implementation sdpa and triton beside its twin; eager, then compiled) and a profile
# of one HELM-D training step.
#
# The GPU image has no network and lacks geoopt (which `import helm` needs), omegaconf and datasets (which
# helm.training imports), so their wheels travel with the working tree:
#
#   bash benchmarks/gpu_check.sh --fetch-wheels     here, on the CPU machine: the versions installed here, into .whl/
#                                                   (git-ignored through .git/info/exclude)
#   device run, carry [".whl"], timeout_s 600:      bash benchmarks/gpu_check.sh
#   then, at once, on the warm machine:             bash benchmarks/gpu_check.sh compile
#
# Parts (default: env kernels attention train profile, 9.5 minutes at their timeouts, less in practice; "all" adds
# compile and generate): each runs under its own timeout, so that one that hangs costs its timeout and no more, and
# writes its output to stdout and to <part>.log under $OUT (where the device tool collects files) or
# results/gpu_check/ (git-ignored) when OUT is unset; a summary (each part's exit status and time, the training
# ratios and tables) ends the output and summary.log. The compiled run (six compilations at 8 x 2048 tokens) goes
# last and alone: if the 15 minutes of device time run out, only it is lost.
#
# GPU_CHECK_CPU=1 runs the same parts on a CPU at tiny sizes (timings meaningless) to check the script itself:
# GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh env train profile

set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WHEELS=(geoopt omegaconf datasets dill multiprocess)  # dill, multiprocess: datasets' needs the image lacks

if [ "${1:-}" = --fetch-wheels ]; then
    set -e
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" .whl
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    # the versions the suite passes with here; the image's Python is 3.12, and these are pure Python
    pins=$(python3 -c "import importlib.metadata as m, sys; print(*(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" \
        "${WHEELS[@]}")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
    ls -l .whl
    exit 0
fi

declare -A LIMIT=([env]=60 [kernels]=150 [attention]=90 [train]=180 [profile]=90 [compile]=420 [generate]=150)
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(env kernels attention train profile)
[ "${PARTS[*]}" = all ] && PARTS=(env kernels attention train profile compile generate)
for part in "${PARTS[@]}"; do
    if [ -z "${LIMIT[$part]:-}" ]; then
        echo "gpu_check.sh: unknown part '$part' (${!LIMIT[*]}, all, --fetch-wheels)" >&2
        exit 2
    fi
done

LOGS=${OUT:-$REPO/results/gpu_check}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
IMPORTS="import geoopt, omegaconf, datasets"
if ! python3 -c "$IMPORTS" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    # into a folder of its own: the image's packages stay as they are
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/gpu_check_site:$PYTHONPATH
fi
if ! python3 -c "$IMPORTS" 2>/dev/null; then
    echo "gpu_check.sh: geoopt, omegaconf or datasets is missing: run 'bash benchmarks/gpu_check.sh --fetch-wheels'" \
         "on the CPU machine and carry .whl" >&2
    exit 2
fi

if [ "${GPU_CHECK_CPU:-}" = 1 ]; then
    TRAIN=(--device cpu --dtype bf16 --shapes tiny --steps 1 --repeats 1 --warmup 1 --attn-impl sdpa eager)
    ATTENTION=(env TRITON_INTERPRET=1 python3 benchmarks/attention_triton.py --dry-run-cpu --tokens 128 --heads 2
               --seq 64 --dims 16)
    GENERATE=(--device cpu --dtype bf16 --contexts 64 --new-tokens 4 --steps 2 --repeats 1)
else
    TRAIN=(--device cuda --dtype bf16 --shapes gpu --attn-impl sdpa triton --repeats 3)  # median of 9 steps
    ATTENTION=(python3 benchmarks/attention_triton.py)
    GENERATE=(--device cuda --dtype bf16 --shapes paper --contexts 256 1024 4096 --repeats 2)
fi

SUMMARY=() STATUS=0
run_part() {  # name, command...: the command under the part's timeout, its output on stdout and in name.log
    local name=$1 start=$SECONDS rc
    shift
    echo "== $name (timeout ${LIMIT[$name]} s): ${*%%$'\n'*}"
    timeout -k 20 "${LIMIT[$name]}" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || STATUS=1
    SUMMARY+=("$name: exit $rc$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ", timed out") after $((SECONDS - start)) s")
}

for part in "${PARTS[@]}"; do
    case $part in
    env)
        run_part env bash -c 'nvidia-smi || true; python3 - <<"EOF"
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print(", ".join(f"{p} {m.version(p)}" for p in ["triton", "transformers", "accelerate", "geoopt", "omegaconf",
                                                  "datasets"]))
import helm.training  # noqa: E402, F401  (what the benchmarks import, with the carried wheels)
print("helm.training imports")
EOF' ;;
    kernels) run_part kernels python3 -m pytest tests/ops/lorentz_attention_triton -q -p no:cacheprovider ;;
    attention) run_part attention "${ATTENTION[@]}" ;;
    train) run_part train python3 benchmarks/train_step.py "${TRAIN[@]}" ;;
    profile) run_part profile python3 benchmarks/train_step.py "${TRAIN[@]}" --pairs helm-d --profile ;;
    compile) run_part compile python3 benchmarks/train_step.py "${TRAIN[@]}" --compiled-only ;;
    generate) run_part generate python3 benchmarks/generate.py "${GENERATE[@]}" ;;
    esac
done

{
    echo "== summary"
    printf '%s\n' "${SUMMARY[@]}"
    for part in "${PARTS[@]}"; do
        # the per-pair ratios too: a part cut short by its timeout never printed its table
        case $part in train | compile) grep -E '^  => |^\| |^failed:' "$LOGS/$part.log" ;; esac
    done
} | tee "$LOGS/summary.log"
exit $STATUS
