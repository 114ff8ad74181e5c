"""Collators that turn examples into padding-free, SP-ready batches."""

from .packing import SPDataCollator

__all__ = ["SPDataCollator"]
