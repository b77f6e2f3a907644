"""Normalise one shard of the raw data set (read from its chunkfs mount) (stdlib only)."""

import argparse
import csv
import json
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, required=True)
parser.add_argument("--raw", type=Path, required=True, help="the mounted raw data set")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

with open(args.raw / f"shard-{args.shard}.csv", newline="") as f:
    rows = [(float(r["x"]), float(r["y"]), int(r["label"])) for r in csv.DictReader(f)]
mx = sum(r[0] for r in rows) / len(rows)
my = sum(r[1] for r in rows) / len(rows)
rows = [(x - mx, y - my, label) for x, y, label in rows]

shards = args.out / "shards"
shards.mkdir(parents=True, exist_ok=True)
(shards / f"{args.shard}.json").write_text(json.dumps(rows))
print(f"shard {args.shard}: {len(rows)} rows from {args.raw} written to {shards}")
