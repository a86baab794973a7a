#!/usr/bin/env bash
# The checks CPU CI cannot make: paft on CUDA with NCCL, one worker per visible GPU.
#
#   scripts/gpu_check.sh WORKDIR          # on a machine with torch + CUDA, from the repo root
#
# Runs from the source tree with the machine's own python3 and torch (PYTHON=...
# to choose another); installs nothing. It checks, going on past a failure (device
# time is scarce: one call should show every problem) and exiting 1 if any failed:
#   1. the CUDA tests of the suite (`-k cuda`: fingerprints and the comm hook's
#      device-side sums on the GPU equal the CPU's);
#   2. `paft train` fault-free, and with one transient bit-30 flip in a local
#      gradient under --guard: detected, recomputed, and the run ends with the
#      fault-free run's state fingerprint (bitwise-equal end state) where the
#      GPU kernels are deterministic, which is printed either way;
#   3. `paft train --protect dyn` under aggregation bit flips: one replica at the end;
#   4. `paft bench overhead` at global batch 64 (as paft train) and 512.
# WORKDIR receives the run directories, overhead-*/results.md and check.txt.
# DEVICE=cpu runs the same on CPU/gloo (to try the script without a GPU); STEPS,
# OVERHEAD_STEPS and BATCHES (the overhead's global batch sizes) shorten it.
set -uo pipefail
work=${1:?usage: scripts/gpu_check.sh WORKDIR}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
steps=${STEPS:-200}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
paft() { "$py" -m paft.cli "$@"; }
summary() { "$py" -c 'import json, sys; s = json.load(open(sys.argv[1])); print(" ".join(f"{k}={s[k]}" for k in sys.argv[2:]))' "$@"; }
mkdir -p "$work"
failed=()
check() { local name=$1; shift; "$@" || { echo "FAILED: $name" >&2; failed+=("$name"); }; }

if [ "$device" = cuda ]; then
    nvidia-smi -L
    ws=$("$py" -c 'import torch; print(torch.cuda.device_count())')
    check cuda-tests "$py" -m pytest -q -p no:cacheprovider src/paft -k cuda
else
    ws=2
fi
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
echo "device $device, world size $ws"
per_ws() { echo $(( ($1 + ws - 1) / ws * ws )); }  # a global batch that splits evenly
common=(--device "$device" --world-size "$ws" --steps "$steps" --batch-size "$(per_ws 64)" --quiet)

check clean paft train "${common[@]}" --run-dir "$work/clean" --overwrite
check transient paft train "${common[@]}" --run-dir "$work/transient" --overwrite --guard \
    --inject "bitflip:site=local-grad,steps=$((steps / 2)),bits=30,ranks=0"
check dyn paft train "${common[@]}" --run-dir "$work/dyn" --overwrite --protect dyn \
    --inject "bitflip:rate=0.05,bits=exponent,ranks=0"
{
    for run in clean transient dyn; do
        [ -f "$work/$run/summary.json" ] || continue
        echo "$run: $(summary "$work/$run/summary.json" final_val_loss replicas_distinct faults_injected \
            detections recomputes syncs state_fingerprint steps_per_s)"
    done
} | tee "$work/check.txt"
check outcomes "$py" - "$work" >"$work/outcomes.txt" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
clean, transient, dyn = (json.loads((work / r / "summary.json").read_text()) for r in ("clean", "transient", "dyn"))
assert transient["detections"] >= 1 and transient["recomputes"] >= 1, "the guard missed the bit-30 flip"
assert transient["replicas_distinct"] == 1 and dyn["replicas_distinct"] == 1, "replicas differ at the end"
same = transient["state_fingerprint"] == clean["state_fingerprint"]
print(f"transient + guard ends bitwise like the fault-free run: {same}; "
      f"val loss {transient['final_val_loss']:.6f} vs {clean['final_val_loss']:.6f}")
gap = abs(dyn["final_val_loss"] / clean["final_val_loss"] - 1)
print(f"dyn under aggregation flips: val loss {dyn['final_val_loss']:.4f}, {100 * gap:.2f}% from fault-free")
EOF
tee -a "$work/check.txt" <"$work/outcomes.txt"

for batch in ${BATCHES:-64 512}; do
    check "overhead-b$batch" paft bench overhead --device "$device" --world-size "$ws" --batch-size "$(per_ws "$batch")" \
        --steps "${OVERHEAD_STEPS:-200}" --out "$work/overhead-b$batch" --overwrite
done

echo "failed checks: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
