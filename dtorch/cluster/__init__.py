"""Launching the runtime's processes and keeping their lifetimes tied together."""
