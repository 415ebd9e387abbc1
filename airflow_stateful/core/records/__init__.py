"""What is stored, and nothing that does I/O: canonical JSON and hashing, format versions and limits, heads,
manifests, trees, outputs, fields, codecs, identities. The bottom layer of the core: it imports no other."""
