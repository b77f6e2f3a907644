"""Hybrid bursting: the leader's policy, its view of the backlog, provisioners and spot notices."""
