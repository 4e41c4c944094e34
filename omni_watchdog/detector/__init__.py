"""The detector: turns observations into per-stage states and verdicts, without I/O."""

from omni_watchdog.detector.core import Detector

__all__ = ["Detector"]
