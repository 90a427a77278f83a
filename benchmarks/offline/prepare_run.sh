#!/bin/bash
# prepare_run.sh MODEL JOB_DIR : fill $CARRY/run (default .device_carry/gpueval/run) with what every device
# call of dev.sh carries: dev.sh, countdown's source, the gguf wheel, MODEL's job, its small artifact files
# (the big ones travel in make_bundle.sh's chunks) and the model's config.json. Run from the repository root.
set -e
CARRY=${CARRY:-.device_carry/gpueval}
M=$1; J=$2
R=$CARRY/run
mkdir -p "$R/$M-config"
cp "$(dirname "$0")/dev.sh" "$R/"
rm -rf "$R/src" && mkdir -p "$R/src" && cp -r src/countdown "$R/src/" && find "$R/src" -name __pycache__ -prune -exec rm -rf {} +
ls "$R"/gguf-*.whl >/dev/null 2>&1 || ${PYTHON:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$R" gguf==0.19.0
cp "$J/$M.job.json.gz" "$R/"
for f in "$J/$M"-*.safetensors; do [ "$(stat -c%s "$f")" -lt 1000000 ] && cp "$f" "$R/"; done
PYTHONPATH=src ${PYTHON:-python3} - "$M" "$R/$M-config" <<'PY'
import shutil, sys
from countdown.data import models
shutil.copy(models._catalogue_folder(models.CATALOGUE[sys.argv[1]]) / "config.json", sys.argv[2])
PY
du -sh "$R"
