"""The host role: Blobs, Streams and Events, kernel lowering, and collectives."""
