"""Fault harnesses: programs that run the product under faults and check what it
promises (run as ``python -m dataspace.testing.NAME``).  Not imported by the product."""
