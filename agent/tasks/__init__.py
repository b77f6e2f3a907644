"""Running tasks on this node.

Attempts as processes or containers, their logs, metrics, folders, GPUs and mounts.
"""
