#!/usr/bin/env bash
# A task of one's own (huber.py) on ratings: make data -> ingest -> train -> eval -> export ->
# predict.   bash examples/custom_task/run.sh            (WORK=DIR to keep the files there)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${WORK:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"
cp "$HERE/config.yaml" "$HERE/ingest.yaml" .
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"   # huber.py: the config names huber:HuberRegression
python "$HERE/make_data.py" 60000 ratings.csv
embedtrain ingest ingest.yaml --input ratings.csv --out data
embedtrain train config.yaml --out run --overwrite
embedtrain eval run --split test
embedtrain export run --out export --overwrite
env -u PYTHONPATH embedtrain predict export --raw --input ratings.csv --out predictions.parquet  # no huber.py needed
echo "custom_task: done in $WORK"
