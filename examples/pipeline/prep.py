"""Generate one shard of a synthetic two-class data set and normalise it (stdlib only)."""

import argparse
import json
import random
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--rows", type=int, default=5000)
args = parser.parse_args()

rng = random.Random(1000 + args.shard)
rows = []
for _ in range(args.rows):
    label = rng.random() < 0.5
    cx, cy = (1.5, 1.0) if label else (-1.0, -1.5)
    rows.append((rng.gauss(cx, 1.2), rng.gauss(cy, 1.2), int(label)))
mx = sum(r[0] for r in rows) / len(rows)
my = sum(r[1] for r in rows) / len(rows)
rows = [(x - mx, y - my, label) for x, y, label in rows]

shards = args.out / "shards"
shards.mkdir(parents=True, exist_ok=True)
(shards / f"{args.shard}.json").write_text(json.dumps(rows))
print(f"shard {args.shard}: {len(rows)} rows written to {shards}")
