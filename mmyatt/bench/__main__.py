"""``python -m mmyatt.bench NAME``: run one benchmark and print its JSON."""

import json
import sys

from mmyatt.bench.registry import run_bench

print(json.dumps(run_bench(sys.argv[1]), indent=2))
