"""Write the example's raw data set: a synthetic two-class data set in CSV shards (stdlib only).

    python3 make_raw.py OUT_DIR [--shards 4] [--rows 5000]

The quickstart puts OUT_DIR into the mesh's object store as the data set
``pipeline-raw``; the recipe's ``prep`` tasks read it through the agents' mounts.
"""

import argparse
import random
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--shards", type=int, default=4)
parser.add_argument("--rows", type=int, default=5000)
args = parser.parse_args()

args.out.mkdir(parents=True, exist_ok=True)
for shard in range(args.shards):
    rng = random.Random(1000 + shard)
    lines = ["x,y,label"]
    for _ in range(args.rows):
        label = rng.random() < 0.5
        cx, cy = (1.5, 1.0) if label else (-1.0, -1.5)
        lines.append(f"{rng.gauss(cx, 1.2)!r},{rng.gauss(cy, 1.2)!r},{int(label)}")
    (args.out / f"shard-{shard}.csv").write_text("\n".join(lines) + "\n")
print(f"raw data set: {args.shards} shards of {args.rows} rows in {args.out}")
