#!/usr/bin/env bash
# Spark's GPU discovery script (spark.{worker,executor,driver}.resource.gpu.discoveryScript): prints
# the CUDA devices nvidia-smi sees as {"name": "gpu", "addresses": ["0", "1", ...]}.
set -euo pipefail
ids=$(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' | paste -sd, - | sed 's/,/", "/g')
echo "{\"name\": \"gpu\", \"addresses\": [\"${ids}\"]}"
