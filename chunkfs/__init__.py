"""chunkfs: data sets packed into chunks in object storage, mounted with FUSE.

``pack``/``datasets``/``manifest``/``format`` write and name data sets; ``store`` talks to
the object store; ``cache``, ``fetch``, ``buffers`` and ``pagepush`` get a chunk's bytes to a
reader; ``fs``, ``mount``, ``outputs`` and ``fusewait`` are the FUSE file system. A mount
talks to its local agent over gRPC only (``agent_fetch``, ``holdings``): it imports no part
of the agent.
"""
