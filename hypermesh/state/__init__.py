"""The mesh's state in etcd.

The keyspace, its records and transactions, and the mirrored views built from them.
"""
