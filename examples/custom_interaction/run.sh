#!/usr/bin/env bash
# A model of one's own, trained from YAML: train -> eval -> export -> predict on data it makes.
#   bash examples/custom_interaction/run.sh            (WORK=DIR to keep the files there)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"
cp "$HERE/config.yaml" .
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"   # gated.py: the config names gated:GatedDLRM
embedtrain datagen ctr --rows 50000 --out data
embedtrain train config.yaml --out run --overwrite
embedtrain eval run --split test
embedtrain export run --out export --overwrite
env -u PYTHONPATH embedtrain predict export --input data/test --out predictions.parquet  # no gated.py needed
echo "custom_interaction: done in $WORK"
