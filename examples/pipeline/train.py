"""Train logistic regression by gradient descent on shards 0-2; validate on shard 3."""

import argparse
import json
import math
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--l2", type=float, required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--data", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()


def load(i: int) -> list:
    return json.loads((args.data / "shards" / f"{i}.json").read_text())


train = load(0) + load(1) + load(2)
valid = load(3)
w = [0.0, 0.0, 0.0]


def predict(x: float, y: float) -> float:
    z = w[0] * x + w[1] * y + w[2]
    return 1 / (1 + math.exp(-max(-30.0, min(30.0, z))))


def val_acc() -> float:
    return sum((predict(x, y) > 0.5) == bool(label) for x, y, label in valid) / len(valid)


for epoch in range(args.epochs):
    if epoch % 5 == 0:  # a point of the trial's curve (`hypermesh best`, the dashboard)
        print(f"HM_METRIC {json.dumps({'val_acc': val_acc(), 'step': epoch})}")
    g = [0.0, 0.0, 0.0]
    for x, y, label in train:
        err = predict(x, y) - label
        g[0] += err * x
        g[1] += err * y
        g[2] += err
    n = len(train)
    w = [w[i] - args.lr * (g[i] / n + args.l2 * w[i]) for i in range(3)]

accuracy = val_acc()
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "model.json").write_text(json.dumps({"w": w, "val_acc": accuracy, "lr": args.lr}))
print(f"lr={args.lr:.4f} l2={args.l2} epochs={args.epochs} val_acc={accuracy:.4f}")
# The last report is the value `hypermesh best` ranks by.
print(f"HM_METRIC {json.dumps({'val_acc': accuracy, 'step': args.epochs})}")
