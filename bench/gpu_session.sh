#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool: torch 2.11 + CUDA preinstalled, no network):
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=590)
# or a few of its steps, to fit what is left of the session's device time:
#   run(command="bash bench/gpu_session.sh real_size tests aio", carry=[".whl"], timeout_s=480)
# Before it, here: wheels of what that machine lacks, into .whl/ (ignored: `echo /.whl/ >> .git/info/exclude`),
# for Python 3.12 x86_64 (see the device tool's README for the pip download flags): tenacity, blake3,
# torchdata, hjson, pydantic, pydantic-core, annotated-types, typing-inspection, and a DeepSpeed wheel built
# here from its sdist with DS_BUILD_OPS=0 (the stop-28 session's list). Writes everything to $OUT: the
# pytest log, the stall rows and the real-size rows (bench/gpu_real_size.py --json), each named by device.
set -uo pipefail
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee -a "$OUT/device.txt"
# The real-size rows first (about 2.5 minutes at 9 GB), the upload probe ("resume": where a cold resume's
# time goes, not in the default run), the GPU tests (about 2 minutes with
# -n 8), the stall rows; "aio" asks whether DeepSpeed's async I/O op (DeepNVMe) can build there. Each step's
# failure is logged, not fatal.
STEPS=" ${*:-real_size probe tests stall} "
if [[ "$STEPS" == *" real_size "* ]]; then
  timeout 220 python3 bench/gpu_real_size.py --json "$OUT/real_size.json" 2>&1 | tee "$OUT/real_size.log" | tail -30
fi
if [[ "$STEPS" == *" probe "* ]]; then
  timeout 80 python3 bench/_gpu_upload_probe.py 2>&1 | tee "$OUT/probe.log"
fi
if [[ "$STEPS" == *" resume "* ]]; then
  timeout 200 python3 bench/_gpu_resume_probe.py 2>&1 | tee "$OUT/resume_probe.log"
fi
if [[ "$STEPS" == *" tests "* ]]; then
  timeout 180 python3 -m pytest tests/test_gpu.py -m gpu -n 8 -rs -q -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.log" | tail -40
fi
if [[ "$STEPS" == *" stall "* ]]; then
  timeout 60 python3 bench/checkpoint_stall.py --device cuda --size-mb 1024 --json "$OUT/stall.jsonl" 2>&1 | tail -20
fi
if [[ "$STEPS" == *" aio "* ]]; then
  { ls -l /usr/include/libaio.h /usr/lib/x86_64-linux-gnu/libaio.so* 2>&1; which nvcc 2>&1
    timeout 60 python3 -c 'from deepspeed.ops.op_builder import AsyncIOBuilder as B; b = B(); print("async_io compatible:", b.is_compatible(verbose=True))' 2>&1 | tail -8
  } | tee "$OUT/aio.log"
fi
ls -l "$OUT"
