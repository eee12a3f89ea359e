# Sourced by the GPU scripts (bench/gpu_engines.sh, bench/gpu_checks.sh) on a GPU
# machine: the wheels in .whl/ (packages the machine lacks), then mmyatt itself.
# Sets OUT (the output folder: OUT if set, else bench_out/) and PYTHONPATH.
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# mmyatt itself (models/, rewards/, datasets/ import as mmyatt.*): an editable install, or,
# where the image's setuptools cannot build it, the same layout from links on PYTHONPATH
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    > "$OUT/install.log" 2>&1; then
  echo "editable install failed (see install.log); using a linked source tree"
  rm -rf /tmp/mmsrc && mkdir -p /tmp/mmsrc/mmyatt && cp -r mmyatt/. /tmp/mmsrc/mmyatt/
  for d in models rewards datasets; do ln -s "$PWD/$d" "/tmp/mmsrc/mmyatt/$d"; done
  ln -s "$PWD/configs" /tmp/mmsrc/configs  # mmyatt.bench.CONFIGS: beside the package
  export PYTHONPATH=/tmp/mmsrc${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
