"""The leaf every other part of the package stands on: paths, error types, resolvers and the job's topology.

Nothing here imports the rest of the package, or torch at import time, so any module may import it.
"""
