"""Gangs for distributed training: N agents at once, all or nothing."""
