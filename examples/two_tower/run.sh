#!/usr/bin/env bash
# A two-tower retrieval model of one's own (towers.py) on next-item data: make data -> train ->
# eval -> export -> predict (a history through the query tower -> the top-k items of the corpus).
#   bash examples/two_tower/run.sh            (WORK=DIR to keep the files there)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"
cp "$HERE/config.yaml" .
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"   # towers.py: the config names towers:MeanTower
embedtrain datagen seq --users 4000 --items 2000 --clusters 20 --max-length 20 --out data
embedtrain train config.yaml --out run --overwrite
embedtrain eval run --split test
embedtrain export run --out export --overwrite
env -u PYTHONPATH embedtrain predict export --input data/test --out predictions.parquet  # no towers.py needed
echo "two_tower: done in $WORK"
