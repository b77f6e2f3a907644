"""The hypermesh agent: the daemon that ``hypermesh agent start`` runs on every machine."""
