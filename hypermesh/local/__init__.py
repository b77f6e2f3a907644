"""Servers on this machine for the local mesh, tests and benchmarks: etcd, agents, an S3 server."""
