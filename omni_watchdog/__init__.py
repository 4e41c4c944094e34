"""omni-watchdog: stage tracing, stall detection and remediation for vLLM and vLLM-Omni."""

__version__ = "0.1.0"
