"""fastshare: safe GPU sharing (MPS fractions, MIG slices, whole GPUs) with dense placement."""

__version__ = "0.1.0"
