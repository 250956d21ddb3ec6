"""Measuring what really happens: the memory tracker (peaks by dispatch), the allocator's witness, and op timings."""
