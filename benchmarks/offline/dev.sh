#!/bin/bash
# dev.sh MODEL CHUNK [score]  (on the GPU machine, from the repository root the device tool sends)
# Appends chunk CHUNK of MODEL's bundle (make_bundle.sh) to /tmp/gpueval/MODEL.tar, checking what is
# already there (the machine keeps /tmp only while it stays warm: a lost state says so and stops);
# with "score" (after the last chunk): checks the whole bundle's sha256, unpacks it, installs the
# carried gguf wheel and runs `python -m countdown.eval.offline.device` on the job, writing
# $OUT/MODEL.scores.json.gz (resumed from $CARRY/run/MODEL.scores.json.gz when that is carried).
# $CARRY/run holds: dev.sh, src/ (countdown), gguf-*.whl, MODEL.job.json.gz, MODEL-config/config.json,
# the small artifact files MODEL-*.safetensors and MODEL.manifest; $CARRY/chunks/MODEL.NN the chunk.
M=$1; C=$2; MODE=$3
CARRY=${CARRY:-.device_carry/gpueval}
R=$CARRY/run
D=/tmp/gpueval; mkdir -p $D; B=$D/$M.tar
T0=$(date +%s.%N)
read -r _ _ off size sha < <(grep "^chunk $C " $R/$M.manifest)
have=$(stat -c%s $B 2>/dev/null || echo 0)
if [ "$have" = "$((off+size))" ]; then echo "chunk $C already appended ($have bytes)";
elif [ "$have" != "$off" ]; then echo "STATE LOST: $B has $have bytes, chunk $C starts at $off: start over from chunk 00"; exit 3;
else
  f=$CARRY/chunks/$M.$C
  got=$(sha256sum $f | cut -d' ' -f1)
  [ "$got" = "$sha" ] || { echo "CHUNK $C CORRUPT: $got != $sha"; exit 4; }
  cat $f >> $B; echo "chunk $C appended: $(stat -c%s $B) bytes";
fi
echo "chunk step $(python3 -c "print(round($(date +%s.%N)-$T0,1))") s; uptime $(cut -d' ' -f1 /proc/uptime) s; df /tmp: $(df -h /tmp | tail -1 | awk '{print $4}') free"
[ "$MODE" = "score" ] || exit 0
read -r _ total tsha < <(grep "^total " $R/$M.manifest)
[ "$(stat -c%s $B)" = "$total" ] || { echo "BUNDLE INCOMPLETE: $(stat -c%s $B) of $total"; exit 5; }
[ "$(sha256sum $B | cut -d' ' -f1)" = "$tsha" ] || { echo "BUNDLE SHA256 MISMATCH"; exit 6; }
mkdir -p $D/$M && tar -xf $B -C $D/$M && cp $R/$M-*.safetensors $D/$M/ && echo "bundle verified and unpacked: $(ls $D/$M | tr '\n' ' ')"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/gguf-*.whl || exit 7
[ -f $R/$M.scores.json.gz ] && cp $R/$M.scores.json.gz $OUT/ && echo "resuming from carried scores"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH=$R/src:/tmp/site PYTHONUNBUFFERED=1
python3 -m countdown.eval.offline.device --job $R/$M.job.json.gz --weights $D/$M/$M.pack --config-dir $R/$M-config \
  --artifacts-dir $D/$M --out $OUT/$M.scores.json.gz --chunk 1024 --stop-after ${STOP_AFTER:-400} ${BATCH_TOKENS:+--batch-tokens $BATCH_TOKENS} 2>&1 | tee $OUT/$M.log
echo "dev.sh total $(python3 -c "print(round($(date +%s.%N)-$T0,1))") s"
