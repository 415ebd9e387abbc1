"""The content layer: the bytes of one identity (trees, chunks, the restore cache, transfers, restores, snapshots,
progress). It reads and writes through a byte store and never imports the protocol layer above it."""
