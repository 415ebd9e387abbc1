"""Many identities at once: the catalog, status and stuck writers, usage, lifetimes, garbage collection and the
conditions sensors wait for. The top layer of the core."""
