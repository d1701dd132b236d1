#!/usr/bin/env bash
# Train from Python (train.py), then the command line takes the run: eval -> export -> predict.
#   bash examples/pure_python/run.sh            (WORK=DIR to keep the files there)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"
export PYTHONPATH="$HERE/../custom_interaction${PYTHONPATH:+:$PYTHONPATH}"  # the model: gated.py
embedtrain datagen ctr --rows 50000 --out data
rm -rf run && python "$HERE/train.py" data run
embedtrain eval run --split test
embedtrain export run --out export --overwrite
env -u PYTHONPATH embedtrain predict export --input data/test --out predictions.parquet
echo "pure_python: done in $WORK"
