"""Declared image sets: kept present (and pinned when asked), reconciling only the difference."""

from .loader import ImageSet, SetFileError, parse_text
from .manager import ImageSets

__all__ = ["ImageSet", "ImageSets", "SetFileError", "parse_text"]
