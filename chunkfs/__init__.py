"""chunkfs: data sets packed into chunks in object storage, mounted with FUSE.

Not built yet; see the chunkfs issue. The package exists so the layout is the
one the design card names.
"""
