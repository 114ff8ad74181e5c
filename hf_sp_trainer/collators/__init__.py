"""Collators that turn examples into padding-free, SP-ready batches."""

from .multimodal import SPMultimodalCollator, SPVisionSFTCollator
from .packing import SPDataCollator

__all__ = ["SPDataCollator", "SPMultimodalCollator", "SPVisionSFTCollator"]
