"""Every bound on a recipe, in one place (``docs/recipes.md``, "Limits").

Whatever its text, a recipe is accepted or rejected with a list of problems in well under
a second: the document is bounded before it is composed (text, keys and values, nesting;
``located.py`` checks them on YAML's event stream), each value as it is read (length of a
value, of a number), and each field by what the mesh can use (counts, sizes, durations).
A value past a bound is a problem like any other, with its line and field.
"""

from __future__ import annotations

# ------------------------------------------------------------------ the document
MAX_TEXT = 1024 * 1024
"""Characters a recipe may have, also counting scalar text repeated by aliases."""
MAX_NODES = 30_000
"""Keys and values a recipe may have once aliases are expanded: room for a list of 29,000
shard numbers, which takes about half a second to read and check."""
MAX_DEPTH = 32
"""Levels of nested mappings and lists, aliases expanded (a recipe uses 6)."""
MAX_SCALAR = 64 * 1024
"""Characters in one value (a command, a name)."""
MAX_NUMBER = 100
"""Characters in one number: far beyond any count or bound, far below the 4,300 digits
where Python refuses to convert an int."""
HINTS = 20
""""Did you mean" hints per recipe: each compares a word with every choice, and a recipe of
ten thousand typos needs no ten thousand hints."""

# ------------------------------------------------------------------ the fields
MAX_INT = 2**63 - 1
"""The largest integer any field takes (those with a use for less say so below)."""
MAX_DURATION = 365 * 86400.0
"""The longest duration any field takes (``timeout``): a year."""
MAX_EXPERIMENTS = 1000
MAX_SAMPLES = 10**9
"""Most tasks one experiment may draw: the highest the mesh's ``max-workflow-tasks`` goes."""
MAX_WORKERS = 10_000
"""The highest ``workers`` cap: claims scan the slots below it (a cap above the mesh's
slots caps nothing: leave it out)."""
MAX_GANG = 1024
"""Most members of one gang (``nodes``)."""
MAX_RETRIES = 1000
MAX_GPUS = 1024.0
MAX_CPUS = 100_000.0
MAX_STORED = 1024 * 1024
"""Bytes of a recipe in its stored (JSON) form: the workflow record is one etcd value, and
each experiment stores the top-level ``env`` with its own."""
# Sizes (``memory``, ``gpu_memory``) are at most 1 EiB: ``hypermesh.recipe.units.MAX_SIZE``.
