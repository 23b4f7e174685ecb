"""A kernel for tests/test_threads.py (imported by name on the hosts): its effect is seen
outside the program, so a test can tell that a record issued just before exit did run."""


def record_sum(x, path):
    """Writes the block's sum to ``path`` (on a device; the metadata rule writes nothing) and
    returns ``x + 0``."""
    if x.device.type != "meta":
        with open(path, "w") as f:
            f.write(str(int(x.sum())))
    return x + 0
